"""``TailAveraging``: stochastic weight averaging (Izmailov et al., 2018) over the last part of a run.

Written on Lightning's ``WeightAveraging`` rather than using its ``StochasticWeightAveraging``, which swaps the
run's learning-rate schedule for its own (so a time budget could no longer stretch it) and validates and
checkpoints the current weights, not their average, until training ends.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import WeightAveraging

from flowers.errors import ConfigError


class TailAveraging(WeightAveraging):
    """The equal average of the weights taken every ``every_n_steps`` optimizer steps from ``start`` (a fraction
    of the run's planned steps, which a time budget's re-plans move) to the end.

    Before it starts, validation and checkpoints see the current weights; from then on, the average, as with
    ``EMAWeightAveraging``. Use one or the other: both replace the weights that validation scores.
    """

    def __init__(self, start: float = 0.75, every_n_steps: int = 5, device: Any = None,
                 use_buffers: bool = True) -> None:
        if not 0 <= start < 1 or every_n_steps < 1:
            raise ConfigError(f"TailAveraging: start must be a fraction of the run in [0, 1) and every_n_steps at "
                              f"least 1, got start={start} and every_n_steps={every_n_steps}.")
        super().__init__(device=device, use_buffers=use_buffers)
        self.start, self.every_n_steps = start, every_n_steps
        self._trainer: L.Trainer | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        others = [type(c).__name__ for c in trainer.callbacks if isinstance(c, WeightAveraging) and c is not self]
        if others:
            raise ConfigError(f"TailAveraging and {', '.join(others)} would each replace the weights that validation "
                              "scores: use one. To swap a recipe's averaging for this one, empty its callbacks "
                              "first: --trainer.callbacks=[] --config configs/extras/swa.yaml.")
        super().setup(trainer, pl_module, stage)
        self._trainer = trainer

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if math.isinf(trainer.estimated_stepping_batches):
            raise ConfigError("TailAveraging averages the last part of a run, and this run has no planned length "
                              "(trainer.max_epochs=-1 and no trainer.max_steps): set one of them, or --budget.")

    def first_step(self) -> int:
        """The step the average starts at, under the run's current plan (max_epochs or max_steps)."""
        return int(self.start * self._trainer.estimated_stepping_batches)

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        return step_idx is not None and step_idx >= self.first_step() and step_idx % self.every_n_steps == 0

    def averaging(self) -> bool:
        return self._average_model is not None and int(self._average_model.n_averaged) > 0

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.averaging():
            super().on_validation_epoch_start(trainer, pl_module)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.averaging():
            super().on_validation_epoch_end(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.averaging():
            super().on_train_end(trainer, pl_module)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if self.averaging():  # else the checkpoint holds the current weights alone, as without averaging
            super().on_save_checkpoint(trainer, pl_module, checkpoint)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if "averaging_state" in checkpoint:  # saved once the average had begun; before, there is none to load
            super().on_load_checkpoint(trainer, pl_module, checkpoint)
