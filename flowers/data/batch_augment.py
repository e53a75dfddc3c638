"""The tutorial's augmentation and eval resize, on batches of cached uint8 squares, on the batch's device.

torchvision's RandomResizedCrop draws one box per call on one image; here one call draws a box and a
flip per image of the batch with the same rule (vectorised), on the host, in the training loader
(``WithTrainViews``); then, on the training device, the whole batch is cropped and resized, flipped and
normalised at once. Drawing on the host keeps about 80 tiny operations a batch off the GPU, where each
would be a kernel launch, and launches, not arithmetic, bound the tutorial's batch of 32 on a large GPU.

The crop and resize is done two ways, by device. On CPU, each image goes through torchvision's uint8
``resized_crop`` (its fast path). On CUDA, a per-image loop would be 32 launches of several kernels and a
host sync per batch, so there the whole batch is one ``roi_align`` call (bilinear at each output pixel's
centre, averaging ceil(box/output) samples per pixel when shrinking: the same pixels as the bilinear
resize when enlarging, an area filter instead of PIL's triangle one when shrinking).

On CPU every millisecond here is taken from the training step, so the batch is built with as few
full-size passes as possible: the layout change to channels_last happens on uint8 (a quarter of the
bytes of float), and the conversion and normalisation are one pass (timings: see docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch.utils.data import default_collate
from torchvision.ops import roi_align
from torchvision.transforms.v2 import functional as F

from flowers.data.datasets import CachedBatch
from flowers.data.transforms import TUTORIAL_MEAN, TUTORIAL_STD

TUTORIAL_RATIO = (3 / 4, 4 / 3)
ATTEMPTS = 10  # as torchvision's RandomResizedCrop.get_params


def sample_crop_boxes(
    sizes: torch.Tensor, *, scale: Sequence[float] = (0.08, 1.0), ratio: Sequence[float] = TUTORIAL_RATIO,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``(top, left, height, width)`` per row of ``sizes`` (``height, width``), drawn as ``get_params`` does.

    Ten tries of area ~ U(scale) × image area and log-aspect ~ U(log ratio); the first box that fits
    wins, and an image with none gets the centre crop with its aspect clamped to ``ratio``.
    """
    device = sizes.device
    n = sizes.shape[0]
    height, width = sizes[:, 0:1].double(), sizes[:, 1:2].double()
    area = height * width

    def uniform(low: float, high: float) -> torch.Tensor:
        return torch.rand(n, ATTEMPTS, generator=generator, device=device, dtype=torch.float64) * (high - low) + low

    target_area = area * uniform(*scale)
    aspect = torch.exp(uniform(math.log(ratio[0]), math.log(ratio[1])))
    w = torch.round(torch.sqrt(target_area * aspect))
    h = torch.round(torch.sqrt(target_area / aspect))
    fits = (w > 0) & (h > 0) & (w <= width) & (h <= height)
    first = torch.argmax(fits.int(), dim=1, keepdim=True)  # index of the first fitting try
    found = fits.any(dim=1)
    h, w = h.gather(1, first)[:, 0], w.gather(1, first)[:, 0]
    height, width = height[:, 0], width[:, 0]
    # torch.randint(0, H - h + 1) per image: floor of a uniform over the integer range.
    top = torch.floor(torch.rand(n, generator=generator, device=device, dtype=torch.float64) * (height - h + 1))
    left = torch.floor(torch.rand(n, generator=generator, device=device, dtype=torch.float64) * (width - w + 1))
    # The fallback: the whole image, cropped to the nearest allowed aspect ratio.
    in_ratio = width / height
    fh = torch.where(in_ratio < ratio[0], torch.round(width / ratio[0]), height)
    fw = torch.where(in_ratio > ratio[1], torch.round(height * ratio[1]), width)
    h, w = torch.where(found, h, fh), torch.where(found, w, fw)
    top = torch.where(found, top, torch.floor((height - h) / 2))
    left = torch.where(found, left, torch.floor((width - w) / 2))
    return torch.stack([top, left, h, w], dim=1)


@functools.lru_cache(maxsize=16)
def _normalisation(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    # Built once per device: torch.tensor(..., device="cuda") is a blocking host-to-device copy, which would
    # make the host wait for the GPU to drain its queue before every training step.
    mean_t, std_t = (torch.tensor(v, device=device).view(1, -1, 1, 1) for v in (mean, std))
    return 1 / (255 * std_t), -mean_t / std_t


def _normalise(images: torch.Tensor, mean: Sequence[float], std: Sequence[float], *,
               channels_last: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # ToTensor's /255 and Normalize folded into shift + x * scale, one addcmul that also writes the batch's
    # layout and dtype: one pass instead of convert, multiply, add, relayout and autocast's cast. uint8 input
    # changes layout first, on a quarter of float's bytes. float32 unless asked: CPUs without native bf16
    # elementwise kernels are slower at it.
    layout = torch.channels_last if channels_last else torch.contiguous_format
    scale, shift = _normalisation(tuple(mean), tuple(std), images.device)
    if images.dtype == torch.uint8:
        images = images.contiguous(memory_format=layout)
    return torch.addcmul(shift, images, scale, out=torch.empty_like(images, dtype=dtype, memory_format=layout))


def draw_train_views(
    sizes: torch.Tensor, *, side: int, scale: Sequence[float] = (0.08, 1.0), ratio: Sequence[float] = TUTORIAL_RATIO,
    hflip_prob: float = 0.5, generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image's random view: its crop box on the ``side``² square its original (of ``sizes``) was
    squashed into, as int64 ``(top, left, height, width)``, and whether it is flipped (bool).

    Drawn on the host, by the training loader (see ``WithTrainViews``): about 80 small tensor operations
    a batch, each a kernel launch if done on a GPU, where launches, not arithmetic, bound a small batch.
    """
    boxes = sample_crop_boxes(sizes, scale=scale, ratio=ratio, generator=generator)
    # Map each box from the original's pixels onto the square it was squashed into.
    factors = side / sizes.double().repeat(1, 2)
    boxes = (boxes * factors).round().long().clamp(min=0)
    boxes[:, 2:] = boxes[:, 2:].clamp(min=1)
    flip = torch.rand(len(boxes), generator=generator, device=boxes.device) < hflip_prob
    return boxes, flip


def crop_flip_normalise(
    squares: torch.Tensor, boxes: torch.Tensor, flip: torch.Tensor, *, crop_size: int,
    mean: Sequence[float] = TUTORIAL_MEAN, std: Sequence[float] = TUTORIAL_STD, channels_last: bool = False,
    batched: bool | None = None, augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The views of ``draw_train_views`` cut from ``N × 3 × S × S`` uint8 squares: ``N × 3 × c × c`` of
    ``dtype``, in channels_last memory order if asked (for a channels_last model, which would otherwise copy
    it; bf16 for a bf16 run, which would otherwise cast it). ``batched``: crop with one ``roi_align`` instead
    of per image; unset, on CUDA. ``augment``: applied to each uint8 ``3 × c × c`` view after its flip (e.g.
    TrivialAugmentWide), one image at a time."""
    if batched is None:
        batched = squares.is_cuda
    crops = _crop_batched(squares, boxes, crop_size) if batched else _crop_each(squares, boxes, crop_size)
    if batched:
        crops = _flip_rows(crops, flip)
    else:
        crops[flip] = crops[flip].flip(-1)  # only the flipped half is copied
    if augment is not None:
        if crops.is_floating_point():  # roi_align's output: the augmentations' colour ops expect uint8 pixels
            crops = crops.round_().clamp_(0, 255).to(torch.uint8)
        crops = torch.stack([augment(crop) for crop in crops])
    return _normalise(crops, mean, std, channels_last=channels_last, dtype=dtype)


def _flip_rows(crops: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    # One gather reading each flipped image's rows backwards: one pass, where a flipped copy and a select take
    # two; no boolean indexing, whose output size would need a host sync.
    side = crops.shape[-1]
    forwards, backwards = _column_orders(side, crops.device)
    columns = torch.where(flip.view(-1, 1), backwards, forwards)
    return crops.gather(-1, columns.view(-1, 1, 1, side).expand_as(crops))


@functools.lru_cache(maxsize=16)
def _column_orders(side: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    forwards = torch.arange(side, device=device)
    return forwards, forwards.flip(0)


class CachedTrainBatch(NamedTuple):
    """A cached training batch as ``WithTrainViews`` yields it: the squares (or their indices in the cache
    on the training device), the labels, and each image's view (``draw_train_views``)."""

    squares_or_indices: torch.Tensor  # N × 3 × S × S uint8, or N int64 indices
    labels: torch.Tensor
    boxes: torch.Tensor  # N × (top, left, height, width), int64, on the S² square
    flip: torch.Tensor  # N bool


class WithTrainViews:
    """``collate_fn`` of the cached training loader: the default collate of ``CachedBatch`` items, with
    the original sizes replaced by each image's view (``draw_train_views``): a ``CachedTrainBatch``.

    On the host, so a GPU gets only the crop itself; in the loader's workers when there are any, else in
    the training process. The views are drawn from a generator seeded with the batch's first item seed
    (``sampling.EpochSampler`` gives each position of an epoch its own): the same views with any number
    of workers, on a resume in the middle of an epoch, and a different draw on each ddp rank, without
    touching the training process's global generator. Items without seeds draw from the global generator.
    """

    def __init__(self, *, side: int, scale: Sequence[float] = (0.08, 1.0), ratio: Sequence[float] = TUTORIAL_RATIO,
                 hflip_prob: float = 0.5) -> None:
        self.side, self.scale, self.ratio, self.hflip_prob = side, tuple(scale), tuple(ratio), hflip_prob

    def __call__(self, items: list[CachedBatch]) -> CachedTrainBatch:
        squares, labels, sizes, seeds = default_collate(items)
        first_seed = int(seeds[0])
        generator = torch.Generator().manual_seed(first_seed) if first_seed >= 0 else None
        boxes, flip = draw_train_views(sizes, side=self.side, scale=self.scale, ratio=self.ratio,
                                       hflip_prob=self.hflip_prob, generator=generator)
        return CachedTrainBatch(squares, labels, boxes, flip)


def _crop_each(squares: torch.Tensor, boxes: torch.Tensor, crop_size: int) -> torch.Tensor:
    return torch.stack([
        F.resized_crop(image, top, left, h, w, [crop_size, crop_size], antialias=True)
        for image, (top, left, h, w) in zip(squares, boxes.tolist(), strict=True)
    ])


def _crop_batched(squares: torch.Tensor, boxes: torch.Tensor, crop_size: int) -> torch.Tensor:
    # Float in 0..255 (not rounded to uint8: nothing downstream needs it). aligned=True puts pixel i's
    # centre at i + 0.5, as resize's align_corners=False does; sampling_ratio=-1 averages
    # ceil(box side / crop_size) samples per output pixel and axis, the antialiasing of a shrink.
    top, left, h, w = boxes.to(torch.float32).unbind(1)
    index = torch.arange(len(boxes), device=boxes.device, dtype=torch.float32)
    rois = torch.stack([index, left, top, left + w, top + h], dim=1)
    return roi_align(squares.float(), rois, output_size=crop_size, spatial_scale=1.0, sampling_ratio=-1,
                     aligned=True)


def eval_batch(
    squares: torch.Tensor, *, crop_size: int, mean: Sequence[float] = TUTORIAL_MEAN,
    std: Sequence[float] = TUTORIAL_STD, channels_last: bool = False, dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``eval_transform`` (squash to ``crop_size²``) on the cached squares, the whole batch in one resize."""
    if squares.shape[-1] != crop_size or squares.shape[-2] != crop_size:
        squares = F.resize(squares, [crop_size, crop_size], antialias=True)
    return _normalise(squares, mean, std, channels_last=channels_last, dtype=dtype)
