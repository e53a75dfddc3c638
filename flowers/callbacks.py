"""Callbacks the CLI adds to every run."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from torchmetrics.classification import MulticlassConfusionMatrix

from flowers import lightning_internals, runs
from flowers.figures import confusion_matrix_image, prediction_grid
from flowers.files import atomic_write_text


def write_class_indices(path: Path, class_names: list[str]) -> None:
    """The tutorial's ``class_indices.json``: ``{"0": "daisy", …}``."""
    atomic_write_text(path, json.dumps({str(i): name for i, name in enumerate(class_names)}, indent=4) + "\n")


class ClassIndicesWriter(L.Callback):
    """Writes ``class_indices.json`` next to the run's checkpoints (global rank 0 only)."""

    @rank_zero_only
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        checkpoint = trainer.checkpoint_callback
        folder = Path(checkpoint.dirpath) if checkpoint and checkpoint.dirpath else Path(trainer.default_root_dir)
        write_class_indices(folder / runs.CLASS_INDICES, pl_module.class_names)


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
        self._step = lightning_internals.logged_step(trainer)  # where the val/acc points of this epoch are
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
