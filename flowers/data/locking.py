"""One process per machine (or per shared filesystem) prepares a folder; the others wait for it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows has no flock; there concurrent first runs are not guarded.
    fcntl = None

log = logging.getLogger(__name__)

HAS_LOCKS = fcntl is not None


@contextmanager
def folder_lock(target: Path, *, waiting_for: str) -> Iterator[None]:
    """Hold an exclusive lock on ``.<target>.lock`` beside ``target``; log ``waiting_for`` when blocked."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # The lock file stays: deleting it would let a late process lock a different inode.
    with open(target.parent / f".{target.name}.lock", "a") as handle:
        if fcntl is None:
            yield
            return
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("Waiting for another process to finish %s in %s", waiting_for, target)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
