"""The callback a sweep adds to each trial's fit: it reports the metric to the study and stops a pruned trial.

Optuna's own Lightning callback raises TrialPruned inside fit; here every trial is its own process, where that would
end the run as a crash, so this one asks the study and stops the run as early stopping does: the run folder,
its checkpoints and curves stay ordinary, and the study records the epoch it was pruned at.
"""

from __future__ import annotations

import lightning as L
import optuna
import torch
from lightning.pytorch.utilities import rank_zero_warn
from optuna.exceptions import UpdateFinishedTrialError

from flowers.errors import ConfigError
from flowers.sweep.choices import make_pruner
from flowers.sweep.spec import PRUNED_AT
from flowers.sweep.study import storage


class ReportToStudy(L.Callback):
    def __init__(self, storage: str, study_name: str, trial_id: int, metric: str = "val/acc",
                 pruner: dict | None = None) -> None:
        self.storage, self.study_name, self.trial_id, self.metric = storage, study_name, trial_id, metric
        self.pruner = pruner or {"name": "none"}
        self._trial: optuna.Trial | None = None

    def _trial_of_the_study(self) -> optuna.Trial:
        if self._trial is None:
            # A study's pruner is not in its storage: each process that asks it must be given the sweep's.
            study = optuna.load_study(study_name=self.study_name, storage=storage(self.storage),
                                      pruner=make_pruner(self.pruner))
            self._trial = optuna.Trial(study, self.trial_id)
        return self._trial

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        if self.metric not in trainer.callback_metrics:  # every rank has the logged values: all stop here
            raise ConfigError(f"the sweep's metric {self.metric} is not logged by this run; it logs "
                              f"{', '.join(sorted(trainer.callback_metrics))}.")
        prune = False
        if trainer.is_global_zero:
            trial = self._trial_of_the_study()
            try:
                trial.report(float(trainer.callback_metrics[self.metric]), step=trainer.current_epoch)
            except UpdateFinishedTrialError:  # failed by another sweep, its heartbeat late: it runs again anyway
                rank_zero_warn(f"trial {trial.number} was failed by another sweep of the study: this run stops.")
                prune = True
            else:
                prune = trial.should_prune()
                if prune:
                    trial.set_user_attr(PRUNED_AT, trainer.current_epoch)
        # Every ddp process stops at the same epoch, as rank 0 decided.
        if trainer.strategy.broadcast(torch.tensor(prune), src=0).item():
            trainer.should_stop = True
