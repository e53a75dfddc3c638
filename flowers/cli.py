"""``python -m flowers {fit,validate,test,predict}``: LightningCLI with the project's defaults."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_info

from flowers.callbacks import ClassIndicesWriter, PredictionWriter, TensorBoardPictures
from flowers.data import FlowerDataModule
from flowers.errors import ConfigError, FlowersError
from flowers.module import FlowerClassifier

LOG_DIR = "runs"  # every run's TensorBoard logs, config.yaml and checkpoints live under runs/flowers/version_N/
LIGHTNING_CKPT_ALIASES = {"last", "best", "hpc", "registry"}


class FlowersCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({
            "checkpoint.monitor": "val/acc",
            "checkpoint.mode": "max",
            "checkpoint.save_last": True,
            # "val/acc" would make a sub-folder in the file name: spell the metric out by hand.
            "checkpoint.filename": "best-epoch={epoch:02d}-val_acc={val/acc:.4f}",
            "checkpoint.auto_insert_metric_name": False,
        })
        parser.add_lightning_class_args(PredictionWriter, "predictions")
        # The classes come from the data, never from a hard-coded list.
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.link_arguments("data.class_names", "model.class_names", apply_on="instantiate")

    def _parse_ckpt_path(self) -> None:
        # LightningCLI reads the checkpoint's hyperparameters while parsing; a truncated or foreign
        # file would surface as a deep torch.load traceback, so turn it into a one-line error.
        try:
            super()._parse_ckpt_path()
        except FlowersError:
            raise
        except Exception as error:
            path = self.config[self.config.subcommand].get("ckpt_path")
            raise ConfigError(f"--ckpt_path {path!r} cannot be read as a flowers checkpoint ({error}).") from None

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if "weights_only" in config and config.get("weights_only") is None:
            config.weights_only = True  # say it, not rely on torch's default: our checkpoints hold no pickled code
        ckpt_path = config.get("ckpt_path")
        if not ckpt_path:
            return
        if ckpt_path not in LIGHTNING_CKPT_ALIASES and not Path(ckpt_path).is_file():
            raise ConfigError(
                f"--ckpt_path {ckpt_path!r} does not exist. Checkpoints are under {LOG_DIR}/flowers/version_N/"
                "checkpoints/ (best-*.ckpt and last.ckpt)."
            )
        if Path(ckpt_path).is_file() and config.data.get("class_names") is None:
            # Tell the data which classes the checkpoint knows, so predict needs no training folder and
            # validate/test on data with other classes fails with a clear message.
            hparams = torch.load(ckpt_path, map_location="cpu", weights_only=True).get("hyper_parameters", {})
            config.data.class_names = hparams.get("class_names")

    def after_fit(self) -> None:
        checkpoint = self.trainer.checkpoint_callback
        if checkpoint is not None:
            rank_zero_info(
                f"\nBest checkpoint: {checkpoint.best_model_path or '(none)'}\n"
                f"Last checkpoint: {checkpoint.last_model_path or '(none)'}\n"
                f"Class mapping:   {Path(checkpoint.dirpath) / 'class_indices.json'}\n"
                f"TensorBoard:     tensorboard --logdir {self.trainer.log_dir}"
            )


def cli_main(args: list[str] | None = None, *, run: bool = True) -> FlowersCLI:
    return FlowersCLI(
        FlowerClassifier,
        FlowerDataModule,
        args=args,
        run=run,
        seed_everything_default=42,
        save_config_kwargs={"overwrite": False},
        trainer_defaults={
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                # No placeholder hp_metric: TensorBoardPictures logs the hparams with the real val metrics at
                # fit end, and TensorBoard keeps only the first hparams record of a run.
                "init_args": {"save_dir": LOG_DIR, "name": "flowers", "default_hp_metric": False},
            },
            "callbacks": [LearningRateMonitor(logging_interval="epoch"), ClassIndicesWriter(), TensorBoardPictures()],
        },
    )


def main(args: list[str] | None = None) -> int:
    try:
        cli_main(args)
    except FlowersError as error:
        print(f"flowers: error: {error}", file=sys.stderr)
        return 2
    return 0
