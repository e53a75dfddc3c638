"""Callbacks the CLI adds to every run."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only


def write_class_indices(path: Path, class_names: list[str]) -> None:
    """The seed's ``class_indices.json``: ``{"0": "daisy", …}``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({str(i): name for i, name in enumerate(class_names)}, indent=4) + "\n")


class ClassIndicesWriter(L.Callback):
    """Writes ``class_indices.json`` next to the run's checkpoints (global rank 0 only)."""

    @rank_zero_only
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        checkpoint = trainer.checkpoint_callback
        folder = Path(checkpoint.dirpath) if checkpoint and checkpoint.dirpath else Path(trainer.default_root_dir)
        write_class_indices(folder / "class_indices.json", pl_module.class_names)


class PredictionWriter(BasePredictionWriter):
    """Writes ``predictions.csv``: ``path``, ``prediction`` (a class name), then one probability per class.

    Args:
        output: the CSV file; default ``predictions.csv`` in the run's log folder
            (``runs/flowers/version_N/``), which ``predict`` prints at the end.
    """

    def __init__(self, output: str | None = None) -> None:
        super().__init__(write_interval="epoch")
        self.output = output
        self.written: Path | None = None

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices) -> None:
        if not trainer.is_global_zero:
            return
        dataset = trainer.predict_dataloaders.dataset
        names = pl_module.class_names
        path = Path(self.output) if self.output else Path(trainer.log_dir or ".") / "predictions.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with tmp.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["path", "prediction", *names])
            for batch in predictions:
                for index, probs in zip(batch["index"].tolist(), batch["probs"]):
                    writer.writerow([dataset.paths[index], names[int(torch.argmax(probs))],
                                     *(f"{p:.6f}" for p in probs.tolist())])
        os.replace(tmp, path)  # a reader never sees a half-written file
        self.written = path
        rank_zero_info(f"Predictions for {len(dataset)} images written to {path}")
