"""Learning-rate schedules of flowers' own, for ``model.scheduler`` (``class_path: flowers.schedules.…``)."""

from __future__ import annotations

import math

import torch

from flowers.errors import ConfigError
from flowers.stretch import checked, position, stretched


class WarmupCosineLR(torch.optim.lr_scheduler.LRScheduler):
    """Linear warm-up from ``start_factor × lr`` over ``warmup_fraction`` of the steps, then a cosine
    down to ``final_factor × lr``.

    torch's OneCycleLR and SequentialLR need the run's step count in the YAML; this one reads it from
    the trainer (``total_steps`` unset: FlowerClassifier fills in ``trainer.estimated_stepping_batches``),
    so max_epochs, batch size and data size can change freely. Step it every step
    (``model.scheduler_interval: step``). A time budget's re-plan runs the rest of it over a new number of steps
    (``stretch``); ``total_steps`` stays the length it was written for.
    """

    def __init__(self, optimizer, warmup_fraction: float = 0.05, start_factor: float = 0.1,
                 final_factor: float = 0.0, total_steps: int | None = None, last_epoch: int = -1) -> None:
        self.warmup_fraction = warmup_fraction
        self.start_factor = start_factor
        self.final_factor = final_factor
        self.total_steps = total_steps
        self.knots: list[list[float]] = []  # flowers.stretch; saved with the scheduler's state
        super().__init__(optimizer, last_epoch)

    def stretch(self, *, at_step: int, run_steps: int, new_run_steps: int) -> None:
        """From ``at_step`` on, end the schedule at ``new_run_steps`` instead of ``run_steps``."""
        self.knots = stretched(self.knots, at=at_step, end=run_steps, new_end=new_run_steps)

    def load_state_dict(self, state_dict: dict) -> None:
        try:
            knots = checked(state_dict.get("knots", []) if isinstance(state_dict, dict) else None)
        except ValueError as error:
            raise ConfigError(f"The checkpoint's learning-rate schedule is not one flowers wrote ({error}): resume "
                              "from another checkpoint, or start a new run.") from None
        super().load_state_dict({**state_dict, "knots": knots})

    def factor(self, step: float) -> float:
        step = position(step, self.knots)
        total = max(1, self.total_steps or 1)
        warmup = self.warmup_fraction * total
        if step < warmup:
            return self.start_factor + (1 - self.start_factor) * step / warmup
        progress = min(1.0, (step - warmup) / max(1.0, total - warmup))
        return self.final_factor + (1 - self.final_factor) * 0.5 * (1 + math.cos(math.pi * progress))

    def get_lr(self) -> list[float]:
        return [base * self.factor(self.last_epoch) for base in self.base_lrs]
