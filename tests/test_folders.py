import json
import logging

import pytest
from PIL import Image

from flowers.data.folders import (
    drop_unreadable,
    find_classes,
    image_problem,
    is_image_file,
    list_image_files,
    list_images,
    stratified_split,
)
from flowers.errors import DataError
from tests.helpers.images import make_tree, write_images


def test_classes_are_sorted_folder_names_and_hidden_ones_are_ignored(tmp_path):
    make_tree(tmp_path, {"tulip": 1, "daisy": 1, "rose": 1})
    (tmp_path / ".thumbnails").mkdir()
    assert find_classes(tmp_path) == ["daisy", "rose", "tulip"]


def test_non_images_hidden_files_and_upper_case_extensions(tmp_path):
    write_images(tmp_path / "a", 2)
    (tmp_path / "a" / ".DS_Store").write_bytes(b"junk")
    (tmp_path / "a" / "LICENSE.txt").write_text("cc-by")
    Image.new("RGB", (70, 70)).save(tmp_path / "a" / "UPPER.JPG")
    names = sorted(p.rsplit("/", 1)[-1] for p, _ in [(s.path, s.label) for s in list_images(tmp_path, ["a"])])
    assert names == ["UPPER.JPG", "img000.jpg", "img001.jpg"]
    assert not is_image_file(tmp_path / "a" / "._img.jpg")


def test_stratified_split_keeps_class_balance_and_is_deterministic(tmp_path):
    make_tree(tmp_path, {"a": 40, "b": 20, "c": 10})
    samples = list_images(tmp_path, ["a", "b", "c"])
    train, val = stratified_split(samples, val_fraction=0.1, seed=7)
    assert sorted(s.label for s in val) == [0] * 4 + [1] * 2 + [2]
    assert not {s.path for s in train} & {s.path for s in val}
    assert len(train) + len(val) == 70
    # The same seed gives the same split whatever the input order; another seed gives another.
    again = stratified_split(list(reversed(samples)), val_fraction=0.1, seed=7)
    assert [s.path for s in again[1]] == [s.path for s in val]
    other = stratified_split(samples, val_fraction=0.1, seed=8)
    assert {s.path for s in other[1]} != {s.path for s in val}


def test_every_class_keeps_at_least_one_image_on_each_side(tmp_path):
    make_tree(tmp_path, {"a": 2, "b": 3})
    train, val = stratified_split(list_images(tmp_path, ["a", "b"]), val_fraction=0.5, seed=0)
    assert {s.label for s in train} == {0, 1} == {s.label for s in val}


def test_unreadable_files_are_skipped_with_one_warning_naming_them(tmp_path, caplog):
    good = write_images(tmp_path / "a", 3)
    (tmp_path / "a" / "empty.jpg").write_bytes(b"")
    (tmp_path / "a" / "text.png").write_text(json.dumps({"not": "an image"}))
    truncated = tmp_path / "a" / "truncated.jpg"
    truncated.write_bytes(good[0].read_bytes()[:300])
    samples = list_images(tmp_path, ["a"])
    assert image_problem(str(truncated)) is not None
    with caplog.at_level(logging.WARNING):
        kept = drop_unreadable(samples, where=tmp_path)
    assert sorted(s.path for s in kept) == sorted(str(p) for p in good)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "Skipping 3 unreadable file(s) of 6" in warnings[0]
    for name in ("empty.jpg", "text.png", "truncated.jpg"):
        assert name in warnings[0]


def test_missing_folder_and_empty_class_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        find_classes(tmp_path / "nope")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="holds no images"):
        list_images(tmp_path, ["a"])


def test_image_files_are_listed_sorted_at_any_depth_without_hidden_or_linked_folders(tmp_path):
    folder = tmp_path / "a"
    photos = write_images(folder, 2) + write_images(folder / "deeper", 1)
    write_images(folder / ".thumbnails", 1)
    (folder / ".DS_Store").write_bytes(b"junk")
    write_images(tmp_path / "elsewhere", 1)
    (folder / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (folder / "loop").symlink_to(folder, target_is_directory=True)  # never entered: the walk ends
    assert list_image_files(folder) == sorted(photos)
    assert [path.relative_to(folder).as_posix() for path in list_image_files(folder)] == [
        "deeper/img000.jpg", "img000.jpg", "img001.jpg"]


def test_a_record_of_verified_files_spares_later_runs_all_but_the_new_and_changed_ones(tmp_path, monkeypatch):
    from flowers.data import folders

    good = write_images(tmp_path / "a", 4)
    (tmp_path / "a" / "empty.jpg").write_bytes(b"")
    record = tmp_path / ".cache" / "verified.json"
    checked = []
    real = folders.image_problem
    monkeypatch.setattr(folders, "image_problem", lambda path: (checked.append(path), real(path))[1])

    def check() -> list[str]:
        checked.clear()
        kept = drop_unreadable(list_images(tmp_path, ["a"]), where=tmp_path, record=record)
        return sorted(s.path for s in kept)

    assert check() == sorted(str(p) for p in good) and len(checked) == 5
    assert check() == sorted(str(p) for p in good) and checked == [str(tmp_path / "a" / "empty.jpg")]
    good[1].write_bytes(good[1].read_bytes()[:300])  # changed (and now truncated): checked again, and dropped
    new = write_images(tmp_path / "b" / "a", 1)[0]  # make a new file in the class folder
    new = new.rename(tmp_path / "a" / "new.jpg")
    assert check() == sorted(str(p) for p in [good[0], good[2], good[3], new])
    assert sorted(checked) == sorted(map(str, [tmp_path / "a" / "empty.jpg", good[1], new]))


def test_the_check_decodes_in_parallel_threads(tmp_path, monkeypatch):
    import threading

    from flowers.data import folders

    write_images(tmp_path / "a", 8)
    real, first_two = folders.image_problem, []
    both_in_flight = threading.Barrier(2, timeout=10)  # broken (an error) unless two decodes wait at once

    def check(path):
        if len(first_two) < 2:
            first_two.append(path)
            both_in_flight.wait()
        return real(path)

    monkeypatch.setattr(folders, "image_problem", check)
    monkeypatch.setattr(folders.os, "cpu_count", lambda: 4)
    assert len(drop_unreadable(list_images(tmp_path, ["a"]), where=tmp_path)) == 8
