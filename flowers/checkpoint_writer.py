"""Checkpoints that survive ``kill -9``: written beside their target, fsynced, then renamed.

Lightning 2.6's ``TorchCheckpointIO`` writes through an fsspec transaction: the bytes go to a temporary
file in the system temp folder (often another filesystem than ``runs/``) and ``shutil.move`` then *copies*
them over the target, with no fsync anywhere. A kill during that copy, or a power cut before the page cache
is flushed, leaves a truncated ``last.ckpt``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from flowers.errors import CheckpointWriteError
from flowers.files import atomic_write


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` that leaves either the old file or the complete new one at ``path``, never a part."""
    target = Path(path)
    try:
        atomic_write(target, lambda file: torch.save(obj, file))
    except OSError as error:
        kept = f"The previous {target.name} is untouched." if target.is_file() else \
            f"No earlier {target.name} existed; nothing was lost."
        raise CheckpointWriteError(
            f"could not write the checkpoint {target} ({error.strerror or error}). {kept} Free space on the "
            f"disk that holds {target.parent}, then resume with --ckpt_path last."
        ) from None


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with an atomic local write; remote paths (s3://, …) keep Lightning's writer."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_torch_save(checkpoint, path)


def is_local(path) -> bool:
    protocol = get_filesystem(path).protocol
    return "file" in (protocol if isinstance(protocol, tuple) else (protocol,))

