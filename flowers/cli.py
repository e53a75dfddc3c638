"""``python -m flowers {fit,validate,test,predict}``: LightningCLI with the project's defaults."""

from __future__ import annotations

import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info

from flowers.callbacks import ClassIndicesWriter, PredictionWriter, TensorBoardPictures
from flowers.checkpointing import (
    AtomicCheckpointIO,
    LastEveryEpoch,
    RNGStateCheckpoint,
    RunFolderConfig,
    check_resumable,
    newest_last_checkpoint,
    refuse_occupied,
    resumes_into,
    run_folder_of,
)
from flowers.data import FlowerDataModule
from flowers.errors import ConfigError, FlowersError, PeerError
from flowers.module import FlowerClassifier

LOG_DIR = "runs"  # every run's TensorBoard logs, config.yaml and checkpoints live under runs/flowers/version_N/
LIGHTNING_CKPT_ALIASES = {"best", "hpc", "registry"}  # "last" is resolved here, see _resolve_last
DDP_TIMEOUT_S = 600.0
# FlowerClassifier arguments that change how a model runs, not what it computes: on resume they follow the command.
RUNTIME_MODEL_KEYS = ("channels_last", "compile", "compile_mode", "fused_optimizer")


class FlowersCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(LastEveryEpoch, "checkpoint")
        parser.set_defaults({
            "checkpoint.monitor": "val/acc",
            "checkpoint.mode": "max",
            "checkpoint.save_last": True,
            # "val/acc" would make a sub-folder in the file name: spell the metric out by hand.
            "checkpoint.filename": "best-epoch={epoch:02d}-val_acc={val/acc:.4f}",
            "checkpoint.auto_insert_metric_name": False,
        })
        parser.add_lightning_class_args(PredictionWriter, "predictions")
        parser.add_argument(
            "--ddp_timeout", type=float, default=DDP_TIMEOUT_S,
            help="Seconds a ddp process waits for its peers in a collective (gradient sync, barrier) before it "
                 "gives up with an error, e.g. when another rank died or hangs. Applies to --trainer.strategy=ddp.",
        )
        # The classes come from the data, never from a hard-coded list.
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.link_arguments("data.class_names", "model.class_names", apply_on="instantiate")

    # -- checkpoints -----------------------------------------------------------------------------
    def _parse_ckpt_path(self) -> None:
        self._resolve_last()
        subcommand = self.config.get("subcommand")
        model = self.config[subcommand].get("model") if subcommand else None
        how_it_runs = {key: model.get(key) for key in RUNTIME_MODEL_KEYS} if model is not None else {}
        # LightningCLI reads the checkpoint's hyperparameters while parsing; a truncated or foreign
        # file would surface as a deep torch.load traceback, so turn it into a one-line error.
        try:
            super()._parse_ckpt_path()
        except FlowersError:
            raise
        except Exception as error:
            path = self.config[self.config.subcommand].get("ckpt_path")
            raise ConfigError(f"--ckpt_path {path!r} cannot be read as a flowers checkpoint ({error}).") from None
        # Lightning replaces all of model.* with the checkpoint's values. What the model is (classes,
        # dropout, loss, optimizer) must stay the checkpoint's; how it runs is this command's choice, as
        # precision, devices and the data cache already are: `--ckpt_path last --model.compile=true` compiles.
        for key, value in how_it_runs.items():
            self.config[subcommand]["model"][key] = value

    def _resolve_last(self) -> None:
        # Lightning's own "last" looks in this run's checkpoint folder, which for a new version_N is empty:
        # "last" means the newest runs/flowers/version_*/checkpoints/last.ckpt instead.
        subcommand = self.config.get("subcommand")
        if not subcommand or self.config[subcommand].get("ckpt_path") != "last":
            return
        save_dir, name = self._run_root(self.config[subcommand])
        newest = newest_last_checkpoint(save_dir, name)
        if newest is None:
            raise ConfigError(
                f"--ckpt_path last: no {save_dir}/{name}/version_*/checkpoints/last.ckpt to resume from (run in "
                "the folder that holds runs/, or pass a checkpoint file). Start a new run without --ckpt_path."
            )
        rank_zero_info(f"--ckpt_path last: {newest}")
        self.config[subcommand].ckpt_path = str(newest)

    @staticmethod
    def _run_root(config) -> tuple[str, str]:
        logger = config.trainer.get("logger")
        init = logger.get("init_args") if hasattr(logger, "get") else None
        if init is None:
            return LOG_DIR, "flowers"
        return str(init.get("save_dir") or LOG_DIR), str(init.get("name") or "flowers")

    def _load_checkpoint(self, ckpt_path: str) -> dict:
        # mmap: a second look at a 170 MB last.ckpt costs page-ins of the few tensors read, not a copy.
        return torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)

    # -- before and after the classes ----------------------------------------------------------------
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if "weights_only" in config and config.get("weights_only") is None:
            config.weights_only = True  # say it, not rely on torch's default: our checkpoints hold no pickled code
        _check_devices(config.trainer)
        if self.subcommand in ("fit", "validate", "test", "predict"):
            _check_writable(config, *self._run_root(config))
        ckpt_path = config.get("ckpt_path")
        if not ckpt_path:
            return
        if ckpt_path not in LIGHTNING_CKPT_ALIASES and not Path(ckpt_path).is_file():
            raise ConfigError(
                f"--ckpt_path {ckpt_path!r} does not exist. Checkpoints are under {LOG_DIR}/flowers/version_N/"
                "checkpoints/ (best-*.ckpt and last.ckpt)."
            )
        if not Path(ckpt_path).is_file():
            return
        self._checkpoint = self._load_checkpoint(ckpt_path)
        check_resumable(self._checkpoint, ckpt_path, None)
        if config.data.get("class_names") is None:
            # Tell the data which classes the checkpoint knows, so predict needs no training folder and
            # validate/test on data with other classes fails with a clear message.
            config.data.class_names = self._checkpoint.get("hyper_parameters", {}).get("class_names")
        if self.subcommand == "fit":
            self._continue_run_folder(config, ckpt_path)

    def _continue_run_folder(self, config, ckpt_path: str) -> None:
        # Resuming a run's own checkpoint logs into that run's folder (same TensorBoard curves, same
        # checkpoints/ with its best-model tracking) instead of a new version_N.
        save_dir, name = self._run_root(config)
        version = run_folder_of(ckpt_path, save_dir, name)
        logger = config.trainer.get("logger")
        if version is None or not hasattr(logger, "get") or logger.get("init_args") is None:
            return
        if logger.init_args.get("version") is None:
            logger.init_args.version = version
            rank_zero_info(f"Resuming {save_dir}/{name}/{version} from {ckpt_path}")

    def after_instantiate_classes(self) -> None:
        if self.subcommand == "fit":
            self._refuse_occupied_run_folder()
        checkpoint = getattr(self, "_checkpoint", None)
        if checkpoint is not None and self.datamodule is not None:
            ckpt_path = (self.config[self.subcommand] if self.subcommand else self.config).get("ckpt_path")
            check_resumable(checkpoint, ckpt_path, self.datamodule.num_classes)
            self._checkpoint = None  # the trainer loads it again; do not keep two copies around

    def _refuse_occupied_run_folder(self) -> None:
        # An explicit logger version or checkpoint.dirpath can name an existing run's folder; the logger
        # would add its event file there as soon as the trainer starts, so check before that.
        logger, checkpoint = self.trainer.logger, self.trainer.checkpoint_callback
        explicit_version = logger is not None and getattr(logger, "_version", None) is not None
        if not explicit_version and not (checkpoint is not None and checkpoint.dirpath):
            return
        log_dir = logger.log_dir if logger is not None else self.trainer.default_root_dir
        if not resumes_into(self.config[self.subcommand].get("ckpt_path"), log_dir):
            refuse_occupied(log_dir, self.trainer)

    def instantiate_trainer(self, **kwargs):
        trainer = self._get(self.config_init, "trainer", default={})
        if trainer.get("strategy") == "ddp":
            # Torch's default of 30 min would leave the survivors of a dead or hung rank waiting that long.
            seconds = self._get(self.config_init, "ddp_timeout", default=DDP_TIMEOUT_S)
            kwargs["strategy"] = DDPStrategy(timeout=timedelta(seconds=seconds))
        kwargs["plugins"] = _with_atomic_checkpoints(trainer.get("plugins"))
        try:
            return super().instantiate_trainer(**kwargs)
        except MisconfigurationException as error:
            raise ConfigError(f"The trainer settings do not fit this machine: {error}") from None

    def after_fit(self) -> None:
        checkpoint = self.trainer.checkpoint_callback
        if checkpoint is not None:
            rank_zero_info(
                f"\nBest checkpoint: {checkpoint.best_model_path or '(none)'}\n"
                f"Last checkpoint: {checkpoint.last_model_path or '(none)'}\n"
                f"Class mapping:   {Path(checkpoint.dirpath) / 'class_indices.json'}\n"
                f"TensorBoard:     tensorboard --logdir {self.trainer.log_dir}"
            )


def _with_atomic_checkpoints(plugins) -> list:
    plugins = [] if plugins is None else list(plugins) if isinstance(plugins, list | tuple) else [plugins]
    if not any(isinstance(p, CheckpointIO) for p in plugins):
        plugins.append(AtomicCheckpointIO())  # a user's own CheckpointIO is kept as given
    return plugins


def _check_devices(trainer) -> None:
    accelerator, devices = trainer.get("accelerator"), trainer.get("devices")
    if accelerator not in ("gpu", "cuda"):
        return  # on CPU, devices are processes: any number runs (slowly), as the ddp tests do
    wanted = _device_count(devices)
    available = torch.cuda.device_count()
    if wanted is None or wanted <= available:
        return  # "auto" and -1 take what there is; Lightning says so itself when that is nothing
    advice = (f"Use --trainer.devices={available} (or -1 for all of them)." if available else
              "No GPU is visible (drivers, CUDA_VISIBLE_DEVICES): use --trainer.accelerator=cpu.")
    raise ConfigError(f"--trainer.devices={devices} asks for {wanted} GPU(s), but this machine has {available}. "
                      + advice)


def _device_count(devices) -> int | None:
    """How many devices ``--trainer.devices`` names: 2, "2", [0, 1] and "0,1" all name two; "auto"/-1 None."""
    if isinstance(devices, list | tuple):
        return len(devices)
    text = str(devices).strip()
    if "," in text:
        return len([d for d in text.split(",") if d.strip()])
    if text.isdigit():
        return int(text)
    return None


def _check_writable(config, save_dir: str, name: str) -> None:
    """The run folder's parent must take files now, not after the data is read and a model is built."""
    folders = [Path(save_dir, name)]
    if config.get("checkpoint") is not None and config.checkpoint.get("dirpath"):
        folders.append(Path(config.checkpoint.dirpath))
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as error:
            raise ConfigError(
                f"The output folder {str(folder)!r} cannot be written ({error.strerror or error}). Fix its "
                "permissions, or write elsewhere with --trainer.logger.init_args.save_dir (and "
                "--checkpoint.dirpath if set)."
            ) from None


def cli_main(args: list[str] | None = None, *, run: bool = True) -> FlowersCLI:
    return FlowersCLI(
        FlowerClassifier,
        FlowerDataModule,
        args=args,
        run=run,
        seed_everything_default=42,
        save_config_callback=RunFolderConfig,
        save_config_kwargs={"overwrite": False},
        trainer_defaults={
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                # No placeholder hp_metric: TensorBoardPictures logs the hparams with the real val metrics at
                # fit end, and TensorBoard keeps only the first hparams record of a run.
                "init_args": {"save_dir": LOG_DIR, "name": "flowers", "default_hp_metric": False},
            },
            "callbacks": [LearningRateMonitor(logging_interval="epoch"), ClassIndicesWriter(), TensorBoardPictures(),
                          RNGStateCheckpoint()],
        },
    )


def main(args: list[str] | None = None) -> int:
    try:
        cli_main(args)
    except FlowersError as error:
        print(f"flowers: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        if (peer := PeerError.from_distributed(error)) is None:
            raise
        print(f"flowers: error: {peer}", file=sys.stderr)
        sys.stderr.flush()
        # The process group is broken: interpreter shutdown could block in its destructors.
        os._exit(2)
    # A gloo process group left for interpreter shutdown to tear down sometimes aborts the process after
    # a finished fit ("terminate called without an active exception", exit -6): close it while it is sound.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0
