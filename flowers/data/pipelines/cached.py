"""The fast pipeline (``--data.cache=true``): the photos decoded once into a uint8 cache (flowers.data.cache),
each training batch's crops and flips drawn by the loader on the host (``batch_augment.WithTrainViews``) and
cut, resized and normalised as one batch on the training device (flowers.data.batch_augment)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowers.data.batch_augment import CachedTrainBatch, WithTrainViews, crop_flip_normalise, eval_batch
from flowers.data.cache import ImageCache, cache_side, ensure_cache, fitting_side, upload_in_chunks
from flowers.data.datasets import CachedBatch, CachedImages
from flowers.data.folders import Sample
from flowers.data.pipelines import BatchContext, ImageSettings, TrainImages, TrainingPipeline
from flowers.data.transforms import auto_augment_transform
from flowers.errors import ConfigError


@dataclass(frozen=True)
class CachedSettings(ImageSettings):
    """The DataModule's arguments this pipeline reads (see ``FlowerDataModule`` for each)."""

    cache_dir: Path
    cache_on_device: bool | None


class CachedPipeline(TrainingPipeline):
    def __init__(self, settings: CachedSettings) -> None:
        self.settings = settings
        self.augment = auto_augment_transform(settings.auto_augment)  # on each uint8 view, after its crop and flip
        self.cache: ImageCache | None = None
        self.device_pixels: torch.Tensor | None = None  # the cache on the training device, when held there

    def datasets(self, train: Sequence[Sample], val: Sequence[Sample], *, root: Path,
                 trainer: Any | None) -> tuple[CachedImages, CachedImages]:
        paths = [s.path for s in [*train, *val]]
        self.cache = ensure_cache(paths, root=root, side=self._cache_side(paths), fallback_dir=self.settings.cache_dir)
        self.device_pixels = self._cache_to_device(self.cache, trainer)
        as_index = self.device_pixels is not None
        train_set = CachedImages(self.cache, range(len(train)), [s.label for s in train], as_index=as_index)
        val_set = CachedImages(self.cache, range(len(train), len(train) + len(val)), [s.label for s in val],
                               as_index=as_index)
        return train_set, val_set

    def train_collate(self) -> WithTrainViews | None:
        if self.cache is None:
            return None
        return WithTrainViews(side=self.cache.pixels.shape[-1], scale=self.settings.crop_scale)

    def loader_workers(self, *, on_cuda: bool) -> int | None:
        if self.device_pixels is not None:
            return 0  # an item is an index: a worker would only add inter-process traffic
        if not on_cuda:
            # A cached item is a memory copy, and on a CPU that also trains, a worker process competes with
            # the intra-op threads for the same cores: no faster (see docs/benchmarks.md).
            return 0
        return None

    def on_device(self, batch: Any, context: BatchContext) -> TrainImages | Any:
        # Here, on the training device, cached batches become what the PIL transforms would have produced.
        settings = self.settings
        if isinstance(batch, CachedTrainBatch):
            images = crop_flip_normalise(self._squares(batch.squares_or_indices), batch.boxes, batch.flip,
                                         crop_size=context.train_size, mean=settings.mean, std=settings.std,
                                         channels_last=context.channels_last, augment=self.augment,
                                         dtype=context.dtype(images_on=batch.boxes))
            return TrainImages(images, batch.labels)
        if isinstance(batch, CachedBatch):
            if context.training:
                # Silently evaluation squares, un-augmented, if a rebuilt training loader dropped WithTrainViews.
                raise RuntimeError("A cached training batch came without its crop boxes: the training DataLoader "
                                   "lost its collate_fn, flowers.data.batch_augment.WithTrainViews.")
            images = eval_batch(self._squares(batch.squares_or_indices), crop_size=settings.eval_image_size,
                                mean=settings.mean, std=settings.std, channels_last=context.channels_last,
                                dtype=context.dtype(images_on=batch.labels))
            return images, batch.labels
        return batch  # test and predict batches, read through PIL

    def _squares(self, squares_or_indices: torch.Tensor) -> torch.Tensor:
        if self.device_pixels is None:
            return squares_or_indices
        return self.device_pixels[squares_or_indices]  # indices into the cache held on this device

    def _cache_side(self, paths: list[str]) -> int:
        # One cache serves both: large enough that neither the train crops nor the eval squash upsample.
        return fitting_side(paths, cache_side(max(self.settings.image_size, self.settings.eval_image_size)))

    def _cache_to_device(self, cache: ImageCache, trainer: Any | None) -> torch.Tensor | None:
        wanted = self.settings.cache_on_device
        if wanted is False or trainer is None:
            return None
        device = trainer.strategy.root_device
        if device.type != "cuda":
            if wanted:
                raise ConfigError("data.cache_on_device=true needs training on a CUDA GPU; unset it on CPU.")
            return None
        if wanted is None:
            free, _ = torch.cuda.mem_get_info(device)
            # Decided once for all ranks: ranks that disagreed would run different loaders and RNG paths.
            if not trainer.strategy.reduce_boolean_decision(cache.pixels.nbytes <= free / 4, all=True):
                return None
        return upload_in_chunks(cache.pixels, device)
