"""Look inside trained runs from Python: load a checkpoint, score it, predict files, read its TensorBoard curves.

The API behind ``notebooks/explore_checkpoints.ipynb``::

    model, class_names, hparams = load(ckpt)                # ckpt: a path, "best" or "last"
    result = evaluate(model, datamodule_for(ckpt, model))   # accuracy, confusion matrix, per-class P/R
    rows = predict(model, ["a.jpg", "b.png"], top_k=3)      # at the run's own size and normalisation
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from torchmetrics.classification import (
    MulticlassAccuracy,
    MulticlassConfusionMatrix,
    MulticlassPrecision,
    MulticlassRecall,
)

from flowers import inference
from flowers.checkpoint_reader import read
from flowers.data import FlowerDataModule
from flowers.data.datasets import UnlabelledImages
from flowers.inference import eval_transform_of
from flowers.module import FlowerClassifier
from flowers.predictions import prediction_rows
from flowers.runs import CONFIG, find_checkpoints, newest_best_checkpoint, run_dir_of

__all__ = ["Evaluation", "compare_checkpoints", "datamodule_for", "eval_transform_of", "evaluate", "find_checkpoints",
           "image_size_of", "load", "newest_best_checkpoint", "per_epoch", "predict", "read_scalars", "run_config",
           "run_dir_of"]

def run_config(ckpt: str | Path) -> dict:
    """The run's ``config.yaml`` as a dict, or ``{}`` when the checkpoint was moved away from its run."""
    return inference.read_run_config(run_dir_of(ckpt) / CONFIG)


def image_size_of(ckpt: str | Path) -> int:
    """The side the run evaluated at, as the checkpoint records it (older ones: the run's config.yaml)."""
    path = inference.resolve(ckpt, "checkpoint")
    hparams = read(path, "checkpoint", model_class=FlowerClassifier).get("hyper_parameters") or {}
    return inference.eval_image_size(hparams, path)


def load(ckpt: str | Path, map_location: str = "cpu") -> tuple[FlowerClassifier, list[str], dict]:
    """The model in eval mode, its class names and hyperparameters. The file is read as untrusted data: no
    pickled code, no class its settings name beyond torch's optimizers and schedulers (flowers.inference)."""
    ready = inference.load(ckpt, map_location=map_location, flag="checkpoint")
    return ready.model, ready.classes, ready.hparams


def datamodule_for(ckpt: str | Path, model: FlowerClassifier, **overrides) -> FlowerDataModule:
    """The run's data (its ``config.yaml`` settings: folder, split, image size), for the model's classes and
    normalisation."""
    data = run_config(ckpt).get("data", {})
    settings = {k: data[k] for k in FlowerDataModule.SPLIT_SETTINGS if data.get(k) is not None}
    mean, std = model.normalisation()  # the model's own, whatever the config file says
    if model.hparams.get("eval_image_size"):
        settings["eval_image_size"] = model.hparams.eval_image_size
    # num_workers=0: in-process loading, as a notebook gains little from workers.
    settings.update({"num_workers": 0, "mean": list(mean), "std": list(std), **overrides})
    return FlowerDataModule(class_names=model.class_names, **settings)


@dataclass
class Evaluation:
    accuracy: float  # micro: fraction of images right
    accuracy_macro: float
    confusion: torch.Tensor  # [true, predicted] counts
    precision: torch.Tensor  # per class
    recall: torch.Tensor  # per class
    probs: torch.Tensor  # [image, class]
    labels: torch.Tensor
    paths: list[str]

    @property
    def predicted(self) -> torch.Tensor:
        return self.probs.argmax(dim=1)

    def most_confidently_wrong(self, k: int = 8) -> list[int]:
        """Indices of the wrong predictions with the highest predicted probability."""
        confidence, predicted = self.probs.max(dim=1)
        wrong = (predicted != self.labels).nonzero().flatten()
        return wrong[confidence[wrong].argsort(descending=True)][:k].tolist()


@torch.inference_mode()
def evaluate(model: FlowerClassifier, datamodule: FlowerDataModule, stage: str = "validate") -> Evaluation:
    """Scores the validation split (or ``stage="test"``) with torchmetrics."""
    datamodule.setup(stage)
    dataset = datamodule.val_set if stage == "validate" else datamodule.test_set
    loader = DataLoader(dataset, batch_size=datamodule.eval_batch_size, shuffle=False)
    n = len(model.class_names)
    metrics = {
        "accuracy": MulticlassAccuracy(n, average="micro"), "accuracy_macro": MulticlassAccuracy(n, average="macro"),
        "confusion": MulticlassConfusionMatrix(n), "precision": MulticlassPrecision(n, average=None),
        "recall": MulticlassRecall(n, average=None),
    }
    probs, labels = [], []
    device = next(model.parameters()).device
    for images, targets in loader:
        batch_probs = model.eval_logits(images.to(device)).float().softmax(dim=1).cpu()
        for metric in metrics.values():
            metric.update(batch_probs, targets)
        probs.append(batch_probs)
        labels.append(targets)
    values = {name: metric.compute() for name, metric in metrics.items()}
    return Evaluation(
        accuracy=float(values["accuracy"]), accuracy_macro=float(values["accuracy_macro"]),
        confusion=values["confusion"], precision=values["precision"], recall=values["recall"],
        probs=torch.cat(probs), labels=torch.cat(labels), paths=[s.path for s in dataset.samples],
    )


@torch.inference_mode()
def predict(model: FlowerClassifier, paths: list[str | Path], *, top_k: int = 3, image_size: int | None = None,
            batch_size: int = 32) -> list[dict]:
    """One row per file, as ``predict --predictions.format json`` writes: path, prediction, probs, top_k, error.
    ``image_size``: the side to evaluate at; unset, the model's own (``eval_image_size``), else 224."""
    dataset = UnlabelledImages([str(p) for p in paths], eval_transform_of(model, image_size))
    device = next(model.parameters()).device
    outputs = []
    for images, indices, errors in DataLoader(dataset, batch_size=batch_size, shuffle=False):
        probs = model.eval_logits(images.to(device)).float().softmax(dim=1).cpu()
        outputs.append({"index": indices, "probs": probs, "error": list(errors)})
    return prediction_rows(outputs, dataset.paths, model.class_names, top_k)


def compare_checkpoints(folder: str | Path, datamodule: FlowerDataModule | None = None) -> list[dict]:
    """Val accuracy of every checkpoint in ``folder``, each scored on the same split (the first one's run data)."""
    rows = []
    for ckpt in sorted(Path(folder).glob("*.ckpt")):
        ready = inference.load(ckpt, flag="checkpoint")
        datamodule = datamodule or datamodule_for(ckpt, ready.model)
        result = evaluate(ready.model, datamodule)
        rows.append({"checkpoint": ckpt.name, "epoch": ready.epoch, "step": ready.global_step,
                     "val_acc": result.accuracy, "val_acc_macro": result.accuracy_macro})
    return rows


def read_scalars(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the run's TensorBoard event files: ``{tag: [(step, value), …]}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})  # 0 = keep every point
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def per_epoch(scalars: dict[str, list[tuple[int, float]]], tag: str) -> list[tuple[int, float]]:
    """``[(epoch, value), …]`` for an epoch-level tag, using the ``epoch`` scalar Lightning logs at each step."""
    epoch_at = dict(scalars.get("epoch", []))
    return [(int(epoch_at.get(step, i)), value) for i, (step, value) in enumerate(scalars.get(tag, []))]
