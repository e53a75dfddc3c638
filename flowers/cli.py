"""``flowers {fit,validate,test,predict}``: LightningCLI with the project's callbacks, checks and errors."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from flowers import backbones, checks, lightning_internals, precision, restarts, runs
from flowers.callbacks import ClassIndicesWriter, LearningRateFinderReport, TensorBoardPictures
from flowers.checkpointing import (
    BEST_CHECKPOINT,
    LAST_CHECKPOINT,
    AtomicCheckpointIO,
    LastCheckpoint,
    RNGStateCheckpoint,
    check_resumable,
)
from flowers.data import FlowerDataModule
from flowers.errors import ConfigError, FlowersError, PeerError
from flowers.module import FlowerClassifier
from flowers.predictions import PredictionWriter

LIGHTNING_CKPT_ALIASES = {"best", "hpc", "registry"}  # "last" means the newest run's last.ckpt, resolved here
DDP_TIMEOUT_S = 600.0
# FlowerClassifier arguments that change how a model runs, not what it computes: on resume they follow the command.
RUNTIME_MODEL_KEYS = ("channels_last", "compile", "compile_mode", "fused_optimizer")


class FlowersCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # The first ModelCheckpoint is trainer.checkpoint_callback: the best one, as "best" and the HPARAMS tab want.
        parser.add_lightning_class_args(ModelCheckpoint, "best_checkpoint")
        parser.set_defaults({f"best_checkpoint.{key}": value for key, value in BEST_CHECKPOINT.items()})
        parser.add_lightning_class_args(LastCheckpoint, "checkpoint")
        parser.set_defaults({f"checkpoint.{key}": value for key, value in LAST_CHECKPOINT.items()})
        parser.link_arguments("checkpoint.dirpath", "best_checkpoint.dirpath")
        parser.add_lightning_class_args(PredictionWriter, "predictions")
        parser.add_argument(
            "--precision", type=Literal["auto"] | None, default=None,
            help="auto: --trainer.precision=bf16-mixed where bf16 runs natively (a CUDA GPU with bf16, a CPU with "
                 "avx512_bf16 or amx_bf16), else 32-true. Used only while --trainer.precision is unset.",
        )
        parser.add_argument(
            "--ddp_timeout", type=float, default=DDP_TIMEOUT_S,
            help="Seconds a ddp process waits for its peers in a collective (gradient sync, barrier) before it "
                 "gives up with an error, e.g. when another rank died or hangs. Applies to --trainer.strategy=ddp.",
        )
        # The classes come from the data, never from a hard-coded list.
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.link_arguments("data.class_names", "model.class_names", apply_on="instantiate")
        # The normalisation is the data's to apply and the model's to remember (predict, export, serve).
        parser.link_arguments("data.mean", "model.mean", apply_on="instantiate")
        parser.link_arguments("data.std", "model.std", apply_on="instantiate")
        parser.link_arguments("model.channels_last", "data.channels_last")

    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
        config = _command(self.config)
        self._checkpoint = None
        self._job = restarts.current_job() if self.config.get("subcommand") == "fit" else None
        self._restarted = False
        if self._job is not None and config.get("ckpt_path") in (None, "last"):
            # Started again by torchrun or SLURM: this job's own run goes on, never the newest run of the folder.
            own = restarts.own_last_checkpoint(self._job, *runs.run_root(config))
            if own is not None:
                config.ckpt_path, self._restarted = str(own), True
                rank_zero_info(f"{self._job} started again: resuming its own run from {own}")
        if config.get("ckpt_path") == "last":
            config.ckpt_path = str(_newest_last_checkpoint(config))
        self._resumed_step = 0
        if config.get("ckpt_path") not in (None, *LIGHTNING_CKPT_ALIASES):
            self._checkpoint = _read_checkpoint(config.ckpt_path)
            self._resumed_step = int(self._checkpoint.get("global_step", 0))
            if self.config.get("subcommand") == "fit":
                _warn_overridden_model_flags(config.get("model"), lightning_internals.subcommand_defaults(
                    self, "fit").get("model"), self._checkpoint.get("hyper_parameters", {}))
        # Lightning then replaces all of model.* with the checkpoint's. What the model is (classes, dropout,
        # loss, optimizer) stays the checkpoint's; how it runs is this command's, as precision and devices are.
        model = config.get("model")
        self._how_it_runs = {key: model.get(key) for key in RUNTIME_MODEL_KEYS} if model is not None else {}

    def before_instantiate_classes(self) -> None:
        config = _command(self.config)
        if "weights_only" in config and config.get("weights_only") is None:
            config.weights_only = True  # say it, not rely on torch's default: our checkpoints hold no pickled code
        for key, value in self._how_it_runs.items():
            config.model[key] = value
        if "channels_last" in config.data:
            config.data.channels_last = config.model.channels_last
        if config.get("precision") == "auto" and config.trainer.get("precision") is None:
            config.trainer.precision, why = precision.resolve(config.trainer.get("accelerator"))
            rank_zero_info(f"precision: auto -> --trainer.precision={config.trainer.precision} ({why})")
        checks.check_devices(config.trainer)
        checks.check_image_sizes(config.data)
        if self.subcommand is not None:
            dirpath = config.get("checkpoint", {}).get("dirpath")
            checks.check_writable([Path(*runs.run_root(config))] + ([Path(dirpath)] if dirpath else []))
        if "mean" in config.data and config.data.get("mean") is None:
            config.data.mean, config.data.std = self._normalisation(config)
        if self._checkpoint is None:
            return
        if config.data.get("class_names") is None:
            # The checkpoint's classes: predict needs no training folder, and validate/test on data with other
            # classes fail with a clear message.
            config.data.class_names = self._checkpoint.get("hyper_parameters", {}).get("class_names")
        save_dir, name = runs.run_root(config)
        logger = runs.logger_entry(config)
        version = runs.version_of(config.ckpt_path, save_dir, name)
        if self.subcommand == "fit" and version and logger is not None and logger.init_args.get("version") is None:
            # Resuming a run's own checkpoint continues that run's folder: its curves, its best-model tracking.
            logger.init_args.version = version
            rank_zero_info(f"Resuming {save_dir}/{name}/{version} from {config.ckpt_path}")

    def _normalisation(self, config) -> tuple[list[float], list[float]]:
        """The normalisation a run's data gets when the config sets none: the resumed checkpoint's, the
        init_from run's, else the one the backbone's weights were trained with."""
        model = config.model
        source = self._checkpoint or (_read_checkpoint(model.init_from, "--model.init_from")
                                      if self.subcommand == "fit" and model.get("init_from") else None)
        hparams = source.get("hyper_parameters", {}) if source is not None else {}
        if hparams.get("mean") and hparams.get("std"):
            return list(hparams["mean"]), list(hparams["std"])
        if source is not None:  # a checkpoint from before backbones: the tutorial's network and normalisation
            wanted = backbones.preprocessing(hparams.get("backbone", backbones.TUTORIAL_ALEXNET), None)
        else:
            wanted = backbones.preprocessing(model.get("backbone", backbones.TUTORIAL_ALEXNET), model.get("weights"))
            if wanted.image_size and wanted.image_size != config.data.get("image_size"):
                rank_zero_info(f"--model.weights={model.weights} were trained at {wanted.image_size} px; this run "
                               f"trains at --data.image_size={config.data.get('image_size')}.")
        return list(wanted.mean), list(wanted.std)

    def after_instantiate_classes(self) -> None:
        config = _command(self.config)
        if self._checkpoint is not None and self.datamodule is not None:
            check_resumable(self._checkpoint, config.ckpt_path, self.datamodule.num_classes)
        self._checkpoint = None  # the trainer loads it again; do not keep two copies around
        if self.subcommand == "fit":
            self._refuse_occupied_run_folder(config)

    def _refuse_occupied_run_folder(self, config) -> None:
        # An explicit logger version or checkpoint.dirpath can name an existing run's folder; the logger
        # would add its event file there as soon as the trainer starts, so check before that.
        logger = runs.logger_entry(config)
        version = logger.init_args.get("version") if logger is not None else None
        dirpath = config.checkpoint.get("dirpath")
        if version is None and not dirpath:
            return
        log_dir = self.trainer.logger.log_dir if self.trainer.logger is not None else self.trainer.default_root_dir
        if not runs.resumes_into(config.get("ckpt_path"), log_dir):
            if problem := runs.occupied(log_dir, dirpath or Path(log_dir) / runs.CHECKPOINTS):
                raise ConfigError(problem)

    def instantiate_trainer(self, **kwargs):
        config = _command(self.config_init)
        if config.trainer.get("strategy") == "ddp":
            # Torch's default of 30 min would leave the survivors of a dead or hung rank waiting that long.
            kwargs["strategy"] = DDPStrategy(timeout=timedelta(seconds=config.get("ddp_timeout", DDP_TIMEOUT_S)))
        plugins = config.trainer.get("plugins")
        plugins = [] if plugins is None else list(plugins) if isinstance(plugins, list | tuple) else [plugins]
        if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
            plugins.append(AtomicCheckpointIO())  # a user's own CheckpointIO is kept as given
        try:
            return super().instantiate_trainer(**kwargs, plugins=plugins)
        except MisconfigurationException as error:
            raise ConfigError(f"The trainer settings do not fit this machine: {error}") from None

    def before_fit(self) -> None:
        if self._job is not None:
            trainer = self.trainer
            restarts.start(self._job, Path(trainer.log_dir or trainer.default_root_dir),
                           global_rank=trainer.global_rank, world_size=trainer.world_size, restarted=self._restarted,
                           resumed_from=_command(self.config).get("ckpt_path"), global_step=self._resumed_step)

    def after_fit(self) -> None:
        best = self.trainer.checkpoint_callback
        rank_zero_info(
            f"\nBest checkpoint: {getattr(best, 'best_model_path', '') or '(none)'}\n"
            f"Last checkpoint: {runs.last_checkpoint(self.trainer) or '(none)'}\n"
            f"Class mapping:   {runs.checkpoint_dir(self.trainer, self.trainer.log_dir) / runs.CLASS_INDICES}\n"
            f"TensorBoard:     tensorboard --logdir {self.trainer.log_dir}"
        )


def _command(config):
    """The settings of the subcommand being run (the whole config when there is none)."""
    return config[config.subcommand] if config.get("subcommand") else config


def _newest_last_checkpoint(config) -> Path:
    # Lightning's own "last" looks in this run's checkpoint folder, which for a new version_N is empty.
    save_dir, name = runs.run_root(config)
    newest = runs.newest_last_checkpoint(save_dir, name)
    if newest is None:
        raise ConfigError(
            f"--ckpt_path last: no {save_dir}/{name}/version_*/checkpoints/last.ckpt to resume from (run in "
            "the folder that holds runs/, or pass a checkpoint file). Start a new run without --ckpt_path."
        )
    rank_zero_info(f"--ckpt_path last: {newest}")
    return newest


def _warn_overridden_model_flags(command, defaults, saved: dict) -> None:
    # LightningCLI replaces the command's model.* with the checkpoint's hyperparameters on resume: say which of
    # the settings the command changed are dropped, instead of resuming silently with the saved ones.
    if command is None or defaults is None:
        return
    ignored = {"num_classes", "class_names", "mean", "std", "_instantiator", *RUNTIME_MODEL_KEYS}
    keys = [key for key in saved if key not in ignored]
    given, default, kept = (_leaves({key: source.get(key) for key in keys}) for source in (command, defaults, saved))
    overridden = [f"--model.{key}={value!r} (the checkpoint's: {kept.get(key)!r})" for key, value in given.items()
                  if value != default.get(key) and value != kept.get(key)]
    if overridden:
        rank_zero_warn("Resuming from a checkpoint keeps the model it was trained with, so these settings of the "
                       "command are not used: " + "; ".join(overridden) + ". Start a new run with "
                       "--model.init_from CHECKPOINT to train its weights with other settings.", category=UserWarning)


def _leaves(settings, prefix: str = "") -> dict:
    """``{"optimizer.init_args.lr": 0.1, …}``: nested settings (dicts or Namespaces) by dotted name."""
    settings = settings.as_dict() if hasattr(settings, "as_dict") else settings
    if not isinstance(settings, dict):
        return {prefix[:-1]: settings}
    return {key: value for name, inner in settings.items() for key, value in _leaves(inner, f"{prefix}{name}.").items()}


def _read_checkpoint(path: str, flag: str = "--ckpt_path") -> dict:
    if not Path(path).is_file():
        raise ConfigError(
            f"{flag} {path!r} does not exist. Checkpoints are under {runs.LOG_DIR}/{runs.NAME}/version_N/"
            f"{runs.CHECKPOINTS}/ (best-*.ckpt and last.ckpt)."
        )
    try:
        # mmap: a 170 MB last.ckpt costs page-ins of the few tensors read, not a copy.
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # a truncated or foreign file would surface as a deep torch.load traceback
        raise ConfigError(f"{flag} {path!r} cannot be read as a flowers checkpoint ({error}).") from None
    check_resumable(checkpoint, path, None, flag)
    return checkpoint


def cli_main(args: list[str] | None = None, *, run: bool = True) -> FlowersCLI:
    return FlowersCLI(
        FlowerClassifier,
        FlowerDataModule,
        args=args,
        run=run,
        seed_everything_default=42,
        save_config_callback=runs.RunFolderConfig,
        save_config_kwargs={"overwrite": False},
        # No abbreviated options: a misspelled flag that is a prefix of a real one must be an error, not a guess.
        parser_kwargs={"prog": "flowers", "allow_abbrev": False,
                       **{subcommand: {"allow_abbrev": False} for subcommand in FlowersCLI.subcommands()}},
        trainer_defaults={
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                # No placeholder hp_metric: TensorBoardPictures logs the hparams with the real val metrics at
                # fit end, and TensorBoard keeps only the first hparams record of a run.
                "init_args": {"save_dir": runs.LOG_DIR, "name": runs.NAME, "default_hp_metric": False},
            },
            "callbacks": [runs.SameVersionOnEveryRank(), LearningRateMonitor(logging_interval="epoch"),
                          ClassIndicesWriter(), TensorBoardPictures(), RNGStateCheckpoint(),
                          LearningRateFinderReport()],  # prints and plots --trainer.callbacks+=LearningRateFinder
        },
    )


def main(args: list[str] | None = None) -> int:
    try:
        cli_main(args)
    except FlowersError as error:
        restarts.record_exit(str(error))
        print(f"flowers: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        if (peer := PeerError.from_distributed(error)) is None:
            restarts.record_exit(f"{type(error).__name__}: {error}")
            raise
        restarts.record_exit(str(peer))
        print(f"flowers: error: {peer}", file=sys.stderr)
        sys.stderr.flush()
        # The process group is broken: interpreter shutdown could block in its destructors.
        os._exit(2)
    # A gloo process group left for interpreter shutdown to tear down sometimes aborts the process after
    # a finished fit ("terminate called without an active exception", exit -6): close it while it is sound.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0
