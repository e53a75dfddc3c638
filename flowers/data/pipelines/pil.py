"""The tutorial's pipeline: each training image decoded and augmented in PIL by the loader (``transforms``).

The loader's workers crop at ``image_size``; on the training device a batch is only resized when progressive
resizing wants a smaller side this epoch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchvision.transforms.v2 import functional as F

from flowers.data.datasets import LabelledImages
from flowers.data.folders import Sample
from flowers.data.pipelines import BatchContext, ImageSettings, TrainImages, TrainingPipeline
from flowers.data.transforms import eval_transform, train_transform


@dataclass(frozen=True)
class PilSettings(ImageSettings):
    """The DataModule's arguments this pipeline reads: the image settings alone."""


class PilPipeline(TrainingPipeline):
    def __init__(self, settings: PilSettings) -> None:
        self.settings = settings
        self.train_transform = train_transform(crop_size=settings.image_size, crop_scale=settings.crop_scale,
                                               auto_augment=settings.auto_augment, mean=settings.mean,
                                               std=settings.std)

    def datasets(self, train: Sequence[Sample], val: Sequence[Sample], *, root: Path,
                 trainer: Any | None) -> tuple[LabelledImages, LabelledImages]:
        settings = self.settings
        evaluation = eval_transform(crop_size=settings.eval_image_size, mean=settings.mean, std=settings.std)
        return LabelledImages(train, self.train_transform), LabelledImages(val, evaluation)

    def on_device(self, batch: Any, context: BatchContext) -> TrainImages | Any:
        if not context.training:
            return batch  # the loader's eval transform made it ready
        images, labels = batch
        size = context.train_size
        if images.shape[-1] != size:  # the loader's workers crop at image_size; the epoch may want less
            images = F.resize(images, [size, size], antialias=True)
        return TrainImages(images, labels)
