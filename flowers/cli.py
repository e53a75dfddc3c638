"""``flowers {fit,validate,test,predict}``: LightningCLI with the project's callbacks, checks and errors."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from argparse import ArgumentError
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch.distributed as dist
import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from flowers import backbones, checks, inference, lightning_internals, precision, restarts, resume, runs
from flowers.budget import TimeBudget, saved_budget
from flowers.callbacks import ClassIndicesWriter, LearningRateFinderReport, TensorBoardPictures
from flowers.checkpoint_reader import check_resumable, read
from flowers.checkpoint_writer import AtomicCheckpointIO
from flowers.checkpointing import BEST_CHECKPOINT, LAST_CHECKPOINT, LastCheckpoint
from flowers.data import FlowerDataModule
from flowers.errors import ConfigError, FlowersError, PeerError
from flowers.module import FlowerClassifier
from flowers.predictions import PredictionWriter
from flowers.rng_state import RNGStateCheckpoint

DDP_TIMEOUT_S = 600.0


class FlowersCLI(LightningCLI):
    def __init__(self, *args, subcommand: str | None = None, **kwargs) -> None:
        self._named_subcommand = subcommand
        super().__init__(*args, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:
        # Only the parser of the subcommand the command line names: building all four takes 2.6 × as long.
        every = LightningCLI.subcommands()
        return {self._named_subcommand: every[self._named_subcommand]} if self._named_subcommand in every else every

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
            "--budget", type=str | None, default=None,
            help="fit only: the time the whole run may take, as [[[D:]H:]M:]S (0:05:00). The run measures its speed "
                 "at its start and sets --trainer.max_epochs so that its whole schedule ends at the budget, then "
                 "re-plans at each epoch's end; a resumed run keeps its plan. null: the epochs of the config.",
        )
        parser.add_argument(
            "--ddp_timeout", type=float, default=DDP_TIMEOUT_S,
            help="Seconds a ddp process waits for its peers in a collective (gradient sync, barrier) before it "
                 "gives up with an error, e.g. when another rank died or hangs. Applies to --trainer.strategy=ddp.",
        )
        # The classes, the normalisation and the evaluation side are the data's, and the model's to remember, so
        # predict, serve and export use them untold.
        for key in FlowerClassifier.FROM_DATA:
            parser.link_arguments(f"data.{key}", f"model.{key}", apply_on="instantiate")

    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
        self._given = _given_settings(sys.argv[1:] if args is None else args)
        config = _command(self.config)
        self._checkpoint = None
        subcommand = self.config.get("subcommand")
        self._job = restarts.current_job() if subcommand == "fit" else None
        save_dir, name = runs.run_root(config)
        logger = runs.logger_entry(config)
        self._plan = resume.plan(subcommand, config.get("ckpt_path"), job=self._job, save_dir=save_dir, name=name,
                                 folder_chosen=logger is None or logger.init_args.get("version") is not None)
        if self._plan.ckpt_path != config.get("ckpt_path"):
            config.ckpt_path = self._plan.ckpt_path
        for note in self._plan.notes:
            rank_zero_info(note)
        self._resumed_step = 0
        self._budget = config.get("budget") if subcommand == "fit" else None
        if config.get("ckpt_path") is not None:
            self._checkpoint = _read_checkpoint(config.ckpt_path)
            self._resumed_step = int(self._checkpoint.get("global_step", 0))
            if subcommand == "fit":
                # A budget's run resumed without --budget still continues its plan.
                self._budget = self._budget or saved_budget(self._checkpoint)
                _warn_overridden_model_flags(config.get("model"), lightning_internals.subcommand_defaults(
                    self, "fit").get("model"), self._checkpoint.get("hyper_parameters", {}))
        # Lightning then replaces all of model.* with the checkpoint's. What the model is (classes, dropout,
        # loss, optimizer) stays the checkpoint's; how it runs is this command's, as precision and devices are.
        model = config.get("model")
        self._how_it_runs = {key: model.get(key) for key in FlowerClassifier.HOW_IT_RUNS} if model is not None else {}
        if self._checkpoint is not None and subcommand != "fit":
            self._how_it_runs.update(_evaluation_overrides_said(self._given, model,
                                                                self._checkpoint.get("hyper_parameters") or {}))

    def before_instantiate_classes(self) -> None:
        config = _command(self.config)
        if "weights_only" in config and config.get("weights_only") is None:
            config.weights_only = True  # say it, not rely on torch's default: our checkpoints hold no pickled code
        for key, value in self._how_it_runs.items():
            config.model[key] = value
        if config.get("precision") == "auto" and config.trainer.get("precision") is None:
            config.trainer.precision, why = precision.resolve(config.trainer.get("accelerator"))
            rank_zero_info(f"precision: auto -> --trainer.precision={config.trainer.precision} ({why})")
        checks.check_devices(config.trainer)
        if self.subcommand == "fit" and config.get("budget") is not None:
            checks.check_budget(config.budget, config.trainer)
        checks.check_image_sizes(config.data)
        if self.subcommand is not None:
            dirpath = config.get("checkpoint", {}).get("dirpath")
            checks.check_writable([Path(*runs.run_root(config))] + ([Path(dirpath)] if dirpath else []))
        if (config.data.get("mean") is None) != (config.data.get("std") is None):
            raise ConfigError("--data.mean and --data.std go together: set both, or neither for the normalisation "
                              "of the checkpoint or the backbone's weights.")
        if config.data.get("mean") is None:
            config.data.mean, config.data.std = self._normalisation(config)
        if self._checkpoint is not None:
            self._take_the_checkpoints_settings(config, self._checkpoint.get("hyper_parameters") or {})
        if self._plan.version:
            # Resuming a run's own checkpoint continues that run's folder: its curves, its best-model tracking.
            runs.logger_entry(config).init_args.version = self._plan.version

    def _take_the_checkpoints_settings(self, config, hparams: dict) -> None:
        # The data follows the checkpoint's classes and evaluation side unless the command says otherwise, aloud.
        if hparams.get("mean") and [list(config.data.mean), list(config.data.std)] != [hparams["mean"], hparams["std"]]:
            rank_zero_info(f"Normalising with --data.mean={list(config.data.mean)} --data.std={list(config.data.std)}"
                           f" as the command says; the checkpoint's are {hparams['mean']} and {hparams['std']}.")
        if config.data.get("class_names") is None:
            # The checkpoint's classes: predict needs no training folder, and validate/test on data with other
            # classes fail with a clear message.
            config.data.class_names = hparams.get("class_names")
        if self.subcommand != "fit":
            self._evaluate_at_the_checkpoints_size(config, hparams)

    def _evaluate_at_the_checkpoints_size(self, config, hparams: dict) -> None:
        # validate, test and predict evaluate at the side the run evaluated at, unless the command sets one.
        saved = inference.eval_image_size(hparams, config.ckpt_path)
        data = config.data
        asked = next((data.get(key) for key in ("eval_image_size", "image_size") if f"data.{key}" in self._given
                      and data.get(key) is not None), None)
        if asked is None:
            data.eval_image_size = saved
            rank_zero_info(f"Evaluating at {saved} px, the side the checkpoint's run evaluated at.")
        elif asked != saved:
            data.eval_image_size = asked
            rank_zero_info(f"Evaluating at {asked} px as the command says; the checkpoint's run evaluated at "
                           f"{saved} px.")

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
        # What the command reads is checked before the trainer makes the run folder: a typo leaves nothing behind.
        if self.datamodule is not None and self.subcommand is not None:
            self.datamodule.check_inputs(self.subcommand)
        if self.subcommand == "fit" and config.get("ckpt_path") is None:
            self.model.check_initial_weights()
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
        checks.check_trainer(config.trainer, new_fit=self.subcommand == "fit" and config.get("ckpt_path") is None,
                             ddp_timeout=config.get("ddp_timeout"))
        if config.trainer.get("strategy") == "ddp":
            # Torch's default of 30 min would leave the survivors of a dead or hung rank waiting that long.
            kwargs["strategy"] = DDPStrategy(timeout=timedelta(seconds=config.get("ddp_timeout", DDP_TIMEOUT_S)))
        plugins = config.trainer.get("plugins")
        plugins = [] if plugins is None else list(plugins) if isinstance(plugins, list | tuple) else [plugins]
        if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
            plugins.append(AtomicCheckpointIO())  # a user's own CheckpointIO is kept as given
        try:
            trainer = super().instantiate_trainer(**kwargs, plugins=plugins)
        except MisconfigurationException as error:  # not only the machine: also settings that contradict
            raise ConfigError(f"Lightning refused the --trainer settings: {error}") from None
        if self._budget is not None:
            trainer.callbacks.insert(0, TimeBudget(self._budget, planned=config.get("ckpt_path") is not None))
        return trainer

    def before_fit(self) -> None:
        if self._job is not None:
            trainer, plan = self.trainer, self._plan
            restarts.start(self._job, Path(trainer.log_dir or trainer.default_root_dir),
                           global_rank=trainer.global_rank, world_size=trainer.world_size, restarted=plan.restarted,
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


def _warn_overridden_model_flags(command, defaults, saved: dict) -> None:
    # LightningCLI replaces the command's model.* with the checkpoint's hyperparameters on resume: say which of
    # the settings the command changed are dropped, instead of resuming silently with the saved ones.
    if command is None or defaults is None:
        return
    ignored = {lightning_internals.INSTANTIATOR_KEY, *FlowerClassifier.FROM_DATA, *FlowerClassifier.HOW_IT_RUNS}
    keys = [key for key in saved if key not in ignored]
    given, default, kept = (_leaves({key: source.get(key) for key in keys}) for source in (command, defaults, saved))
    # A YAML list and the tuple the command line parses are one setting: (0.9, 0.999) is [0.9, 0.999].
    given, default, kept = ({key: _plain(value) for key, value in values.items()} for values in (given, default, kept))
    overridden = [f"--model.{key}={value!r} (the checkpoint's: {kept.get(key)!r})" for key, value in given.items()
                  if value != default.get(key) and value != kept.get(key)]
    if overridden:
        rank_zero_warn("Resuming from a checkpoint keeps the model it was trained with, so these settings of the "
                       "command are not used: " + "; ".join(overridden) + ". Start a new run with "
                       "--model.init_from CHECKPOINT to train its weights with other settings.", category=UserWarning)


def _given_settings(args: list[str]) -> set[str]:
    """The dotted settings a command line names, itself or in its --config files: ``{"data.image_size", …}``.
    What the user chose, as against a default that merely equals it."""
    given, words = set(), iter(args)
    for word in words:
        if word in ("-c", "--config") or word.startswith("--config="):
            path = word.partition("=")[2] if "=" in word else next(words, "")
            try:
                settings = yaml.safe_load(Path(path).read_text()) if Path(path).is_file() else None
            except (OSError, yaml.YAMLError):
                settings = None  # the parser has already said what is wrong with it
            given |= set(_leaves(settings)) if isinstance(settings, dict) else set()
        elif word.startswith("--"):
            given.add(word[2:].partition("=")[0])
    # A class's settings may be written under init_args: model.init_args.eval_hflip is model.eval_hflip.
    return given | {key.replace(".init_args.", ".", 1) for key in given}


def _evaluation_overrides_said(given: set[str], command, saved: dict) -> dict:
    """The evaluation settings a validate/test/predict command sets against the checkpoint's, said aloud."""
    overrides = {key: command.get(key) for key in FlowerClassifier.HOW_IT_EVALUATES
                 if f"model.{key}" in given and key in saved and command.get(key) != saved[key]}
    for key, value in overrides.items():
        rank_zero_info(f"--model.{key}={value} as the command says; the checkpoint's is {saved[key]}.")
    return overrides


def _plain(value):
    """Tuples as lists, at any depth, so a setting compares equal however it was written."""
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _leaves(settings, prefix: str = "") -> dict:
    """``{"optimizer.init_args.lr": 0.1, …}``: nested settings (dicts or Namespaces) by dotted name."""
    settings = settings.as_dict() if hasattr(settings, "as_dict") else settings
    if not isinstance(settings, dict):
        return {prefix[:-1]: settings}
    return {key: value for name, inner in settings.items() for key, value in _leaves(inner, f"{prefix}{name}.").items()}


def _read_checkpoint(path: str, flag: str = "--ckpt_path") -> dict:
    # Before Lightning parses the file's hyper_parameters: they are data, checked against the model's arguments.
    return read(path, flag, model_class=FlowerClassifier)


def cli_main(args: list[str] | None = None, *, run: bool = True) -> FlowersCLI:
    named = _subcommand_of(sys.argv[1:] if args is None else args) if run else None
    try:
        return FlowersCLI(FlowerClassifier, FlowerDataModule, subcommand=named, args=args, run=run,
                          **_cli_settings(named))
    except ArgumentError as error:
        # jsonargparse would print its whole usage first: the error alone, and where the settings are listed.
        print(f"flowers: error: {_refusal(error, sys.argv[1:] if args is None else args)}", file=sys.stderr)
        raise SystemExit(2) from None


class _ParsedOnly(FlowersCLI):
    """LightningCLI's parse and its own checks of the command line, with its hooks that build things left out."""

    def before_instantiate_classes(self) -> None:
        pass

    def instantiate_classes(self) -> None:
        pass

    def after_instantiate_classes(self) -> None:
        pass


def parse_fit(args: list[str]):
    """``(parser, config)`` of a fit command line (less ``fit``), parsed and type-checked as fit would and nothing
    built: for tools that check or write fit configs. A setting fit would refuse is a ConfigError."""
    seed_log = logging.getLogger("lightning.fabric.utilities.seed")
    level = seed_log.level
    seed_log.setLevel(logging.WARNING)  # no "Seed set to 42": nothing runs
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "LightningCLI's args parameter is intended")  # a tool's own argv
            cli = _ParsedOnly(FlowerClassifier, FlowerDataModule, args=args, run=False, **_cli_settings(None))
    except ArgumentError as error:
        raise ConfigError(" ".join(str(error).split())) from None
    finally:
        seed_log.setLevel(level)
    return cli.parser, cli.config


def _cli_settings(named: str | None) -> dict:
    return dict(
        seed_everything_default=42,
        save_config_callback=runs.RunFolderConfig,
        save_config_kwargs={"overwrite": False},
        # No abbreviated options: a misspelled flag that is a prefix of a real one must be an error, not a guess.
        # exit_on_error=False: a parse error is raised, and printed alone (the usage is for --help).
        parser_kwargs={"prog": "flowers", "allow_abbrev": False, "exit_on_error": False,
                       **{subcommand: {"allow_abbrev": False, "exit_on_error": False}
                          for subcommand in LightningCLI.subcommands() if named in (None, subcommand)}},
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
    except (FlowersError, MisconfigurationException) as error:  # Lightning's refusal of a setting, too
        restarts.record_exit(str(error))
        print(f"flowers: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        if (peer := _peer_failure(error)) is None:
            restarts.record_exit(f"{type(error).__name__}: {error}")
            raise
        restarts.record_exit(str(peer))
        print(f"flowers: error: {peer}", file=sys.stderr)
        sys.stderr.flush()
        # The process group is broken: interpreter shutdown could block in its destructors.
        os._exit(2)
    # A gloo process group left for interpreter shutdown to tear down sometimes aborts the process after
    # a finished fit ("terminate called without an active exception", exit -6): close it while it is sound.
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return 0


# What gloo and NCCL say when a peer process is gone or stopped answering.
PEER_FAILURE_SIGNS = ("connection closed by peer", "connection reset by peer", "timed out", "timeout",
                      "broken pipe", "nccl communicator was aborted", "socket closed")


def _peer_failure(error: BaseException) -> PeerError | None:
    """The user-facing form of a collective that failed because of a peer, or None for other errors."""
    text = str(error)
    is_distributed = isinstance(error, dist.DistError) or "gloo" in text.lower() or "nccl" in text.lower()
    if not (is_distributed and any(sign in text.lower() for sign in PEER_FAILURE_SIGNS)):
        return None
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else "?"
    first_line = text.strip().splitlines()[0][:300] if text.strip() else type(error).__name__
    return PeerError(
        f"rank {rank} lost contact with another ddp process ({first_line}). A peer died (killed, out of "
        "memory, crashed: see its own log) or stopped answering for --ddp_timeout seconds. The last "
        "checkpoint is intact: fix the cause and resume with --ckpt_path last."
    )


def _subcommand_of(words: list[str]) -> str | None:
    """The Lightning subcommand the command line starts with, if it starts with one."""
    return words[0] if words and words[0] in LightningCLI.subcommands() else None


def _refusal(error: ArgumentError, words: list[str]) -> str:
    """A parse error (several lines from jsonargparse) as one paragraph that says where the settings are listed."""
    subcommand = _subcommand_of(words)
    listed = f"`flowers {subcommand} --help` lists every setting" if subcommand else \
        "`flowers --help` lists the subcommands"
    return f"{' '.join(str(error).split())}. {listed}."
