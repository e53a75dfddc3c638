"""Callbacks the CLI adds to every run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import LearningRateFinder
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from torchmetrics.classification import MulticlassConfusionMatrix

from flowers import lightning_internals, runs
from flowers.figures import confusion_matrix_image, prediction_grid

LR_FINDER_PLOT = "lr_finder.png"


class ClassIndicesWriter(L.Callback):
    """Writes ``class_indices.json`` next to the run's checkpoints (global rank 0 only)."""

    @rank_zero_only
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        checkpoint = trainer.checkpoint_callback
        folder = Path(checkpoint.dirpath) if checkpoint and checkpoint.dirpath else Path(trainer.default_root_dir)
        runs.write_class_indices(folder / runs.CLASS_INDICES, pl_module.class_names)


def _tensorboard(trainer: L.Trainer) -> TensorBoardLogger | None:
    return next((logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)), None)


class TensorBoardPictures(L.Callback):
    """TensorBoard extras: the images per class of each split (text ``data/class_counts``, at setup); each
    validation epoch a confusion matrix (``val/confusion_matrix``), each class's precision and recall
    (``val/precision/<class>``, ``val/recall/<class>``) and a grid of validation images with true/predicted class
    (``val/predictions``); at the end of fit the hyperparameters with the final ``val/*`` metrics, for the HPARAMS
    tab. Does nothing without a TensorBoard logger.

    The grid shows the same images every epoch: the first ``grid_images // classes`` (at least one) of each class in
    the order validation reads them (rank 0's share under ddp), one row per class. The matrix is a torchmetrics
    metric fed with the logits ``validation_step`` returns, so it costs no extra forward pass and is summed over all
    ddp processes; the per-class scores come from it once an epoch. Only global rank 0 draws and writes.
    """

    def __init__(self, grid_images: int = 16) -> None:
        self.grid_images = grid_images
        self.confusion: MulticlassConfusionMatrix | None = None
        self._grid: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._positions: dict[int, list[int]] | None = None  # batch index -> the grid's images in that batch
        self._positions_for: object = None  # the loader they were worked out for
        self._step = 0

    def setup(self, trainer, pl_module, stage) -> None:
        logger = _tensorboard(trainer)
        counts = getattr(trainer.datamodule, "class_counts", None)
        if logger is not None and trainer.is_global_zero and counts is not None and (table := counts()):
            logger.experiment.add_text("data/class_counts", _counts_markdown(table), 0)

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._grid = []
        self.confusion = None
        if _tensorboard(trainer) is not None and not trainer.sanity_checking:
            self.confusion = MulticlassConfusionMatrix(len(pl_module.class_names)).to(pl_module.device)
            if trainer.is_global_zero:
                self._plan_grid(trainer.val_dataloaders, len(pl_module.class_names))

    def _plan_grid(self, loader, num_classes: int) -> None:
        # The loader's batches as lists of dataset indices, read from its batch sampler (no image is loaded): the
        # grid's images are then picked by position in their batch, with no labels copied off the device.
        if loader is self._positions_for:
            return
        self._positions_for, self._positions = loader, None
        labels, batches = _labels(getattr(loader, "dataset", None)), getattr(loader, "batch_sampler", None)
        if labels is None or batches is None:
            return  # an unknown dataset or loader: the first images, as they come
        per_class, taken, positions = self._per_class(num_classes), [0] * num_classes, {}
        for batch_idx, indices in enumerate(batches):
            for position, index in enumerate(indices):
                if taken[labels[index]] < per_class:
                    taken[labels[index]] += 1
                    positions.setdefault(batch_idx, []).append(position)
            if min(taken) >= per_class:
                break
        self._positions = positions

    def _per_class(self, num_classes: int) -> int:
        return max(1, self.grid_images // num_classes)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.confusion is None or not isinstance(outputs, dict) or "logits" not in outputs:
            return
        images, labels = batch
        self.confusion.update(outputs["logits"], labels)
        if not trainer.is_global_zero or dataloader_idx != 0:
            return
        if self._positions is None:
            keep = slice(0, max(0, self.grid_images - sum(len(chunk[0]) for chunk in self._grid)))
        elif batch_idx in self._positions:
            keep = torch.tensor(self._positions[batch_idx], device=labels.device)
        else:
            return
        if len(labels[keep]):
            probs = outputs["logits"][keep].float().softmax(dim=1)
            self._grid.append((images[keep].cpu(), labels[keep].cpu(), probs.cpu()))

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if self.confusion is None or self.confusion.update_count == 0:
            return
        matrix = self.confusion.compute()  # every rank must call compute: it all-reduces the counts
        self.confusion = None
        # Per-class scores from the epoch's matrix (rows true, columns predicted), as torchmetrics' average=None with
        # zero_division=0 computes them: no second metric fed every step.
        hits = matrix.diagonal().float()
        precision, recall = hits / matrix.sum(dim=0).clamp(min=1), hits / matrix.sum(dim=1).clamp(min=1)
        # The matrix is summed over the ranks, so every rank holds the same values: a "max" sync keeps them exact
        # (an unsynced epoch value draws Lightning's warning under ddp).
        pl_module.log_dict({f"val/{score}/{name}": values[i] for i, name in enumerate(pl_module.class_names)
                            for score, values in (("precision", precision), ("recall", recall))},
                           sync_dist=True, reduce_fx="max")
        if not trainer.is_global_zero:
            return
        self._step = lightning_internals.logged_step(trainer)  # where the val/acc points of this epoch are
        writer = _tensorboard(trainer).experiment
        writer.add_image("val/confusion_matrix", confusion_matrix_image(matrix, pl_module.class_names), self._step)
        if self._grid:
            images, labels, probs = (torch.cat(parts) for parts in zip(*self._grid, strict=True))
            order = torch.argsort(labels, stable=True)  # one row per class
            per_class = self._per_class(len(pl_module.class_names))
            columns = per_class if self._positions is not None and per_class > 1 else 4
            writer.add_image("val/predictions", prediction_grid(images[order], labels[order], probs[order],
                                                                pl_module.class_names, columns=columns), self._step)
        self._grid = []

    def on_fit_end(self, trainer, pl_module) -> None:
        logger = _tensorboard(trainer)
        if logger is None or not trainer.is_global_zero:
            return
        # The run's val metrics; the per-class ones stay out of the HPARAMS tab, which would grow two columns a class.
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()
                   if k.startswith("val/") and not k.startswith(("val/precision/", "val/recall/"))}
        checkpoint = trainer.checkpoint_callback
        if checkpoint is not None and checkpoint.best_model_score is not None:
            metrics[f"{checkpoint.monitor}_best"] = float(checkpoint.best_model_score)
        if metrics:
            # logger.hparams holds what was logged at fit start (model, data, run scale), so the HPARAMS tab
            # lists them; the metrics are re-logged at the last validation's step, where the curves already end.
            params = {**(logger.hparams or pl_module.hparams), "data": _data_params(trainer.datamodule)}
            logger.log_hyperparams(params, metrics, step=self._step)


def _data_params(datamodule) -> dict:
    # FlowerDataModule keeps no hparams (its class_names would clash with the model's): it declares what to log.
    keys = getattr(datamodule, "LOGGED_SETTINGS", ())
    return {k: str(v) if isinstance(v, Path) else v for k in keys if (v := getattr(datamodule, k, None)) is not None}


def _counts_markdown(counts: dict[str, dict[str, int]]) -> str:
    """``{"train": {"daisy": 10, …}, …}`` as a Markdown table, a row per class and a column per split."""
    splits = list(counts)
    names = list(next(iter(counts.values())))
    rows = [f"| class | {' | '.join(splits)} |", "|---" * (len(splits) + 1) + "|"]
    rows += [f"| {name} | {' | '.join(str(counts[split].get(name, 0)) for split in splits)} |" for name in names]
    return "\n".join(rows)


def _labels(dataset) -> list[int] | None:
    """The class of each item of a flowers labelled dataset, read without loading an image; None for another."""
    labels = getattr(dataset, "labels", None)
    return list(labels) if labels is not None else None


class LearningRateFinderReport(L.Callback):
    """Prints the suggestion of Lightning's ``LearningRateFinder`` (``--trainer.callbacks+=LearningRateFinder``) and
    saves its loss-against-learning-rate plot as ``lr_finder.png`` in the run folder.

    Lightning runs its tuner callbacks first in each hook, so the finder has its result when this looks for it, at
    fit start and at each training epoch's start (for finders that search again later).
    """

    def __init__(self) -> None:
        self._reported: list = []  # the results reported, kept so that a new one is never taken for an old one

    def on_fit_start(self, trainer, pl_module) -> None:
        self._report(trainer)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._report(trainer)

    def _report(self, trainer) -> None:
        for finder in trainer.callbacks:
            result = finder.optimal_lr if isinstance(finder, LearningRateFinder) else None
            if result is None or any(result is done for done in self._reported):
                continue
            self._reported.append(result)
            suggestion = result.suggestion()
            if suggestion is None:
                rank_zero_warn("LearningRateFinder: too few steps for a suggestion; raise its num_training_steps.")
                continue
            rank_zero_info(f"LearningRateFinder: suggested learning rate {suggestion:.3g}")
            if trainer.is_global_zero:
                self._plot(result, Path(trainer.log_dir or trainer.default_root_dir))

    @staticmethod
    def _plot(result, folder: Path) -> None:
        if importlib.util.find_spec("matplotlib") is None:  # Lightning draws the plot with matplotlib, not required
            rank_zero_info(f"LearningRateFinder: pip install matplotlib to get {LR_FINDER_PLOT}")
            return
        import matplotlib.pyplot as plt

        folder.mkdir(parents=True, exist_ok=True)
        figure = result.plot(suggest=True)
        figure.savefig(folder / LR_FINDER_PLOT, dpi=100)
        plt.close(figure)
        rank_zero_info(f"LearningRateFinder: plot in {folder / LR_FINDER_PLOT}")
