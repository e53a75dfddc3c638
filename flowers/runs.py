"""The run-folder layout, in one place: ``runs/flowers/version_N/`` with its config files and checkpoints.

::

    runs/flowers/version_N/
        config.yaml                 the run's whole configuration (config-resume-K.yaml for each resume)
        events.out.tfevents.*       TensorBoard
        checkpoints/last.ckpt       every epoch's end
        checkpoints/best-*.ckpt     the best by val/acc
        checkpoints/class_indices.json

A new run never writes into a folder that already holds a run's config or checkpoints.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from flowers import lightning_internals
from flowers.errors import ConfigError
from flowers.files import atomic_write_text

LOG_DIR = "runs"
NAME = "flowers"
CONFIG = "config.yaml"
CHECKPOINTS = "checkpoints"
LAST = "last"  # last.ckpt
BEST_FILENAME = "best-epoch={epoch:02d}-val_acc={val/acc:.4f}"
CLASS_INDICES = "class_indices.json"


def write_class_indices(path: Path, class_names: list[str]) -> None:
    """The tutorial's ``class_indices.json``: ``{"0": "daisy", …}``."""
    atomic_write_text(path, json.dumps({str(i): name for i, name in enumerate(class_names)}, indent=4) + "\n")


def read_class_indices(path: Path) -> list[str]:
    """The class names of a ``class_indices.json``, in index order; ConfigError when it is missing or malformed."""
    if not path.is_file():
        raise ConfigError(f"{path} is missing: `flowers export` writes it beside the export, and serve reads the "
                          "class names from it.")
    try:
        mapping = json.loads(path.read_text())
        return [mapping[str(i)] for i in range(len(mapping))]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"{path} is not a class mapping like {{\"0\": \"daisy\", …}}: {error}") from None


def logger_entry(config):
    """The entry of a parsed config's ``trainer.logger`` (one logger or a list) that names the run folder: the
    TensorBoard logger's, else the first with settings; None when there is none."""
    logger = config.trainer.get("logger")
    entries = [e for e in (logger if isinstance(logger, list) else [logger])
               if hasattr(e, "get") and e.get("init_args") is not None]
    tensorboard = [e for e in entries if "TensorBoard" in str(e.get("class_path", ""))]
    return (tensorboard or entries or [None])[0]


def run_root(config) -> tuple[str, str]:
    """``(save_dir, name)`` of the TensorBoard logger a parsed config asks for (``runs``, ``flowers`` by default)."""
    entry = logger_entry(config)
    init = entry.get("init_args") if entry is not None else None
    if init is None:
        return LOG_DIR, NAME
    return str(init.get("save_dir") or LOG_DIR), str(init.get("name") or NAME)


def run_dir_of(checkpoint: str | os.PathLike) -> Path:
    """``runs/flowers/version_N`` for ``runs/flowers/version_N/checkpoints/x.ckpt``."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINTS else checkpoint.parent


def find_checkpoints(runs_dir: str | os.PathLike = LOG_DIR) -> list[Path]:
    """Every ``*.ckpt`` under ``runs_dir``, oldest first."""
    return sorted(Path(runs_dir).rglob("*.ckpt"), key=lambda p: (p.stat().st_mtime, str(p)))


def newest_best_checkpoint(runs_dir: str | os.PathLike = LOG_DIR) -> Path:
    checkpoints = find_checkpoints(runs_dir)
    best = [p for p in checkpoints if p.name.startswith("best")]
    if not (best or checkpoints):
        raise FileNotFoundError(f"no checkpoints under {runs_dir}: train one with `make train`")
    return (best or checkpoints)[-1]


def newest_last_checkpoint(save_dir: str | os.PathLike, name: str) -> Path | None:
    """The most recently written ``<save_dir>/<name>/version_*/checkpoints/last.ckpt``, if any."""
    candidates = list(Path(save_dir, name).glob(f"version_*/{CHECKPOINTS}/{LAST}.ckpt"))
    return max(candidates, key=lambda p: p.stat().st_mtime_ns) if candidates else None


def version_of(checkpoint: str | os.PathLike, save_dir: str | os.PathLike, name: str) -> str | None:
    """``version_N`` when ``checkpoint`` lies in ``<save_dir>/<name>/version_N/checkpoints/``, else None."""
    path = Path(checkpoint).resolve()
    if path.parent.name == CHECKPOINTS and path.parent.parent.parent == Path(save_dir, name).resolve():
        return path.parent.parent.name
    return None


def resumes_into(ckpt_path: str | None, log_dir: str | os.PathLike) -> bool:
    """Whether ``ckpt_path`` is a checkpoint of the run in ``log_dir`` (``log_dir/checkpoints/*.ckpt``)."""
    if not ckpt_path or not Path(ckpt_path).is_file():
        return False
    folder = Path(ckpt_path).resolve().parent
    return folder.name == CHECKPOINTS and folder.parent == Path(log_dir).resolve()


def checkpoint_dir(trainer: L.Trainer, log_dir: str | os.PathLike) -> Path:
    """Where this run's checkpoints go: ``--checkpoint.dirpath``, else ``log_dir/checkpoints``."""
    checkpoint = trainer.checkpoint_callback
    if checkpoint is not None and checkpoint.dirpath:
        return Path(checkpoint.dirpath)
    return Path(log_dir) / CHECKPOINTS


def last_checkpoint(trainer: L.Trainer) -> str:
    """The path of the run's ``last.ckpt`` once written (the one file its ModelCheckpoint keeps), else ``""``."""
    writers = [c for c in trainer.checkpoint_callbacks if getattr(c, "filename", None) == LAST and c.monitor is None]
    return writers[0].best_model_path if writers else ""


def occupied(log_dir: str | os.PathLike, ckpt_dir: str | os.PathLike) -> str | None:
    """Why a new run may not start in ``log_dir``, or None when that folder holds no run."""
    log_dir = Path(log_dir)
    found = [p for p in (log_dir / CONFIG,) if p.is_file()] + sorted(Path(ckpt_dir).glob("*.ckpt"))
    if not found:
        return None
    return (
        f"{log_dir} already holds a run ({', '.join(str(p) for p in found[:3])}). A new run never writes over "
        "another's config or checkpoints: resume that run with --ckpt_path last (or its last.ckpt), or leave "
        "--trainer.logger.init_args.version and --checkpoint.dirpath unset to start a new version_N folder."
    )


def next_free(folder: Path, pattern: str) -> str:
    """The first ``pattern.format(k)``, k = 1, 2, …, that does not exist in ``folder``."""
    index = 1
    while (folder / pattern.format(index)).exists():
        index += 1
    return pattern.format(index)


class SameVersionOnEveryRank(L.Callback):
    """Under ddp every rank takes rank 0's ``version_N``: each would otherwise pick the next free number on its
    own, racing rank 0's ``mkdir``. Runs at setup, when the process group is up."""

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        logger = trainer.logger
        if isinstance(logger, TensorBoardLogger) and trainer.world_size > 1:
            lightning_internals.set_logger_version(logger, trainer.strategy.broadcast(logger.version))


class RunFolderConfig(SaveConfigCallback):
    """Writes the run's ``config.yaml``, and never over another run's files.

    A new run whose folder already holds a ``config.yaml`` or checkpoints (an explicit
    ``--trainer.logger.init_args.version`` or ``--checkpoint.dirpath``) stops before writing anything.
    A resume into the folder of its own checkpoint keeps ``config.yaml`` and writes the resumed command's
    config as ``config-resume-N.yaml`` beside it; validate/test/predict in an occupied folder write
    ``config-<stage>-N.yaml``.
    """

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        log_dir = Path(trainer.log_dir)
        if resumes_into(self.config.get("ckpt_path"), log_dir):
            self.config_filename = next_free(log_dir, "config-resume-{}.yaml")
        elif stage != "fit" and (log_dir / self.config_filename).exists():
            # validate/test/predict write no checkpoints; with --trainer.logger=false they all share one folder.
            self.config_filename = next_free(log_dir, f"config-{getattr(stage, 'value', stage)}-{{}}.yaml")
        else:
            problem = occupied(log_dir, checkpoint_dir(trainer, log_dir)) if trainer.is_global_zero else None
            if problem := trainer.strategy.broadcast(problem):
                raise ConfigError(problem)
        super().setup(trainer, pl_module, stage)
        if trainer.is_global_zero:
            self._log_seed(trainer, log_dir)

    def _log_seed(self, trainer: L.Trainer, log_dir: Path) -> None:
        # The seed LightningCLI used (drawn when seed_everything is true), next to the run's logs.
        seed: Any = self.config.get("seed_everything")
        rank_zero_info(f"Seed: {seed} (seed_everything in {log_dir / self.config_filename})")
        for logger in trainer.loggers:
            logger.log_hyperparams({"seed_everything": seed})
