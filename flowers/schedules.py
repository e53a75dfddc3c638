"""Learning-rate schedules of flowers' own, for ``model.scheduler`` (``class_path: flowers.schedules.…``)."""

from __future__ import annotations

import math

import torch


class WarmupCosineLR(torch.optim.lr_scheduler.LRScheduler):
    """Linear warm-up from ``start_factor × lr`` over ``warmup_fraction`` of the steps, then a cosine
    down to ``final_factor × lr``.

    torch's OneCycleLR and SequentialLR need the run's step count in the YAML; this one reads it from
    the trainer (``total_steps`` unset: FlowerClassifier fills in ``trainer.estimated_stepping_batches``),
    so max_epochs, batch size and data size can change freely. Step it every step
    (``model.scheduler_interval: step``).
    """

    def __init__(self, optimizer, warmup_fraction: float = 0.05, start_factor: float = 0.1,
                 final_factor: float = 0.0, total_steps: int | None = None, last_epoch: int = -1) -> None:
        self.warmup_fraction = warmup_fraction
        self.start_factor = start_factor
        self.final_factor = final_factor
        self.total_steps = total_steps
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        total = max(1, self.total_steps or 1)
        warmup = self.warmup_fraction * total
        if step < warmup:
            return self.start_factor + (1 - self.start_factor) * step / warmup
        progress = min(1.0, (step - warmup) / max(1.0, total - warmup))
        return self.final_factor + (1 - self.final_factor) * 0.5 * (1 + math.cos(math.pi * progress))

    def get_lr(self) -> list[float]:
        return [base * self.factor(self.last_epoch) for base in self.base_lrs]
