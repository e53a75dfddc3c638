"""Training pipelines: how the training images get from their files to normalised batches on the training device.

``FlowerDataModule`` lists the class folders, splits them and builds the loaders; the pipeline it picks
(``--data.cache``) decides the rest, behind one small interface (``TrainingPipeline``):

- ``datasets``: the training and validation datasets over the split's samples;
- ``train_collate``: the training loader's ``collate_fn`` (None: torch's default);
- ``on_device``: what the training device does to a batch the loader delivered. A training batch comes back
  as ``TrainImages``, normalised images at this epoch's size, which the DataModule then hands to the
  augmentations shared by every pipeline (flowers.data.batch_ops); any other batch comes back ready to use.

Each pipeline keeps its settings in a frozen dataclass, read once from the DataModule's arguments of the
same names (``settings_from``), so the command line stays flat (``--data.crop_scale``, not a nested group).
Test and predict always read the photos through PIL (``transforms.eval_transform``), whatever the pipeline.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
from torch.utils.data import Dataset

from flowers.data.folders import Sample
from flowers.data.transforms import AutoAugment

Settings = TypeVar("Settings")


@dataclasses.dataclass(frozen=True)
class ImageSettings:
    """What every pipeline needs to make a training or validation image (see ``FlowerDataModule`` for each)."""

    image_size: int
    eval_image_size: int
    crop_scale: tuple[float, float]
    auto_augment: AutoAugment | None
    mean: Sequence[float]
    std: Sequence[float]


def settings_from(settings_class: type[Settings], arguments: object) -> Settings:
    """``settings_class`` (a dataclass) with each field read from the attribute of the same name of ``arguments``."""
    names = [field.name for field in dataclasses.fields(settings_class)]
    return settings_class(**{name: getattr(arguments, name) for name in names})


@dataclasses.dataclass(frozen=True)
class BatchContext:
    """What the training device's transform of a batch needs to know about the run at this step."""

    training: bool  # inside the trainer's training loop (not validating, testing or predicting)
    train_size: int  # the side of this epoch's training images (progressive resizing)
    bf16: bool = False  # the run's precision is bf16
    channels_last: bool = False  # the model keeps its inputs in NHWC memory order

    def dtype(self, *, images_on: torch.Tensor) -> torch.dtype:
        # A bf16 run on a GPU gets bf16 batches, written by the normalisation's one pass instead of cast again by
        # autocast; on CPU float32, which CPUs without native bf16 elementwise kernels handle faster.
        return torch.bfloat16 if images_on.is_cuda and self.bf16 else torch.float32


class TrainImages(NamedTuple):
    """A training batch after its pipeline's transform: ``N × 3 × s × s`` normalised images at the epoch's
    training side, and their class indices."""

    images: torch.Tensor
    labels: torch.Tensor


class TrainingPipeline(ABC):
    """One way of turning the training photos into training batches; see the module's docstring."""

    @abstractmethod
    def datasets(self, train: Sequence[Sample], val: Sequence[Sample], *, root: Path,
                 trainer: Any | None) -> tuple[Dataset, Dataset]:
        """The training and validation datasets of the split; ``root`` is the data folder, ``trainer`` the
        DataModule's (None outside a trainer)."""

    def train_collate(self) -> Callable | None:
        """The training loader's ``collate_fn``; None for torch's default."""
        return None

    def loader_workers(self, *, on_cuda: bool) -> int | None:
        """Loader processes this pipeline wants when ``--data.num_workers`` is unset; None for the DataModule's
        default rule."""
        return None

    @abstractmethod
    def on_device(self, batch: Any, context: BatchContext) -> TrainImages | Any:
        """``batch`` on the training device: ``TrainImages`` for a training batch, else the batch ready to use."""
