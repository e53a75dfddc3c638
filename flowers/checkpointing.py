"""Checkpoints that survive ``kill -9`` and resume bit for bit: an atomic writer, the RNG state, ``last``,
and the run-folder policy (a new run never writes into a folder that already holds one).

Lightning 2.6's ``TorchCheckpointIO`` writes through an fsspec transaction: the bytes go to a temporary
file from ``tempfile.mkstemp()`` (the system temp folder, often another filesystem than ``runs/``) and
``shutil.move`` then *copies* them over the target when ``os.rename`` cannot cross filesystems, with no
fsync anywhere. A kill during that copy, or a power cut before the page cache is flushed, leaves a
truncated ``last.ckpt``. ``AtomicCheckpointIO`` writes beside the target, fsyncs, then ``os.replace``-s.

Lightning also saves no global RNG state in its checkpoints (only the loops', optimizers' and callbacks'
states), so a resumed run would shuffle, crop and drop out differently from an uninterrupted one;
``RNGStateCheckpoint`` stores and restores it as a callback state.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from flowers.errors import CheckpointWriteError, ConfigError

HEAD_KEY = "net.classifier.6.weight"  # FlowerClassifier's last Linear: its rows are the classes


def _umask() -> int:
    # Linux shows it in /proc without changing it; elsewhere it can only be read by setting it, which
    # briefly races other threads creating files (TensorBoard's writer), so that is the fallback.
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` that leaves either the old file or the complete new one at ``path``, never a part."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Same folder: os.replace is then a rename within one filesystem, atomic on POSIX.
    handle, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    # mkstemp makes the file private (0600); give it what torch.save's plain open() would: 0666 less the umask.
    os.fchmod(handle, 0o666 & ~_umask())
    file = _WriteErrorRecorder(os.fdopen(handle, "wb"))
    try:
        with file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, target)
    except BaseException as error:
        Path(temp).unlink(missing_ok=True)
        if file.error is not None or isinstance(error, OSError):
            cause = file.error or error
            raise CheckpointWriteError(
                f"could not write the checkpoint {target} ({cause.strerror or cause}). "
                f"{_kept(target)} Free space on the disk that holds {target.parent}, then resume with --ckpt_path last."
            ) from None
        raise
    _fsync_folder(target.parent)


class _WriteErrorRecorder:
    """Keeps the ``OSError`` of a failed write: torch.save reports a full disk only as "unexpected pos"."""

    def __init__(self, file):
        self._file = file
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self._file.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def flush(self) -> None:
        try:
            self._file.flush()
        except OSError as error:
            self.error = self.error or error
            raise

    def fileno(self) -> int:
        return self._file.fileno()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._file.close()
        except OSError as error:
            if exc[0] is None:
                self.error = self.error or error
                raise


def _kept(target: Path) -> str:
    if target.is_file():
        return f"The previous {target.name} is untouched."
    return f"No earlier {target.name} existed; nothing was lost."


def _fsync_folder(folder: Path) -> None:
    # The rename itself must reach the disk too, or a power cut can bring back the old directory entry.
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with an atomic local write; remote paths (s3://, …) keep Lightning's writer."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_torch_save(checkpoint, path)


def _is_local(path) -> bool:
    protocol = get_filesystem(path).protocol
    return "file" in (protocol if isinstance(protocol, tuple) else (protocol,))


class LastEveryEpoch(ModelCheckpoint):
    """``ModelCheckpoint`` whose ``last.ckpt`` follows every epoch, improved or not.

    Lightning 2.6 refreshes ``last.ckpt`` only when a top-k checkpoint was saved at the same step: with
    ``monitor=val/acc`` and ``save_top_k=1`` an epoch that does not improve leaves ``last.ckpt`` at the best
    epoch, and a resume after a kill would silently repeat the epochs since then. With
    ``check_val_every_n_epoch`` > 1 it saves only after validation, so ``last.ckpt`` fell up to N epochs
    behind: epochs that do not validate refresh it at their end.
    """

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer) or not _validates_this_epoch(trainer):
            self._refresh_last(trainer)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._refresh_last(trainer)

    def _refresh_last(self, trainer: L.Trainer) -> None:
        # Skipped when Lightning saved at this step already (then last.ckpt is fresh) or outside fitting.
        if not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


def _validates_this_epoch(trainer: L.Trainer) -> bool:
    # Lightning's own rule (the fit loop validates at the end of every N-th epoch); by train epoch end that
    # validation has already run, and on_validation_end refreshed last.ckpt.
    batches = trainer.num_val_batches
    if not (sum(batches) if isinstance(batches, list) else batches):
        return False  # no validation data (limit_val_batches=0): nothing runs on_validation_end
    every = trainer.check_val_every_n_epoch
    return every is None or (trainer.current_epoch + 1) % every == 0


class RNGStateCheckpoint(L.Callback):
    """Saves the global torch/CUDA/numpy/Python RNG states in each checkpoint and restores them on resume.

    The checkpoint is written by global rank 0 only, so every rank gets rank 0's state back. That is what
    they had anyway: ``seed_everything`` seeds all ranks alike and they draw the same numbers in step
    (equal-sized training shards), while the ``DistributedSampler`` shuffles from its own seed and epoch.
    (The cached loader's per-rank crops come from generators seeded by such shared draws:
    ``batch_augment.WithTrainViews``.)
    Stored as tensors and plain numbers so ``weights_only=True`` loading accepts it.
    """

    def state_dict(self) -> dict[str, Any]:
        _, keys, position, has_gauss, gauss = np.random.get_state()
        state = {
            "torch": torch.get_rng_state(),
            "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "python": list(random.getstate()),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()  # dropout on a GPU draws from the device's generator
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])
        numpy = state_dict["numpy"]
        np.random.set_state(("MT19937", numpy["keys"].numpy().astype(np.uint32), numpy["position"],
                             numpy["has_gauss"], numpy["gauss"]))
        version, state, gauss = state_dict["python"]
        random.setstate((version, tuple(state), gauss))


def newest_last_checkpoint(log_dir: str | os.PathLike, name: str) -> Path | None:
    """The most recently written ``<log_dir>/<name>/version_*/checkpoints/last.ckpt``, if any."""
    candidates = list(Path(log_dir, name).glob("version_*/checkpoints/last.ckpt"))
    return max(candidates, key=lambda p: p.stat().st_mtime_ns) if candidates else None


def run_folder_of(checkpoint: str | os.PathLike, log_dir: str | os.PathLike, name: str) -> str | None:
    """``version_N`` when ``checkpoint`` lies in ``<log_dir>/<name>/version_N/checkpoints/``, else None."""
    path = Path(checkpoint).resolve()
    runs = Path(log_dir, name).resolve()
    if path.parent.name == "checkpoints" and path.parent.parent.parent == runs:
        return path.parent.parent.name
    return None


def check_resumable(checkpoint: dict[str, Any], path: str, num_classes: int | None) -> None:
    """Refuse, in one sentence, a checkpoint that ``FlowerClassifier`` would reject with a shape dump."""
    state = checkpoint.get("state_dict")
    if not isinstance(state, dict) or HEAD_KEY not in state:
        raise ConfigError(
            f"--ckpt_path {path!r} is not a flowers checkpoint (it holds no FlowerClassifier weights). Use a "
            "last.ckpt or best-*.ckpt from runs/flowers/version_N/checkpoints/."
        )
    classes = state[HEAD_KEY].shape[0]
    if num_classes is not None and classes != num_classes:
        raise ConfigError(
            f"--ckpt_path {path!r} was trained for {classes} classes, but the data has {num_classes}. "
            "Point --data.data_dir at data with the checkpoint's classes, or train from scratch without --ckpt_path."
        )


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
        if self._resumes_into(log_dir):
            self.config_filename = _next_free(log_dir, "config-resume-{}.yaml")
        elif stage != "fit" and (log_dir / self.config_filename).exists():
            # validate/test/predict write no checkpoints; with --trainer.logger=false they all share one folder.
            name = getattr(stage, "value", stage)  # Lightning passes a TrainerFn, a str enum
            self.config_filename = _next_free(log_dir, f"config-{name}-{{}}.yaml")
        else:
            problem = _occupied(log_dir, trainer) if trainer.is_global_zero else None
            if problem := trainer.strategy.broadcast(problem):
                raise ConfigError(problem)
        super().setup(trainer, pl_module, stage)
        if trainer.is_global_zero:
            self._log_seed(trainer, log_dir)

    def _resumes_into(self, log_dir: Path) -> bool:
        return resumes_into(self.config.get("ckpt_path"), log_dir)

    def _log_seed(self, trainer: L.Trainer, log_dir: Path) -> None:
        # The seed LightningCLI used (drawn when seed_everything is true), next to the run's logs.
        seed = self.config.get("seed_everything")
        rank_zero_info(f"Seed: {seed} (seed_everything in {log_dir / self.config_filename})")
        for logger in trainer.loggers:
            logger.log_hyperparams({"seed_everything": seed})


def resumes_into(ckpt_path: str | None, log_dir: str | os.PathLike) -> bool:
    """Whether ``ckpt_path`` is a checkpoint of the run in ``log_dir`` (``log_dir/checkpoints/*.ckpt``)."""
    if not ckpt_path or not Path(ckpt_path).is_file():
        return False
    folder = Path(ckpt_path).resolve().parent
    return folder.name == "checkpoints" and folder.parent == Path(log_dir).resolve()


def refuse_occupied(log_dir: str | os.PathLike, trainer: L.Trainer) -> None:
    """The early form of ``RunFolderConfig``'s check, before the logger opens its event file there."""
    if problem := _occupied(Path(log_dir), trainer):
        raise ConfigError(problem)


def _occupied(log_dir: Path, trainer: L.Trainer) -> str | None:
    checkpoint = trainer.checkpoint_callback
    ckpt_dir = Path(checkpoint.dirpath) if checkpoint and checkpoint.dirpath else log_dir / "checkpoints"
    found = [p for p in (log_dir / "config.yaml",) if p.is_file()] + sorted(ckpt_dir.glob("*.ckpt"))
    if not found:
        return None
    return (
        f"{log_dir} already holds a run ({', '.join(str(p) for p in found[:3])}). A new run never writes over "
        "another's config or checkpoints: resume that run with --ckpt_path last (or its last.ckpt), or leave "
        "--trainer.logger.init_args.version and --checkpoint.dirpath unset to start a new version_N folder."
    )


def _next_free(folder: Path, pattern: str) -> str:
    index = 1
    while (folder / pattern.format(index)).exists():
        index += 1
    return pattern.format(index)
