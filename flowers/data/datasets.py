"""Map-style datasets: over file lists (PIL decode per item, as the tutorial's ImageFolder does), and over
the uint8 cache of the fast data path."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from flowers.data.folders import Sample
from flowers.data.images import DECODE_ERRORS, load_rgb
from flowers.errors import DataError

if TYPE_CHECKING:
    from flowers.data.cache import ImageCache


class LabelledImages(Dataset):
    def __init__(self, samples: Sequence[Sample], transform: Callable) -> None:
        self.samples = list(samples)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
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


class CachedImages(Dataset):
    """Items ``indices`` of an ImageCache, each a one-image ``CachedBatch``; with ``as_index``, the
    square's index in the cache (int64) in place of the square."""

    def __init__(self, cache: ImageCache, indices: Iterable[int], labels: list[int], *, as_index: bool = False) -> None:
        self.cache = cache
        self.indices = np.asarray(list(indices))
        self.labels = list(labels)
        self.as_index = as_index

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> CachedBatch:
        i = int(self.indices[index])
        if self.as_index:
            return CachedBatch(torch.tensor(i), self.labels[index], torch.from_numpy(self.cache.sizes[i]))
        # np.array copies the memory-mapped image, so the batch does not pin pages of the file.
        square = torch.from_numpy(np.array(self.cache.pixels[i]))
        return CachedBatch(square, self.labels[index], torch.from_numpy(self.cache.sizes[i]))
