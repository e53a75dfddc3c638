"""``--trainer.callbacks+=LearningRateFinder``: Lightning's learning-rate range test runs before the fit, its suggestion
is printed and becomes the learning rate (scheduler included), its plot lands in the run folder, and the fit trains."""

from __future__ import annotations

import logging

import lightning as L
import pytest
from lightning.pytorch.callbacks import LearningRateFinder

from flowers.callbacks import LR_FINDER_PLOT
from flowers.cli import cli_main
from flowers.module import FlowerClassifier
from tests.helpers.runs import TINY_RUN


class LearningRateAtStart(L.Callback):
    """Records what the first training epoch starts with."""

    seen: dict = {}

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 0:
            scheduler = trainer.lr_scheduler_configs[0].scheduler
            LearningRateAtStart.seen = {"lr": trainer.optimizers[0].param_groups[0]["lr"],
                                        "base_lr": scheduler.base_lrs[0], "module_lr": pl_module.lr,
                                        "step": trainer.global_step, "train_updates": pl_module.train_loss.update_count}


@pytest.fixture
def lightning_log(caplog):
    """What Lightning's logger (rank_zero_info) prints; it does not propagate to the root logger caplog reads."""
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def test_learning_rate_finder_prints_plots_and_sets_its_suggestion(in_tmp, tiny_synthetic, lightning_log):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the dev extra)")
    cli = cli_main([
        "fit", *TINY_RUN, f"--data.data_dir={tiny_synthetic}",
        "--data.batch_size=2", "--trainer.limit_train_batches=16", "--trainer.limit_val_batches=1",
        "--model.optimizer=torch.optim.SGD", "--model.optimizer.lr=0.01",
        "--model.scheduler=torch.optim.lr_scheduler.CosineAnnealingLR", "--model.scheduler.T_max=4",
        "--trainer.callbacks+=LearningRateFinder", "--trainer.callbacks.num_training_steps=15",
        "--trainer.callbacks.min_lr=1e-5", "--trainer.callbacks.max_lr=10",
        f"--trainer.callbacks+={__name__}.LearningRateAtStart",
    ])
    finder = next(c for c in cli.trainer.callbacks if isinstance(c, LearningRateFinder))
    suggestion = finder.optimal_lr.suggestion()
    assert suggestion is not None and suggestion != pytest.approx(0.01)
    assert f"LearningRateFinder: suggested learning rate {suggestion:.3g}" in lightning_log.text
    assert (in_tmp / cli.trainer.log_dir / LR_FINDER_PLOT).stat().st_size > 1000
    # The fit then starts from step 0 at the suggestion, the cosine decaying from it, with no search step counted.
    seen = LearningRateAtStart.seen
    assert seen["step"] == 0 and seen["train_updates"] == 0
    assert seen["lr"] == pytest.approx(suggestion) and seen["base_lr"] == pytest.approx(suggestion)
    assert seen["module_lr"] == pytest.approx(suggestion)
    assert cli.trainer.global_step == 16 and (in_tmp / cli.trainer.log_dir / "checkpoints" / "last.ckpt").is_file()


def test_the_learning_rate_is_none_until_a_trainer_builds_the_optimizer():
    assert FlowerClassifier(5).lr is None
