"""Which checkpoints a run saves, and when: the best epoch by ``val/acc``, and ``last.ckpt`` at every epoch's end
and every minute in between. How they are written: ``flowers.checkpoint_writer``; what else they carry to resume
bit for bit: ``flowers.rng_state``."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from flowers import runs
from flowers.checkpoint_writer import is_local
from flowers.files import remove_stale_checkpoint_temporaries

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
        if trainer.is_global_zero and self.dirpath and is_local(self.dirpath):  # rank 0 writes the checkpoints
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
