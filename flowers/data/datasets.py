"""Map-style datasets: over file lists (PIL decode per item, as the tutorial's ImageFolder does), and over
the uint8 cache of the fast data path."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from flowers.data.cache import ImageCache
from flowers.data.folders import Sample
from flowers.data.images import DECODE_ERRORS, load_rgb
from flowers.data.sampling import item_rng
from flowers.errors import DataError


class LabelledImages(Dataset):
    """Items by index, or by ``(index, seed)`` from the training sampler (``sampling.EpochSampler``): the
    transform's random draws then come from the item's own seed."""

    def __init__(self, samples: Sequence[Sample], transform: Callable) -> None:
        self.samples = list(samples)
        self.transform = transform

    @property
    def labels(self) -> list[int]:
        """Each item's class index, read from the file list: nothing is decoded."""
        return [sample.label for sample in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int]:
        index, seed = key if isinstance(key, tuple) else (key, None)
        sample = self.samples[index]
        try:
            image = load_rgb(sample.path)
        except DECODE_ERRORS as error:
            # Only reached with verify_images=false (setup skips such files otherwise), or for a file that
            # changed after setup: name it instead of ending in a PIL traceback from a loader worker.
            raise DataError(
                f"Cannot read training image {sample.path!r} ({type(error).__name__}: {error}). Remove or "
                "replace it, or keep --data.verify_images=true to skip unreadable files with a warning."
            ) from None
        with item_rng(seed) if seed is not None else contextlib.nullcontext():
            return self.transform(image), sample.label


class UnlabelledImages(Dataset):
    """Images to predict; yields the index so the writer can name each row's file.

    A missing or undecodable file yields a black placeholder and its error message, so one bad file
    becomes one row saying why instead of ending the whole predict run.
    """

    def __init__(self, paths: Sequence[str], transform: Callable) -> None:
        self.paths = list(paths)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, str]:
        try:
            return self.transform(load_rgb(self.paths[index])), index, ""
        except DECODE_ERRORS as error:
            placeholder = self.transform(Image.new("RGB", (8, 8)))  # same shape as a real item
            return torch.zeros_like(placeholder), index, f"{type(error).__name__}: {error}"


class CachedBatch(NamedTuple):
    """An item of ``CachedImages``, or a batch of them (``default_collate`` keeps the type): an evaluation
    batch as the loader yields it, and the input of the training loader's ``batch_augment.WithTrainViews``."""

    squares_or_indices: torch.Tensor  # 3 × S × S uint8 squares, or int64 indices into the cache on the device
    labels: torch.Tensor | int
    sizes: torch.Tensor  # each original's (height, width)
    seeds: torch.Tensor | int = -1  # from the training sampler; -1 for items read by index


class CachedImages(Dataset):
    """Items ``indices`` of an ImageCache, each a one-image ``CachedBatch``; with ``as_index``, the
    square's index in the cache (int64) in place of the square. Read by ``(index, seed)`` (the training
    sampler), the item carries its seed, from which ``batch_augment.WithTrainViews`` draws the batch's views."""

    def __init__(self, cache: ImageCache, indices: Iterable[int], labels: list[int], *, as_index: bool = False) -> None:
        self.cache = cache
        self.indices = np.asarray(list(indices))
        self.labels = list(labels)  # each item's class index, as LabelledImages.labels
        self.as_index = as_index

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, key: int | tuple[int, int]) -> CachedBatch:
        index, seed = key if isinstance(key, tuple) else (key, -1)
        i = int(self.indices[index])
        size = torch.from_numpy(self.cache.sizes[i])
        if self.as_index:
            return CachedBatch(torch.tensor(i), self.labels[index], size, seed)
        # np.array copies the memory-mapped image, so the batch does not pin pages of the file.
        square = torch.from_numpy(np.array(self.cache.pixels[i]))
        return CachedBatch(square, self.labels[index], size, seed)
