"""Callbacks the CLI adds to every run."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from torchmetrics.classification import MulticlassConfusionMatrix

from flowers.figures import confusion_matrix_image, prediction_grid


def write_class_indices(path: Path, class_names: list[str]) -> None:
    """The tutorial's ``class_indices.json``: ``{"0": "daisy", …}``."""
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
            raise ValueError(f"predictions.top_k must be at least 1, got {top_k}")
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
            self.outputs.append(_write_atomically(csv_path, _csv_text(rows, pl_module.class_names, self.top_k)))
        if self.format in ("json", "both"):
            self.outputs.append(_write_atomically(csv_path.with_suffix(".json"), json.dumps(rows, indent=2) + "\n"))
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


def _csv_text(rows: list[dict], names: list[str], top_k: int) -> str:
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


def _write_atomically(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader never sees a half-written file
    return path


def _tensorboard(trainer: L.Trainer) -> TensorBoardLogger | None:
    return next((logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)), None)


class TensorBoardPictures(L.Callback):
    """TensorBoard extras: each validation epoch a confusion matrix (``val/confusion_matrix``) and the first
    ``grid_images`` validation images with true/predicted class (``val/predictions``); at the end of fit the
    hyperparameters with the final ``val/*`` metrics, for the HPARAMS tab. Does nothing without a TensorBoard logger.

    The matrix is a torchmetrics metric fed with the logits ``validation_step`` returns, so it costs no extra
    forward pass and is summed over all ddp processes; only global rank 0 draws and logs.
    """

    def __init__(self, grid_images: int = 16) -> None:
        self.grid_images = grid_images
        self.confusion: MulticlassConfusionMatrix | None = None
        self._grid: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._step = 0

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._grid = []
        self.confusion = None
        if _tensorboard(trainer) is not None and not trainer.sanity_checking:
            self.confusion = MulticlassConfusionMatrix(len(pl_module.class_names)).to(pl_module.device)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.confusion is None or not isinstance(outputs, dict) or "logits" not in outputs:
            return
        images, labels = batch
        self.confusion.update(outputs["logits"], labels)
        room = self.grid_images - sum(len(chunk[0]) for chunk in self._grid)
        if trainer.is_global_zero and room > 0:
            probs = outputs["logits"][:room].float().softmax(dim=1)
            self._grid.append((images[:room].cpu(), labels[:room].cpu(), probs.cpu()))

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if self.confusion is None or self.confusion.update_count == 0:
            return
        matrix = self.confusion.compute()  # every rank must call compute: it all-reduces the counts
        self.confusion = None
        if not trainer.is_global_zero:
            return
        # The step Lightning's logger connector gives the val scalars (global_step - 1 here), so the
        # images line up with the val/acc points.
        self._step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
        writer = _tensorboard(trainer).experiment
        writer.add_image("val/confusion_matrix", confusion_matrix_image(matrix, pl_module.class_names), self._step)
        if self._grid:
            images, labels, probs = (torch.cat(parts) for parts in zip(*self._grid, strict=True))
            writer.add_image("val/predictions", prediction_grid(images, labels, probs, pl_module.class_names),
                             self._step)
        self._grid = []

    def on_fit_end(self, trainer, pl_module) -> None:
        logger = _tensorboard(trainer)
        if logger is None or not trainer.is_global_zero:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        checkpoint = trainer.checkpoint_callback
        if checkpoint is not None and checkpoint.best_model_score is not None:
            metrics[f"{checkpoint.monitor}_best"] = float(checkpoint.best_model_score)
        if metrics:
            # logger.hparams holds what was logged at fit start (model, data, run scale), so the HPARAMS tab
            # lists them; the metrics are re-logged at the last validation's step, where the curves already end.
            params = {**(logger.hparams or pl_module.hparams), "data": _data_params(trainer.datamodule)}
            logger.log_hyperparams(params, metrics, step=self._step)


def _data_params(datamodule) -> dict:
    # FlowerDataModule keeps no hparams (its class_names would clash with the model's), so pick the settings
    # that change results by hand.
    keys = ("data_dir", "image_size", "eval_image_size", "batch_size", "val_split", "split_seed")
    return {k: str(v) if isinstance(v, Path) else v for k in keys if (v := getattr(datamodule, k, None)) is not None}
