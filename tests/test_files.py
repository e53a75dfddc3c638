"""flowers.files: atomic writes, the lock, and folders built once by racing or killed processes."""

from __future__ import annotations

import errno
import importlib.util
import io
import logging
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

import pytest

FILES_PY = Path(__file__).resolve().parents[1] / "flowers" / "files.py"


def _load_files():
    # From its file: importing the flowers package pulls in Lightning, seconds per spawned child.
    spec = importlib.util.spec_from_file_location("flowers_files_under_test", FILES_PY)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


files = _load_files()


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ---------------------------------------------------------------------------------------------
# atomic_write


def test_atomic_write_replaces_the_file_whole(tmp_path):
    target = tmp_path / "deep" / "report.txt"
    files.atomic_write_text(target, "first ✓\n")
    files.atomic_write(target, lambda file: file.write(b"second"))
    assert target.read_bytes() == b"second"
    assert _entries(target.parent) == ["report.txt"]
    files.atomic_write_text(target, "third ✓\n")
    assert target.read_text(encoding="utf-8") == "third ✓\n"


def test_a_failing_writer_leaves_the_old_file_and_no_temporary_file(tmp_path):
    target = tmp_path / "last.ckpt"
    target.write_bytes(b"old")

    def half_then_fail(file):
        file.write(b"half of the new")
        raise ValueError("cannot pickle this")

    with pytest.raises(ValueError, match="cannot pickle"):
        files.atomic_write(target, half_then_fail)
    assert target.read_bytes() == b"old"
    assert _entries(tmp_path) == ["last.ckpt"]


def test_the_new_file_gets_what_open_would_give_it_under_the_umask(tmp_path):
    previous = os.umask(0o027)
    try:
        files.atomic_write(tmp_path / "atomic", lambda file: file.write(b"x"))
        (tmp_path / "plain").write_bytes(b"x")
    finally:
        os.umask(previous)
    mode = (tmp_path / "atomic").stat().st_mode & 0o777
    assert mode == (tmp_path / "plain").stat().st_mode & 0o777
    if os.name == "posix":
        assert mode == 0o640  # mkstemp alone would leave 0o600


class _FullDisk(io.FileIO):
    """A file on a full disk: every write fails as the kernel reports it."""

    raised: OSError | None = None

    def write(self, data):
        _FullDisk.raised = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise _FullDisk.raised


def test_a_full_disk_is_reported_even_when_the_writer_hides_it(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    target.write_bytes(b"old")
    monkeypatch.setattr(files.os, "fdopen", lambda handle, mode: _FullDisk(handle, "w"))

    def like_torch_save(file):
        # torch.save turns the OSError of its writer into a RuntimeError without the errno.
        try:
            file.write(b"weights")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc] . unexpected pos 64 vs 0") from None

    with pytest.raises(OSError) as raised:
        files.atomic_write(target, like_torch_save)
    assert raised.value is _FullDisk.raised and raised.value.errno == errno.ENOSPC
    assert raised.value.strerror == os.strerror(errno.ENOSPC)
    monkeypatch.undo()
    assert target.read_bytes() == b"old"
    assert _entries(tmp_path) == ["last.ckpt"]


def test_is_writable(tmp_path):
    assert files.is_writable(tmp_path / "new" / "folder") and (tmp_path / "new" / "folder").is_dir()
    (tmp_path / "a_file").write_text("")
    assert not files.is_writable(tmp_path / "a_file" / "below")


# ---------------------------------------------------------------------------------------------
# locked


def test_locked_makes_a_second_holder_wait_and_says_why(tmp_path, caplog):
    target = tmp_path / "photos"
    order = []

    def second_holder():
        with files.locked(target, waiting_for="testing"):
            order.append("second")

    waiting = f"Waiting for another process to finish testing in {target}"
    with caplog.at_level(logging.INFO), files.locked(target, waiting_for="testing"):
        thread = threading.Thread(target=second_holder)
        thread.start()
        deadline = time.monotonic() + 10
        while waiting not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
        assert waiting in caplog.text
        order.append("first")
    thread.join(timeout=10)
    assert order == ["first", "second"]
    assert _entries(tmp_path) == [".photos.lock"]  # the lock file stays; the target was never made


# ---------------------------------------------------------------------------------------------
# build_once


def _is_complete(folder: Path) -> bool:
    return (folder / "done").is_file()


def _build_counted(folder: Path, *, counter: Path, pause_s: float = 0.0) -> None:
    with open(counter, "a") as log:
        log.write(f"{os.getpid()}\n")
    (folder / "data.txt").write_text("complete")
    time.sleep(pause_s)  # long enough for a racing process to reach the lock
    (folder / "done").write_text("")


def _build_in_child(target: str, counter: str, start) -> None:
    start.wait(timeout=60)
    built = files.build_once(Path(target), lambda folder: _build_counted(folder, counter=Path(counter), pause_s=0.5),
                             is_complete=_is_complete, waiting_for="testing")
    assert (built / "data.txt").read_text() == "complete"


def test_two_racing_processes_build_once(tmp_path):
    target, counter = tmp_path / "shared" / "built", tmp_path / "builds.txt"
    spawn = multiprocessing.get_context("spawn")  # as DDP ranks: separate interpreters, nothing shared
    start = spawn.Barrier(2)
    children = [spawn.Process(target=_build_in_child, args=(str(target), str(counter), start)) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(timeout=60)
    assert [child.exitcode for child in children] == [0, 0]
    assert len(counter.read_text().splitlines()) == 1
    assert _entries(target.parent) == [".built.lock", "built"]


def _die_while_building(target: str) -> None:
    def build(folder: Path) -> None:
        (folder / "data.txt").write_text("half")
        (folder / "done").write_text("")  # even a folder that looks complete must not be trusted
        os._exit(9)  # as kill -9: no finally block, no cleanup

    files.build_once(Path(target), build, is_complete=_is_complete, waiting_for="testing")


def test_a_killed_build_leaves_nothing_a_later_call_trusts(tmp_path):
    target, counter = tmp_path / "data" / "built", tmp_path / "builds.txt"
    child = multiprocessing.get_context("spawn").Process(target=_die_while_building, args=(str(target),))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 9
    assert not target.exists() and not _is_complete(target)
    assert _entries(target.parent) == [".built.lock", f".built.tmp-{child.pid}"]  # debris, under a name nobody reads
    files.build_once(target, lambda folder: _build_counted(folder, counter=counter), is_complete=_is_complete,
                     waiting_for="testing")
    assert (target / "data.txt").read_text() == "complete"
    assert _entries(target.parent) == [".built.lock", "built"]  # the debris was removed


def test_a_failed_build_keeps_the_previous_target(tmp_path):
    target = tmp_path / "built"
    target.mkdir()
    (target / "data.txt").write_text("previous")

    def build(folder: Path) -> None:
        (folder / "data.txt").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        files.build_once(target, build, is_complete=_is_complete, waiting_for="testing")
    assert (target / "data.txt").read_text() == "previous"
    assert _entries(tmp_path) == [".built.lock", "built"]


def test_a_rebuild_replaces_the_target_whole(tmp_path):
    target, counter = tmp_path / "data" / "built", tmp_path / "builds.txt"
    target.mkdir(parents=True)
    (target / "stale.txt").write_text("from an older build")
    files.build_once(target, lambda folder: _build_counted(folder, counter=counter), is_complete=_is_complete,
                     waiting_for="testing")
    assert _entries(target) == ["data.txt", "done"]
    files.build_once(target, lambda folder: _build_counted(folder, counter=counter), is_complete=_is_complete,
                     waiting_for="testing")
    assert len(counter.read_text().splitlines()) == 1  # complete: not built again
    assert _entries(target.parent) == [".built.lock", "built"]


def test_a_failed_swap_puts_the_previous_target_back(tmp_path, monkeypatch):
    target = tmp_path / "built"
    target.mkdir()
    (target / "data.txt").write_text("previous")
    real_replace = os.replace

    def no_room_for_the_new_one(source, destination):
        if Path(source).name.startswith(".built.tmp-"):
            raise OSError(errno.EXDEV, "simulated")
        real_replace(source, destination)

    monkeypatch.setattr(files.os, "replace", no_room_for_the_new_one)
    with pytest.raises(OSError, match="simulated"):
        files.build_once(target, lambda folder: (folder / "done").write_text(""), is_complete=_is_complete,
                         waiting_for="testing")
    monkeypatch.undo()
    assert (target / "data.txt").read_text() == "previous"
    assert _entries(tmp_path) == [".built.lock", "built"]
