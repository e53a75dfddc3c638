"""Callbacks that real ``python -m flowers`` children load with ``--trainer.callbacks+=tests.helpers.callbacks.X``.

The child's trainer is out of the test's reach: these write what each rank saw to files the test reads back
(``Probe``, ``BatchLog``), or stop the child at a chosen moment (``Fault``, ``Pause``, ``KillAt``, ``TroubleOnce``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import time
from pathlib import Path

import lightning as L
import torch

import flowers.checkpoint_writer

REAL_SAVE = torch.save


class Probe(L.Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.train_orders: list[list[int]] = []
        self.sampler_epochs: list[int] = []
        self.eval_batch_sizes: list[int] = []
        self.train_image_sides: set[int] = set()
        self.train_views: list[list] = []

    def setup(self, trainer, pl_module, stage: str) -> None:
        # A cached training batch's crop boxes and flips, as the loader drew them: seen here before the
        # datamodule's on_after_batch_transfer turns them into images.
        datamodule = trainer.datamodule
        hook = datamodule.on_before_batch_transfer

        def record(batch, dataloader_idx):
            if trainer.training and isinstance(batch, (list, tuple)) and len(batch) == 4:
                self.train_views.append([batch[2].tolist(), batch[3].tolist()])
            return hook(batch, dataloader_idx)

        datamodule.on_before_batch_transfer = record

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.train_image_sides.add(int(batch[0].shape[-1]))  # the batch as the model gets it

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        sampler = trainer.train_dataloader.sampler
        self.sampler_epochs.append(int(getattr(sampler, "epoch", -1)))
        # flowers' training sampler yields (index, seed) pairs; other samplers yield indices.
        self.train_orders.append([int(i[0]) if isinstance(i, tuple) else int(i) for i in sampler])

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self.eval_batch_sizes = []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.eval_batch_sizes.append(int(batch[1].shape[0]))

    def _write(self, trainer, stage: str) -> None:
        loaders = trainer.val_dataloaders if stage != "test" else trainer.test_dataloaders
        sampler = getattr(loaders, "sampler", None)
        record = {
            "stage": stage,
            "global_rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "env_rank": os.environ.get("RANK"),
            "logger_version": trainer.logger.version if trainer.logger else None,
            "log_dir": trainer.log_dir,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v)},
            "sampler_epochs": self.sampler_epochs,
            "train_orders": self.train_orders,
            "eval_batch_sizes": self.eval_batch_sizes,
            "train_image_sides": sorted(self.train_image_sides),
            "train_views": self.train_views,
            "train_collate": type(trainer.train_dataloader.collate_fn).__name__ if trainer.train_dataloader else None,
            "eval_sampler": type(sampler).__name__,
            "eval_shard": [int(i) for i in sampler] if sampler is not None else None,
            "split": _split(trainer.datamodule),
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"{stage}_rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))

    def on_fit_end(self, trainer, pl_module) -> None:
        self._write(trainer, "fit")

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "validate":
            self._write(trainer, "validate")


def _split(datamodule) -> dict[str, list[str]] | None:
    # The files of each side of the train/val split, as this rank's datamodule made it.
    sets = {"train": getattr(datamodule, "train_set", None), "val": getattr(datamodule, "val_set", None)}
    if not all(hasattr(dataset, "samples") for dataset in sets.values()):
        return None
    return {name: [str(sample.path) for sample in dataset.samples] for name, dataset in sets.items()}


class Fault(L.Callback):
    """Rank ``rank`` dies (``action="exit"``: ``os._exit(1)``, no cleanup, like a crash or the OOM killer)
    or hangs (``"hang"``: sleeps ``hang_s`` without taking part in collectives) as training batch ``batch``
    of epoch ``epoch`` starts. Just before, it writes the wall-clock time and its PID to ``marker``, so a test
    knows the fault happened where it was put."""

    def __init__(self, marker: str, action: str = "exit", rank: int = 1, epoch: int = 0, batch: int = 1,
                 hang_s: float = 600.0) -> None:
        self.marker, self.action, self.rank, self.epoch, self.batch = Path(marker), action, rank, epoch, batch
        self.hang_s = hang_s

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if (trainer.global_rank, trainer.current_epoch, batch_idx) != (self.rank, self.epoch, self.batch):
            return
        self.marker.write_text(f"{time.time()}\n{os.getpid()}\n")
        if self.action == "exit":
            os._exit(1)
        time.sleep(self.hang_s)


class Pause(L.Callback):
    """In epoch 1, at ``moment``, write ``marker`` and wait to be killed.

    ``moment``: "train" (mid-epoch, after a training batch), "validation" (mid-validation), or "write"
    (inside the checkpoint write: half of last.ckpt's bytes are out when the process dies).
    """

    def __init__(self, marker: str, moment: str) -> None:
        self.marker, self.moment = Path(marker), moment

    def _stop_here(self) -> None:
        self.marker.write_text(str(os.getpid()))
        time.sleep(120)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.moment == "train" and trainer.current_epoch == 1 and batch_idx == 1:
            self._stop_here()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.moment == "validation" and trainer.current_epoch == 1 and not trainer.sanity_checking:
            self._stop_here()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self.moment == "write" and trainer.current_epoch == 1:
            flowers.checkpoint_writer.torch.save = self._die_halfway

    def _die_halfway(self, obj, file) -> None:
        buffer = io.BytesIO()
        REAL_SAVE(obj, buffer)
        file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        file.flush()
        self.marker.write_text(str(os.getpid()))
        os._exit(137)  # what SIGKILL looks like to the parent: no cleanup, no except/finally


class BatchLog(L.Callback):
    """Appends ``global_step fingerprint`` of each training batch to ``<folder>/batches_rank<R>.txt``."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        images, labels = batch
        digest = hashlib.sha1(images.float().contiguous().numpy().tobytes() + labels.numpy().tobytes()).hexdigest()
        with open(self.folder / f"batches_rank{trainer.global_rank}.txt", "a") as log:
            log.write(f"{trainer.global_step} {digest[:16]}\n")


def _die_halfway(obj, file) -> None:
    buffer = io.BytesIO()
    REAL_SAVE(obj, buffer)
    file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    file.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class KillAt(L.Callback):
    """SIGKILL this process on rank ``rank`` at ``step``: "between" batches (before batch ``step`` trains), or
    halfway through "writing" the checkpoint that batch ``step`` ends with."""

    def __init__(self, step: int, moment: str, rank: int = 0) -> None:
        self.step, self.moment, self.rank = step, moment, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step or trainer.global_rank != self.rank:
            return
        if self.moment == "between":
            os.kill(os.getpid(), signal.SIGKILL)
        flowers.checkpoint_writer.torch.save = _die_halfway


class TroubleOnce(L.Callback):
    """On rank ``rank`` at ``step``, once per job (a marker file in ``folder`` remembers it): SIGKILL the process
    ("killed") or stop it answering its peers ("hung")."""

    def __init__(self, folder: str, step: int, trouble: str, rank: int = 1) -> None:
        self.marker = Path(folder) / "trouble-done"
        self.step, self.trouble, self.rank = step, trouble, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step or trainer.global_rank != self.rank or self.marker.exists():
            return
        self.marker.touch()
        if self.trouble == "hung":
            time.sleep(3600)
        os.kill(os.getpid(), signal.SIGKILL)
