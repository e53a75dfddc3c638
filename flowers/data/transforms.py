"""Transform builders; the defaults are the tutorial's (Normalize with mean = std = 0.5)."""

from __future__ import annotations

from collections.abc import Sequence

from torchvision import transforms as T

TUTORIAL_MEAN = (0.5, 0.5, 0.5)
TUTORIAL_STD = (0.5, 0.5, 0.5)


def train_transform(
    *, crop_size: int = 224, crop_scale: tuple[float, float] = (0.08, 1.0),
    mean: Sequence[float] = TUTORIAL_MEAN, std: Sequence[float] = TUTORIAL_STD,
) -> T.Compose:
    return T.Compose([
        T.RandomResizedCrop(crop_size, scale=crop_scale, antialias=True),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize(mean, std),
    ])


def eval_transform(
    *, crop_size: int = 224, mean: Sequence[float] = TUTORIAL_MEAN, std: Sequence[float] = TUTORIAL_STD,
) -> T.Compose:
    # The tutorial squashes to a square (Resize((224, 224))) rather than resize-then-centre-crop.
    return T.Compose([T.Resize((crop_size, crop_size), antialias=True), T.ToTensor(), T.Normalize(mean, std)])
