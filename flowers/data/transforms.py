"""Transform builders; the defaults are the tutorial's (Normalize with mean = std = 0.5)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from torchvision import transforms as T
from torchvision.transforms import v2

TUTORIAL_MEAN = (0.5, 0.5, 0.5)
TUTORIAL_STD = (0.5, 0.5, 0.5)

AutoAugment = Literal["trivial", "rand"]


def auto_augment_transform(name: AutoAugment | None) -> Callable | None:
    """torchvision's TrivialAugmentWide (``"trivial"``) or RandAugment (``"rand"``, 2 ops at magnitude 9), for a
    PIL image or a uint8 ``3 × H × W`` tensor; None for None."""
    if name is None:
        return None
    if name == "trivial":
        return v2.TrivialAugmentWide()
    if name == "rand":
        return v2.RandAugment()
    raise ValueError(f"auto_augment must be 'trivial', 'rand' or None, got {name!r}")


def train_transform(
    *, crop_size: int = 224, crop_scale: tuple[float, float] = (0.08, 1.0),
    mean: Sequence[float] = TUTORIAL_MEAN, std: Sequence[float] = TUTORIAL_STD, auto_augment: AutoAugment | None = None,
) -> T.Compose:
    augment = auto_augment_transform(auto_augment)
    return T.Compose([
        T.RandomResizedCrop(crop_size, scale=crop_scale, antialias=True),
        T.RandomHorizontalFlip(),
        *([augment] if augment is not None else []),
        T.ToTensor(),
        T.Normalize(mean, std),
    ])


def eval_transform(
    *, crop_size: int = 224, mean: Sequence[float] = TUTORIAL_MEAN, std: Sequence[float] = TUTORIAL_STD,
) -> T.Compose:
    # The tutorial squashes to a square (Resize((224, 224))) rather than resize-then-centre-crop.
    return T.Compose([T.Resize((crop_size, crop_size), antialias=True), T.ToTensor(), T.Normalize(mean, std)])
