"""The uint8 image cache: built once, reused, rebuilt when the photos change, safe under concurrency."""

from __future__ import annotations

import multiprocessing
import os
import stat
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flowers.data import cache as cache_mod
from flowers.data.cache import CACHE_FOLDER, ensure_cache
from tests.helpers.images import make_tree


def _paths(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*.jpg") if CACHE_FOLDER not in p.parts)


@pytest.fixture
def photos(tmp_path) -> Path:
    return make_tree(tmp_path / "photos", {"a": 3, "b": 2}, size=40)


def _count_builds(monkeypatch) -> list[Path]:
    builds = []
    real = cache_mod._build

    def counting(paths, folder, side):
        builds.append(folder)
        real(paths, folder, side)

    monkeypatch.setattr(cache_mod, "_build", counting)
    return builds


def test_build_then_reuse_without_rebuilding(photos, tmp_path, monkeypatch):
    builds = _count_builds(monkeypatch)
    paths = _paths(photos)
    first = ensure_cache(paths, root=photos, side=32, fallback_dir=tmp_path / "fallback")
    assert first.folder.parent == photos / CACHE_FOLDER
    assert first.pixels.shape == (5, 3, 32, 32) and first.pixels.dtype == np.uint8
    assert first.sizes.tolist() == [[40, 40]] * 5 and first.paths == paths
    expected = np.asarray(Image.open(paths[0]).convert("RGB").resize((32, 32), Image.Resampling.BILINEAR))
    np.testing.assert_array_equal(first.pixels[0], expected.transpose(2, 0, 1))
    second = ensure_cache(paths, root=photos, side=32, fallback_dir=tmp_path / "fallback")
    assert second.folder == first.folder and len(builds) == 1
    assert not list((photos / CACHE_FOLDER).glob(".*tmp*"))  # the temporary folder was renamed away


@pytest.mark.parametrize("change", ["add", "remove", "rewrite", "touch"])
def test_rebuilt_when_the_photos_change(change, photos, tmp_path, monkeypatch):
    builds = _count_builds(monkeypatch)
    old = ensure_cache(_paths(photos), root=photos, side=32, fallback_dir=tmp_path / "fallback")
    victim = Path(_paths(photos)[0])
    if change == "add":
        Image.new("RGB", (50, 30), "red").save(photos / "a" / "new.jpg")
    elif change == "remove":
        victim.unlink()
    elif change == "rewrite":
        Image.new("RGB", (40, 40), "blue").save(victim)
    else:
        os.utime(victim, ns=(victim.stat().st_atime_ns, victim.stat().st_mtime_ns + 10**9))
    new = ensure_cache(_paths(photos), root=photos, side=32, fallback_dir=tmp_path / "fallback")
    assert len(builds) == 2 and new.folder != old.folder
    assert len(new) == len(_paths(photos))
    assert not old.folder.exists()  # the stale cache is removed


def test_read_only_data_dir_falls_back(photos, tmp_path, monkeypatch):
    real = cache_mod.is_writable
    # chmod does not stop root, so read-only is simulated where the check looks.
    monkeypatch.setattr(cache_mod, "is_writable", lambda folder: CACHE_FOLDER not in folder.parts and real(folder))
    cache = ensure_cache(_paths(photos), root=photos, side=32, fallback_dir=tmp_path / "fallback")
    assert cache.folder.parent == tmp_path / "fallback"
    assert not (photos / CACHE_FOLDER).exists() and len(cache) == 5


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_really_read_only_data_dir(photos, tmp_path):
    photos.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        cache = ensure_cache(_paths(photos), root=photos, side=32, fallback_dir=tmp_path / "fallback")
    finally:
        photos.chmod(0o755)
    assert cache.folder.parent == tmp_path / "fallback"


def _build_in_child(paths, root, side, fallback, queue):
    builds = []
    real = cache_mod._build
    cache_mod._build = lambda *a: (builds.append(1), real(*a))
    cache = ensure_cache(paths, root=Path(root), side=side, fallback_dir=Path(fallback))
    queue.put((len(builds), str(cache.folder), int(np.asarray(cache.pixels, dtype=np.int64).sum())))


def test_two_processes_build_one_consistent_cache(photos, tmp_path):
    context = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
    queue = context.Queue()
    args = (_paths(photos), str(photos), 32, str(tmp_path / "fallback"), queue)
    children = [context.Process(target=_build_in_child, args=args) for _ in range(2)]
    for child in children:
        child.start()
    results = [queue.get(timeout=60) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    assert sorted(r[0] for r in results) == [0, 1]  # one built, the other waited and reused it
    assert results[0][1:] == results[1][1:]
    assert [p.name for p in (photos / CACHE_FOLDER).iterdir() if not p.name.startswith(".")] == [
        Path(results[0][1]).name]


def test_a_cache_that_would_not_fit_on_the_disk_stops_before_the_build(photos, tmp_path, monkeypatch):
    import collections

    from flowers.errors import DataError

    builds = _count_builds(monkeypatch)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(cache_mod.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 1000))
    with pytest.raises(DataError, match=r"needs 0\.0 GiB, more than is free .*--data.cache=false"):
        ensure_cache(_paths(photos), root=photos, side=32, fallback_dir=tmp_path / "fallback")
    assert not builds

    # Room in the fallback folder only: the cache goes there.
    monkeypatch.setattr(cache_mod.shutil, "disk_usage",
                        lambda path: usage(10**9, 0, 10**9 if "fallback" in str(path) else 1000))
    cache = ensure_cache(_paths(photos), root=photos, side=32, fallback_dir=tmp_path / "fallback")
    assert cache.folder.parent == tmp_path / "fallback" and len(builds) == 1
