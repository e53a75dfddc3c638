"""Folders as people really have them: odd colour modes, rotated phone photos, junk files, broken files."""

import logging
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flowers.cli import cli_main
from flowers.data import FlowerDataModule
from flowers.data.folders import drop_unreadable, list_images
from flowers.data.images import load_rgb
from flowers.data.transforms import eval_transform, train_transform
from flowers.errors import DataError
from tests.helpers.images import write_images
from tests.helpers.runs import TINY_RUN

CROP = 64  # TINY_RUN's image size


def _noise(mode: str, size=(90, 70), seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).convert(mode)


def _rotated(path: Path) -> Path:
    # Stored 40 wide, 80 tall, tagged "rotate 90° clockwise to view" (orientation 6): it is 80×40 to see.
    exif = Image.Exif()
    exif[0x0112] = 6
    _noise("RGB", size=(40, 80)).save(path, exif=exif)
    return path


def _sixteen_bit(path: Path) -> Path:
    Image.fromarray(np.full((60, 60), 40000, np.uint16)).save(path)
    return path


def odd_images(folder: Path) -> dict[str, Path]:
    """One file of every awkward kind that still is an image, by what it is."""
    folder.mkdir(parents=True, exist_ok=True)
    palette = _noise("RGB").convert("P", palette=Image.Palette.ADAPTIVE)
    transparent = palette.copy()
    transparent.info["transparency"] = 0
    made = {
        "grayscale": (_noise("L"), "gray.png"),
        "rgba": (_noise("RGBA"), "rgba.png"),
        "palette": (palette, "palette.png"),
        "palette-transparent": (transparent, "palette_t.png"),
        "cmyk": (_noise("CMYK"), "cmyk.jpg"),
        "tiny": (_noise("RGB", size=(12, 9)), "tiny.jpeg"),
        "upper-jpg": (_noise("RGB"), "UPPER.JPG"),
        "upper-jpeg": (_noise("RGB"), "photo.JPEG"),
        "upper-png": (_noise("RGB"), "scan.PNG"),
        "webp": (_noise("RGB"), "web.WebP"),
    }
    paths = {}
    for kind, (image, name) in made.items():
        image.save(folder / name)
        paths[kind] = folder / name
    paths["exif-rotated"] = _rotated(folder / "rotated.jpg")
    paths["16-bit"] = _sixteen_bit(folder / "deep.png")
    # Very large, but smooth, so the file stays small and the test fast.
    Image.linear_gradient("L").resize((5000, 4000)).convert("RGB").save(folder / "huge.jpg", quality=50)
    paths["huge"] = folder / "huge.jpg"
    return paths


def broken_files(folder: Path) -> list[Path]:
    good = write_images(folder, 1, seed=9, ext=".jpg")[0]
    empty, truncated, text = folder / "empty.jpg", folder / "truncated.jpg", folder / "notes.png"
    empty.write_bytes(b"")
    truncated.write_bytes(good.read_bytes()[:400])
    text.write_text("this is not a picture\n")
    good.unlink()
    return [empty, truncated, text]


def junk_files(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (folder / "._rotated.jpg").write_bytes(b"\0\5\26\7 AppleDouble")  # macOS resource fork, not a JPEG
    (folder / "LICENSE.txt").write_text("CC-BY 2.0\n")
    (folder / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0")
    (folder / "labels.csv").write_text("file,label\n")
    (folder / ".hidden").mkdir()
    write_images(folder / ".hidden", 1)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> tuple[Path, dict[str, Path], list[Path]]:
    """daisy/: every odd kind plus junk and broken files; rose/: plain photos plus junk."""
    root = tmp_path_factory.mktemp("real_world")
    odd = odd_images(root / "daisy")
    broken = broken_files(root / "daisy")
    junk_files(root / "daisy")
    write_images(root / "rose", 8, size=80)
    junk_files(root / "rose")
    (root / "LICENSE.txt").write_text("CC-BY 2.0\n")
    return root, odd, broken


@pytest.mark.parametrize(
    "kind",
    ["grayscale", "rgba", "palette", "palette-transparent", "cmyk", "tiny", "upper-jpg", "upper-jpeg",
     "upper-png", "webp", "exif-rotated", "16-bit", "huge"],
)
def test_every_kind_of_image_loads_as_rgb_and_through_both_transforms(mixed, kind):
    path = str(mixed[1][kind])
    image = load_rgb(path)
    assert image.mode == "RGB"
    for transform in (train_transform(crop_size=CROP), eval_transform(crop_size=CROP)):
        assert tuple(transform(image).shape) == (3, CROP, CROP)


def test_exif_orientation_is_honoured(mixed):
    assert load_rgb(str(mixed[1]["exif-rotated"])).size == (80, 40)


def test_sixteen_bit_grayscale_keeps_its_brightness(mixed):
    # 40000 of 65535 is about 61 % grey; a plain .convert("RGB") would make it white.
    assert load_rgb(str(mixed[1]["16-bit"])).getpixel((0, 0)) == (156, 156, 156)


def test_transparent_pixels_become_white(tmp_path):
    Image.new("RGBA", (70, 70), (200, 10, 10, 0)).save(tmp_path / "clear.png")
    assert load_rgb(str(tmp_path / "clear.png")).getpixel((5, 5)) == (255, 255, 255)


def test_only_images_count_and_broken_ones_are_skipped_with_one_warning(mixed, caplog):
    root, odd, broken = mixed
    samples = list_images(root, ["daisy", "rose"])
    listed = {Path(s.path).name for s in samples if s.label == 0}
    # Junk is never listed; upper-case extensions are; broken files are listed, then dropped.
    assert listed == {p.name for p in odd.values()} | {p.name for p in broken}
    assert sum(s.label == 1 for s in samples) == 8
    with caplog.at_level(logging.WARNING, logger="flowers.data.folders"):
        kept = drop_unreadable(samples, where=root)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert f"Skipping 3 unreadable file(s) of {len(samples)}" in message
    for path in broken:
        assert str(path) in message
    assert {Path(s.path).name for s in kept if s.label == 0} == {p.name for p in odd.values()}


def test_fit_trains_on_the_mixed_folder(mixed, in_tmp, caplog):
    root = mixed[0]
    with caplog.at_level(logging.WARNING, logger="flowers.data.folders"):
        cli = cli_main(["fit", *TINY_RUN, f"--data.data_dir={root}", "--data.val_split=0.25"])
    assert cli.datamodule.class_names == ["daisy", "rose"]
    assert cli.trainer.global_step >= 1
    assert len(cli.datamodule.train_set) + len(cli.datamodule.val_set) == len(mixed[1]) + 8
    assert sum("Skipping 3 unreadable" in r.getMessage() for r in caplog.records) == 1


def test_predict_lists_a_folder_as_training_does(tmp_path):
    # The same lister as the class folders: junk, hidden files and hidden folders (.hidden/ holds an image)
    # are never predicted; sub-folders are searched.
    folder = tmp_path / "to_predict"
    photos = write_images(folder, 2) + write_images(folder / "more", 1)
    junk_files(folder)
    module = FlowerDataModule(predict_dir=str(folder))
    module.setup("predict")
    assert module.predict_set.paths == sorted(str(path) for path in photos)
    junk_files(tmp_path / "only_hidden")
    with pytest.raises(DataError, match="holds no images"):
        FlowerDataModule(predict_dir=str(tmp_path / "only_hidden")).setup("predict")
    with pytest.raises(DataError, match="does not exist"):
        FlowerDataModule(predict_dir=str(tmp_path / "nowhere")).setup("predict")
