"""Augmentations of a whole training batch on its device, after normalisation: mixup, cutmix, random erasing.

They act on the float batch and its labels, so the PIL path and the cached path share them
(``FlowerDataModule.on_after_batch_transfer``). Mixing turns the labels into soft ones (``N × classes``,
rows summing to 1), which ``nn.CrossEntropyLoss`` takes as they are (label smoothing included). The draws
come from torch's global generator on the host, which checkpoints save (flowers.rng_state), so a resumed
run draws what an uninterrupted one would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributions import Beta


def one_hot(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Class indices as float rows of ``num_classes`` with a single 1; soft labels are returned as they are."""
    if labels.is_floating_point():
        return labels
    return torch.nn.functional.one_hot(labels, num_classes).float()


def _mix_ratio(alpha: float) -> float:
    # On the host: a device draw would need a sync to read back.
    return float(Beta(torch.tensor(alpha), torch.tensor(alpha)).sample())


def mixup(images: torch.Tensor, targets: torch.Tensor, *, alpha: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Each image blended with another of the batch (a random pairing): ``λ·x + (1-λ)·x_other``, ``λ ~ Beta(α, α)``,
    and its soft labels blended alike. Returns the images, the labels and ``λ``."""
    lam = _mix_ratio(alpha)
    other = torch.randperm(len(images)).to(images.device)
    mixed = images.lerp(images[other], 1 - lam)
    return mixed, targets.lerp(targets[other], 1 - lam), lam


def cutmix(images: torch.Tensor, targets: torch.Tensor, *, alpha: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A rectangle of each image replaced by the same rectangle of another image of the batch; the box's
    area is ``1 - λ`` of the image, ``λ ~ Beta(α, α)``, centred anywhere and clipped at the borders, and the
    labels are mixed by the area actually pasted. Returns the images, the labels and that ``λ``."""
    lam = _mix_ratio(alpha)
    height, width = images.shape[-2:]
    cut = math.sqrt(1 - lam)
    cut_h, cut_w = round(height * cut), round(width * cut)
    cy, cx = int(torch.randint(height, ())), int(torch.randint(width, ()))
    top, bottom = max(cy - cut_h // 2, 0), min(cy + cut_h - cut_h // 2, height)
    left, right = max(cx - cut_w // 2, 0), min(cx + cut_w - cut_w // 2, width)
    lam = 1 - (bottom - top) * (right - left) / (height * width)
    other = torch.randperm(len(images)).to(images.device)
    mixed = images.clone()
    mixed[:, :, top:bottom, left:right] = images[other, :, top:bottom, left:right]  # gathers the box only
    return mixed, targets.lerp(targets[other], 1 - lam), lam


def mix_batch(
    images: torch.Tensor, labels: torch.Tensor, *, num_classes: int, mixup_alpha: float = 0.0,
    cutmix_alpha: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """mixup or cutmix on the batch (each half the time when both are on), with soft labels; unchanged
    images and hard labels when both alphas are 0."""
    if mixup_alpha <= 0 and cutmix_alpha <= 0:
        return images, labels
    targets = one_hot(labels, num_classes)
    use_cutmix = cutmix_alpha > 0 and (mixup_alpha <= 0 or bool(torch.rand(()) < 0.5))
    if use_cutmix:
        images, targets, _ = cutmix(images, targets, alpha=cutmix_alpha)
    else:
        images, targets, _ = mixup(images, targets, alpha=mixup_alpha)
    return images, targets


def random_erase(
    images: torch.Tensor, *, prob: float, scale: Sequence[float] = (0.02, 1 / 3),
    ratio: Sequence[float] = (0.3, 1 / 0.3),
) -> torch.Tensor:
    """Each image, with probability ``prob``, gets one rectangle set to 0, the mean colour after
    normalisation (Zhong et al.'s random erasing; torchvision's ``RandomErasing`` defaults): area
    ``~U(scale)`` of the image, aspect ``~ log-U(ratio)``, clipped to the image, anywhere inside it.
    One mask for the whole batch, drawn on the host: no per-image loop."""
    if prob <= 0:
        return images
    n, height, width = len(images), images.shape[-2], images.shape[-1]
    chosen = torch.rand(n) < prob
    area = torch.empty(n).uniform_(*scale) * height * width
    aspect = torch.exp(torch.empty(n).uniform_(math.log(ratio[0]), math.log(ratio[1])))
    h = torch.sqrt(area * aspect).round().clamp(1, height)
    w = torch.sqrt(area / aspect).round().clamp(1, width)
    top = torch.floor(torch.rand(n) * (height - h + 1))
    left = torch.floor(torch.rand(n) * (width - w + 1))
    rows = torch.arange(height).view(1, -1, 1)
    cols = torch.arange(width).view(1, 1, -1)
    inside = ((rows >= top.view(-1, 1, 1)) & (rows < (top + h).view(-1, 1, 1))
              & (cols >= left.view(-1, 1, 1)) & (cols < (left + w).view(-1, 1, 1)) & chosen.view(-1, 1, 1))
    # In place on a copy: the out-of-place masked_fill would drop a channels_last layout.
    return images.clone().masked_fill_(inside.unsqueeze(1).to(images.device, non_blocking=True), 0)


@dataclass(frozen=True)
class BatchAugment:
    """The augmentations every training pipeline's batches get, in their order: random erasing, then mixup or
    cutmix (the DataModule's arguments of the same names)."""

    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    random_erasing: float = 0.0

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, *,
                 num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
        images = random_erase(images, prob=self.random_erasing)
        return mix_batch(images, labels, num_classes=num_classes, mixup_alpha=self.mixup_alpha,
                         cutmix_alpha=self.cutmix_alpha)
