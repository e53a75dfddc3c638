"""Finding images in class folders, checking them, and splitting them into train/val.

``torchvision.datasets.ImageFolder`` would do the listing, but it cannot split one folder
into stratified train/val subsets, skip unreadable files with one clear warning, or compare the
class sets of two trees; those are the parts written here.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from lightning.pytorch.utilities import rank_zero_only
from PIL import UnidentifiedImageError

from flowers.data.images import DECODE_ERRORS, open_image
from flowers.errors import DataError
from flowers.files import atomic_write_text, is_writable

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")


@dataclass(frozen=True)
class Sample:
    path: str
    label: int


def is_image_file(path: Path) -> bool:
    # Hidden files (.DS_Store, ._IMG_1.jpg from macOS) are never images, whatever their extension.
    return not path.name.startswith(".") and path.suffix.lower() in IMAGE_EXTENSIONS


def find_classes(root: Path) -> list[str]:
    """Class names are the sorted sub-folder names, as ImageFolder does (so indices agree with it)."""
    if root.is_file():
        raise DataError(
            f"Data folder {str(root)!r} is a file, not a folder. Point --data.data_dir at the folder that holds "
            "the class folders (root/<class>/*.jpg), not at an image or archive inside it."
        )
    if not root.is_dir():
        raise DataError(
            f"Data folder {str(root)!r} does not exist or is not a folder. Point --data.data_dir at a "
            "folder of class folders (root/<class>/*.jpg) or of train/ and val/ folders of class folders."
        )
    entries = [entry for entry in os.scandir(root) if not entry.name.startswith(".")]
    classes = sorted(entry.name for entry in entries if _is_class_dir(entry, root))
    if not classes:
        raise DataError(
            f"Data folder {str(root)!r} has no class folders. Expected root/<class>/*.jpg, one "
            "sub-folder per class, or root/train/<class>/ and root/val/<class>/."
        )
    return classes


def _is_class_dir(entry: os.DirEntry, root: Path) -> bool:
    try:
        is_dir = entry.is_dir()  # follows a symlink: a linked class folder is a class folder
    except OSError as error:  # ELOOP: a link that points at itself
        raise DataError(
            f"{entry.path!r} in the data folder cannot be followed ({error.strerror}); it is a symlink loop. "
            "Remove the link or point it at a real folder of images."
        ) from None
    if is_dir and entry.is_symlink() and root.resolve().is_relative_to(Path(entry.path).resolve()):
        # A link to the data folder or above it would read every class's photos as one more class.
        raise DataError(
            f"Class folder {entry.path!r} is a symlink back to {str(Path(entry.path).resolve())!r}, which "
            "contains the data folder itself (a symlink loop). Remove the link."
        )
    return is_dir


def is_split_layout(root: Path) -> bool:
    """The tutorial's layout: root/train/<class>/ and root/val/<class>/."""
    return (root / "train").is_dir() and (root / "val").is_dir()


def list_image_files(folder: Path) -> list[Path]:
    """The image files under ``folder``, at any depth, sorted; hidden files and hidden folders are skipped.

    Symlinked sub-folders are not entered (``folder`` itself may be a link): a symlink loop inside the
    data cannot make the walk run forever.
    """
    paths = []
    for dirpath, dirnames, filenames in os.walk(folder):
        # Hidden folders (.ipynb_checkpoints, .thumbnails) hold copies and thumbnails, not more photos.
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        paths.extend(Path(dirpath) / filename for filename in filenames if is_image_file(Path(filename)))
    return sorted(paths)


def list_images(root: Path, classes: Sequence[str]) -> list[Sample]:
    samples = []
    for label, name in enumerate(classes):
        folder = root / name
        paths = list_image_files(folder)
        if not paths:
            raise DataError(
                f"Class folder {str(folder)!r} holds no images (looked for {', '.join(IMAGE_EXTENSIONS)}, "
                "any case). Add images to it, or remove the folder if it is not a class."
            )
        samples.extend(Sample(str(path), label) for path in paths)
    return samples


def image_problem(path: str) -> str | None:
    """Why ``path`` cannot be trained on, or None when it decodes.

    A full decode is the only way to catch a truncated JPEG; ``draft`` makes it a reduced-size
    decode, about 0.5 ms per photo, so checking the whole set up front stays cheap.
    """
    try:
        if os.path.getsize(path) == 0:
            return "empty file"
        with open_image(path) as image:
            image.draft("RGB", (max(1, image.width // 8), max(1, image.height // 8)))
            image.load()
    except UnidentifiedImageError:
        return "not an image"
    except DECODE_ERRORS as error:
        return str(error) or type(error).__name__
    return None


def drop_unreadable(samples: list[Sample], *, where: Path, record: Path | None = None) -> list[Sample]:
    """The documented policy: unreadable files are skipped with one warning that counts and names them.

    The check decodes in threads (PIL releases the GIL), one per core up to 8. ``record``: a JSON file of
    the files found readable, each with its size and mtime, read first and rewritten after: a later run
    decodes only the files that are new or changed since.
    """
    verified = _read_record(record)
    stats = {s.path: _size_and_mtime(s.path) for s in samples}
    unchecked = [s.path for s in samples if stats[s.path] is None or verified.get(s.path) != stats[s.path]]
    problems = {}
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for start in range(0, len(unchecked), 1024):  # a future per file at once would hold memory per file
            chunk = unchecked[start:start + 1024]
            problems.update((path, why) for path, why in zip(chunk, pool.map(image_problem, chunk), strict=True)
                            if why)
    if record is not None:
        _write_record(record, {s.path: stats[s.path] for s in samples
                               if s.path not in problems and stats[s.path] is not None})
    if not problems:
        return samples
    shown = "; ".join(f"{path} ({why})" for path, why in list(problems.items())[:10])
    more = f"; and {len(problems) - 10} more" if len(problems) > 10 else ""
    if rank_zero_only.rank == 0:  # every DDP rank checks the same files; one of them says so
        log.warning(
            "Skipping %d unreadable file(s) of %d under %s: %s%s",
            len(problems), len(samples), where, shown, more,
        )
    kept = [s for s in samples if s.path not in problems]
    if not kept:
        raise DataError(f"No readable images under {str(where)!r}: all {len(samples)} files failed to decode.")
    return kept


def _size_and_mtime(path: str) -> list[int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None  # gone or unreachable: checked, and reported, as unreadable
    return [stat.st_size, stat.st_mtime_ns]


def _read_record(record: Path | None) -> dict[str, list[int]]:
    if record is None:
        return {}
    try:
        return json.loads(record.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: check everything


def _write_record(record: Path, verified: dict[str, list[int]]) -> None:
    if rank_zero_only.rank != 0 or not is_writable(record.parent):
        return  # a read-only data folder: every run checks every file
    try:
        atomic_write_text(record, json.dumps(verified))
    except OSError:
        pass  # a record that could not be written only costs the next run a full check


def stratified_split(
    samples: Sequence[Sample], *, val_fraction: float, seed: int
) -> tuple[list[Sample], list[Sample]]:
    """Split each class separately so val keeps the class balance of the whole set.

    The result depends only on the sorted file list, the fraction and the seed, never on global
    RNG state, so every DDP rank and every rerun computes the same split.
    """
    by_label: dict[int, list[Sample]] = {}
    for sample in sorted(samples, key=lambda s: s.path):
        by_label.setdefault(sample.label, []).append(sample)
    train, val = [], []
    for label, members in sorted(by_label.items()):
        order = np.random.default_rng([seed, label]).permutation(len(members))
        # At least one val image per class, and at least one left to train on.
        n_val = min(max(1, round(len(members) * val_fraction)), len(members) - 1)
        val.extend(members[i] for i in order[:n_val])
        train.extend(members[i] for i in order[n_val:])
    return train, val
