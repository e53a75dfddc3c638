"""File plumbing that survives kills and concurrent processes: atomic writes, locks, folders built once.

Everything is written beside its target under a temporary name and renamed into place, so a reader finds
the old file or folder or the complete new one, never a part, and a killed writer leaves only debris that
the next writer removes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from filelock import FileLock, Timeout

log = logging.getLogger(__name__)

# When this process started, near enough: a temporary file nobody has touched since is no live write of ours.
STARTED = time.time()
_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"


def is_writable(folder: Path) -> bool:
    """Whether files can be created in ``folder`` (made if missing): os.access says yes to root on read-only mounts."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError:
        return False
    return True


def can_create(folder: Path) -> bool:
    """Whether ``folder`` exists and takes files, or could be made and would: it is not made (a refused command
    leaves nothing behind), the nearest folder that exists is tried instead."""
    existing = Path(folder)
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return False  # a file (or a dangling link) where a folder must go
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError:
        return False
    return True


def special_kind(path: str | os.PathLike) -> str | None:
    """What ``path`` is when it exists but is not a regular file (``"a folder"``, ``"a named pipe (FIFO)"`` …);
    None for a regular file, a link to one, or nothing. Opening a FIFO would block until a writer comes."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    for test, kind in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return None if stat.S_ISREG(mode) else "not a regular file"


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through ``write(file)`` so that it holds the old bytes or all the new ones, never a part.

    Raises the first ``OSError`` of the write (full disk, quota, I/O error) even when ``write`` turned it into
    another exception, so callers can read its ``errno`` and ``strerror``. The temporary files a killed writer
    of ``path`` left are removed first (``remove_stale_temporaries``).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target)
    # Same folder: os.replace is then a rename within one filesystem, atomic on POSIX. The name says who writes.
    handle, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.{os.getpid()}@{_HOST}.",
                                    suffix=".tmp")
    file = _ErrorRecordingFile(os.fdopen(handle, "wb"))
    try:
        with file:
            # mkstemp makes the file private; a plain open() would have made it 0666 less the umask.
            os.chmod(temp, 0o666 & ~_umask())
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, target)
    except BaseException as error:
        Path(temp).unlink(missing_ok=True)
        # The OSError is the report, whatever the writer wrapped it in; an interrupt stays an interrupt.
        if isinstance(error, Exception) and isinstance(failure := file.error or error, OSError):
            raise failure from None
        raise
    _fsync_folder(target.parent)


def remove_stale_temporaries(target: Path) -> list[Path]:
    """Remove the temporary files of ``target`` (``.<name>.*.tmp`` beside it) that no live process is writing:
    those of a process of this machine that has ended (a ``kill -9`` mid-write), and those of another machine
    (or of an older flowers) untouched since this process started. Another target's files are never touched;
    under ddp only rank 0 writes checkpoints, so the writer of a run's temporaries is its rank 0. Returns them."""
    return _remove_stale(target.parent, re.escape(target.name), what=str(target))


def remove_stale_checkpoint_temporaries(folder: Path) -> list[Path]:
    """``remove_stale_temporaries`` for every ``*.ckpt`` of a run's checkpoint folder: a best checkpoint's next
    save has another name, so only the run's own start can find what a killed save of it left."""
    return _remove_stale(folder, r"[^/]+\.ckpt", what=f"a checkpoint in {folder}")


def _remove_stale(folder: Path, name: str, *, what: str) -> list[Path]:
    pattern = re.compile(rf"\.{name}\.(?:(\d+)@([A-Za-z0-9_-]+)\.)?[a-z0-9_]+\.tmp")
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            if (found := pattern.fullmatch(entry.name)) and _is_stale(entry, found[1], found[2]):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    removed.append(Path(entry.path))
    if removed:
        log.info("Removed %d temporary file(s) that an interrupted write of %s left: %s", len(removed), what,
                 ", ".join(p.name for p in removed))
    return removed


def _is_stale(entry: os.DirEntry, pid: str | None, host: str | None) -> bool:
    if pid is not None and host == _HOST:
        return int(pid) != os.getpid() and not _is_alive(int(pid))
    # Another machine's process, or a name without its writer: a live write would have touched it since.
    return entry.stat(follow_symlinks=False).st_mtime < STARTED


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    # A killed process that its parent has not reaped yet still answers the signal: a zombie writes nothing.
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """``atomic_write`` of UTF-8 text: a reader never finds a half-written config or report."""
    atomic_write(path, lambda file: file.write(text.encode("utf-8")))


def _umask() -> int:
    # Linux shows it without changing it; setting it to read it races other threads that create files.
    with contextlib.suppress(OSError):
        if found := re.search(r"^Umask:\s*([0-7]+)$", Path("/proc/self/status").read_text(), re.MULTILINE):
            return int(found.group(1), 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class _ErrorRecordingFile:
    """A binary file that keeps its first ``OSError``: torch.save reports a full disk only as "unexpected pos"."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self.error: OSError | None = None

    def _recorded(self, operation: Callable, *args):
        try:
            return operation(*args)
        except OSError as error:
            self.error = self.error or error
            raise

    def write(self, data) -> int:
        return self._recorded(self._file.write, data)

    def flush(self) -> None:
        self._recorded(self._file.flush)

    def fileno(self) -> int:
        return self._file.fileno()

    def __enter__(self) -> _ErrorRecordingFile:
        return self

    def __exit__(self, error_type, *_) -> None:
        try:
            self._recorded(self._file.close)
        except OSError:
            if error_type is None:
                raise  # with an error already in flight, that one is reported and this one only recorded


def _fsync_folder(folder: Path) -> None:
    # The rename must reach the disk too, or a power cut can bring back the old directory entry.
    if os.name != "posix":
        return  # Windows cannot open a folder as a file; NTFS journals the rename itself
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


@contextlib.contextmanager
def locked(target: Path, *, waiting_for: str) -> Iterator[None]:
    """Hold an exclusive lock on ``.<name>.lock`` beside ``target``, so one process at a time prepares it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # The lock file stays: deleting it would let a late process lock a new inode while an early one holds the old.
    lock = FileLock(target.parent / f".{target.name}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("Waiting for another process to finish %s in %s", waiting_for, target)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def build_once(
    target: Path, build: Callable[[Path], None], *, is_complete: Callable[[Path], bool], waiting_for: str
) -> Path:
    """``target``, first made by ``build(folder)`` into an empty temporary folder unless ``is_complete(target)``.

    Concurrent processes build it once (the others wait, then find it complete); it appears by a rename, so a
    reader never sees a half-built folder, and an earlier ``target`` is replaced only once the new one is whole.
    ``build`` may keep scratch files beside the folder under names that start with the folder's name: a
    killed build's debris is removed by the next build.
    """
    if is_complete(target):
        return target
    with locked(target, waiting_for=waiting_for):
        if is_complete(target):  # another process built it while we waited
            return target
        _remove_leftovers(target)
        folder = _scratch_path(target, "tmp")
        folder.mkdir()
        try:
            build(folder)
            _swap_in(folder, target)
        finally:
            _remove(folder)
    return target


_SCRATCH_KINDS = ("tmp", "old")  # the folder being built; the target moved aside while the new one goes in


def _scratch_prefix(target: Path, kind: str) -> str:
    return f".{target.name}.{kind}-"


def _scratch_path(target: Path, kind: str) -> Path:
    return target.parent / f"{_scratch_prefix(target, kind)}{os.getpid()}"


def _remove_leftovers(target: Path) -> None:
    # Called under the lock, when nobody else is building target: these are from killed builds.
    prefixes = tuple(_scratch_prefix(target, kind) for kind in _SCRATCH_KINDS)
    for entry in target.parent.iterdir():
        if entry.name.startswith(prefixes):
            _remove(entry)


def _remove(path: Path) -> None:
    # A link is removed itself, never what it points to; what cannot go stays as debris for the next build.
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def _swap_in(folder: Path, target: Path) -> None:
    if not os.path.lexists(target):
        os.replace(folder, target)
        return
    # os.replace cannot put a folder over a non-empty one: the old target moves aside first.
    old = _scratch_path(target, "old")
    os.replace(target, old)
    try:
        os.replace(folder, target)
    except BaseException:
        os.replace(old, target)  # the previous target back, rather than none at all
        raise
    _remove(old)
