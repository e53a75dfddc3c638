"""A test-only callback for multi-process runs: each rank writes what it saw to ``DIR/rankR.json``.

The ddp tests run ``python -m flowers ... --trainer.callbacks+=tests.ddp_probe.Probe`` in a subprocess and
read these files back, since the child's trainer is out of the test's reach.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import lightning as L
import torch


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
    of epoch ``epoch`` starts. Just before, it writes the wall-clock time to ``marker``, so a test can time
    how long the other ranks take to give up."""

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
