"""Each private Lightning attribute flowers relies on still means what flowers.lightning_internals assumes.

A Lightning upgrade that renames or repurposes one fails here, by name."""

from __future__ import annotations

import inspect

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from flowers import lightning_internals


def test_set_logger_version_moves_the_log_dir(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="flowers")
    (tmp_path / "flowers" / "version_0").mkdir(parents=True)
    assert logger.version == 1  # the next free number, picked on first use
    lightning_internals.set_logger_version(logger, 7)
    assert logger.version == 7 and logger.log_dir == str(tmp_path / "flowers" / "version_7")


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)
        self.val_steps: list[int] = []

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        self.log("val/x", self.layer(batch[0]).sum())

    def on_validation_epoch_end(self) -> None:
        self.val_steps.append(lightning_internals.logged_step(self.trainer))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Steps(L.pytorch.loggers.Logger):
    """Records the step Lightning gives each logged scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: dict[str, list[int]] = {}

    @property
    def name(self):
        return "steps"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        for key in metrics:
            self.steps.setdefault(key, []).append(step)


def test_logged_step_is_the_step_of_the_validation_scalars(tmp_path):
    data = DataLoader(TensorDataset(torch.randn(6, 2)), batch_size=2)
    model, logger = _Tiny(), _Steps()
    trainer = L.Trainer(max_epochs=2, logger=logger, default_root_dir=tmp_path, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, data, data)
    assert model.val_steps == logger.steps["val/x"] == [2, 5]


class _Progress(_Tiny):
    """Records (batches done, batches per epoch) after each training batch."""

    def __init__(self) -> None:
        super().__init__()
        self.progress: list[tuple[int, int]] = []

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.progress.append(lightning_internals.epoch_progress(self.trainer))


def test_epoch_progress_counts_the_batches_the_epoch_has_finished(tmp_path):
    data = DataLoader(TensorDataset(torch.randn(6, 2)), batch_size=2)
    model = _Progress()
    trainer = L.Trainer(max_epochs=2, logger=False, default_root_dir=tmp_path, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    trainer.fit(model, data)
    # After batch i of an epoch, i + 1 are done (Lightning counts a batch processed once its step has run).
    assert model.progress == [(1, 3), (2, 3), (3, 3)] * 2


def test_each_once_sampler_gives_every_image_to_exactly_one_rank():
    dataset = list(range(7))
    shards = [list(lightning_internals.each_once_sampler(dataset, num_replicas=3, rank=r)) for r in range(3)]
    assert shards == [[0, 3, 6], [1, 4], [2, 5]]


def test_lightning_cli_records_the_instantiator_and_class_path_keys_flowers_checks(tmp_path):
    from flowers.cli import cli_main

    cli = cli_main(["--trainer.logger=false", "--data.image_size=64"], run=False)
    assert cli.model.hparams[lightning_internals.INSTANTIATOR_KEY] == lightning_internals.LIGHTNING_INSTANTIATOR
    # A subclass-mode model's class: LightningCLI reads it back from a checkpoint under this key.
    assert f'"{lightning_internals.CLASS_PATH_KEY}"' in inspect.getsource(LightningCLI._parse_ckpt_path)
