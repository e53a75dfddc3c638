"""Checkpoints that survive ``kill -9`` and resume bit for bit: which files are saved when, an atomic writer and
the global RNG state.

Lightning 2.6's ``TorchCheckpointIO`` writes through an fsspec transaction: the bytes go to a temporary
file in the system temp folder (often another filesystem than ``runs/``) and ``shutil.move`` then *copies*
them over the target, with no fsync anywhere. A kill during that copy, or a power cut before the page cache
is flushed, leaves a truncated ``last.ckpt``. ``AtomicCheckpointIO`` writes beside the target, fsyncs, then
renames.

Lightning also saves no global RNG state in its checkpoints (only the loops', optimizers' and callbacks'
states), so a resumed run would shuffle, crop and drop out differently from an uninterrupted one;
``RNGStateCheckpoint`` stores and restores it as a callback state.
"""

from __future__ import annotations

import os
import random
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from flowers import runs
from flowers.errors import CheckpointWriteError
from flowers.files import atomic_write, remove_stale_checkpoint_temporaries

# ``--best_checkpoint.*``: the best epoch by val/acc. "val/acc" in the file name would make a sub-folder, so
# the name is spelled out.
BEST_CHECKPOINT = {"monitor": "val/acc", "mode": "max", "save_top_k": 1, "filename": runs.BEST_FILENAME,
                   "auto_insert_metric_name": False}
# ``--checkpoint.*``: last.ckpt at the end of every epoch, as the one file kept by a ModelCheckpoint with no
# monitor. Lightning's own save_last refreshes last.ckpt only at steps that saved a top-k file, so it would
# fall behind epochs that do not improve or do not validate.
# --checkpoint.train_time_interval: a kill loses at most this much training, for a save that costs under 1 %
# of it (the measurement: docs/reliability.md).
MID_EPOCH_INTERVAL = timedelta(minutes=1)
LAST_CHECKPOINT = {"monitor": None, "save_top_k": 1, "filename": runs.LAST, "save_on_train_epoch_end": True,
                   "enable_version_counter": False, "train_time_interval": MID_EPOCH_INTERVAL}



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
        if storage_options is not None or not _is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_torch_save(checkpoint, path)


def _is_local(path) -> bool:
    protocol = get_filesystem(path).protocol
    return "file" in (protocol if isinstance(protocol, tuple) else (protocol,))


def epoch_progress(trainer: L.Trainer) -> tuple[int, int]:
    """(batches of this epoch the training loop has finished, batches in the epoch): where a checkpoint saved
    now stands, for the parts of it that must know (the training loader's position, the epoch's metrics)."""
    return trainer.fit_loop.epoch_loop.batch_progress.current.processed, trainer.num_training_batches


class LastCheckpoint(ModelCheckpoint):
    """The ModelCheckpoint of ``last.ckpt``: at every epoch's end, and with ``train_time_interval`` also
    during an epoch, each time that much time has passed since the last save (decided on rank 0, so all ranks
    save together). Lightning's ModelCheckpoint makes the timed and the per-epoch saves exclusive, and an
    epoch that ended without a save would leave last.ckpt behind the weights it trained."""

    def __init__(self, *args: Any, train_time_interval: timedelta | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mid_epoch_interval = train_time_interval
        self._last_mid_epoch_save = time.monotonic()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._last_mid_epoch_save = time.monotonic()
        if trainer.is_global_zero and self.dirpath and _is_local(self.dirpath):  # rank 0 writes the checkpoints
            remove_stale_checkpoint_temporaries(Path(self.dirpath))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        last_batch = batch_idx + 1 >= trainer.num_training_batches  # the epoch's own save follows at once
        if self.mid_epoch_interval is None or last_batch or trainer.sanity_checking or trainer.fast_dev_run:
            return
        due = time.monotonic() - self._last_mid_epoch_save >= self.mid_epoch_interval.total_seconds()
        if trainer.strategy.broadcast(due):
            trainer.save_checkpoint(self.format_checkpoint_name({}), self.save_weights_only)
            self._last_mid_epoch_save = time.monotonic()


class RNGStateCheckpoint(L.Callback):
    """Saves the global torch/CUDA/numpy/Python RNG states in each checkpoint and restores them on resume.

    The checkpoint is written by global rank 0 only, so every rank gets rank 0's state back. That is what
    they had anyway: ``seed_everything`` seeds all ranks alike and they draw the same numbers in step
    (equal-sized training shards), while the ``DistributedSampler`` shuffles from its own seed and epoch.
    (The cached loader's per-rank crops come from generators seeded by such shared draws:
    ``batch_augment.WithTrainViews``.)
    Stored as tensors and plain numbers so ``weights_only=True`` loading accepts it.
    """

    def state_dict(self) -> dict[str, Any]:
        _, keys, position, has_gauss, gauss = np.random.get_state()
        state = {
            "torch": torch.get_rng_state(),
            "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "python": list(random.getstate()),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()  # dropout on a GPU draws from the device's generator
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])
        numpy = state_dict["numpy"]
        np.random.set_state(("MT19937", numpy["keys"].numpy().astype(np.uint32), numpy["position"],
                             numpy["has_gauss"], numpy["gauss"]))
        version, state, gauss = state_dict["python"]
        random.setstate((version, tuple(state), gauss))
