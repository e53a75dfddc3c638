"""``predict``'s output: one row per image (path, prediction, per-class probabilities, top-k, error) as
``predictions.csv`` and/or ``.json``, written by a Lightning ``BasePredictionWriter``."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Literal

from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info

from flowers.errors import ConfigError
from flowers.files import atomic_write_text


class PredictionWriter(BasePredictionWriter):
    """Writes ``predictions.csv``: ``path``, ``prediction`` (a class name), one probability per class, then
    ``top1``, ``top1_prob`` … ``topK``, ``topK_prob`` and ``error`` (empty unless the image could not be read;
    such a row has no prediction and no probabilities).

    Args:
        output: the CSV file; default ``predictions.csv`` in the run's log folder
            (``runs/flowers/version_N/``), which ``predict`` prints at the end. JSON goes beside it as ``.json``.
        top_k: how many of the most probable classes each row lists (capped at the number of classes).
        format: ``csv``, ``json`` (a list of objects, one per image) or ``both``.
    """

    def __init__(self, output: str | None = None, top_k: int = 3,
                 format: Literal["csv", "json", "both"] = "csv") -> None:
        super().__init__(write_interval="epoch")
        if top_k < 1:
            raise ConfigError(f"--predictions.top_k must be at least 1 (the most probable classes each row lists), "
                              f"got {top_k}.")
        self.output = output
        self.top_k = top_k
        self.format = format
        self.written: Path | None = None  # the CSV, or the JSON when only that is written
        self.outputs: list[Path] = []

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices) -> None:
        if not trainer.is_global_zero:
            return
        paths = trainer.predict_dataloaders.dataset.paths
        rows = prediction_rows(predictions, paths, pl_module.class_names, self.top_k)
        csv_path = Path(self.output) if self.output else Path(trainer.log_dir or ".") / "predictions.csv"
        self.outputs = []
        if self.format in ("csv", "both"):
            self.outputs.append(_write(csv_path, csv_text(rows, pl_module.class_names, self.top_k)))
        if self.format in ("json", "both"):
            self.outputs.append(_write(csv_path.with_suffix(".json"), json.dumps(rows, indent=2) + "\n"))
        self.written = self.outputs[0]
        failed = sum(bool(row["error"]) for row in rows)
        rank_zero_info(f"Predictions for {len(rows)} images ({failed} unreadable) written to "
                       + ", ".join(map(str, self.outputs)))


def prediction_rows(predictions, paths: list[str], names: list[str], top_k: int) -> list[dict]:
    """One dict per image from predict_step outputs: path, prediction, probs {class: p}, top_k, error."""
    rows = []
    for batch in predictions:
        for index, probs, error in zip(batch["index"].tolist(), batch["probs"], batch["error"], strict=True):
            row = {"path": paths[index], "prediction": None, "probs": {}, "top_k": [], "error": error or None}
            if not error:
                values, order = probs.topk(min(top_k, len(names)))
                ranked = zip(values.tolist(), order.tolist(), strict=True)
                row.update(prediction=names[int(order[0])], probs=dict(zip(names, probs.tolist(), strict=True)),
                           top_k=[{"class": names[i], "prob": v} for v, i in ranked])
            rows.append(row)
    return rows


def csv_text(rows: list[dict], names: list[str], top_k: int) -> str:
    k = min(top_k, len(names))
    handle = io.StringIO()
    writer = csv.writer(handle)
    # path, prediction and the per-class columns come first: other tools rely on exactly that prefix.
    writer.writerow(["path", "prediction", *names, *(f"top{i}{s}" for i in range(1, k + 1) for s in ("", "_prob")),
                     "error"])
    for row in rows:
        probs = [f"{row['probs'][n]:.6f}" if row["probs"] else "" for n in names]
        ranked = [x for t in row["top_k"] for x in (t["class"], f"{t['prob']:.6f}")] or [""] * (2 * k)
        writer.writerow([row["path"], row["prediction"] or "", *probs, *ranked, row["error"] or ""])
    return handle.getvalue()


def _write(path: Path, text: str) -> Path:
    atomic_write_text(path, text)  # a reader never sees a half-written file
    return path
