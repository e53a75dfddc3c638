"""Checks of a parsed configuration that fail in one paragraph before any data is read, model built or file
written: a refused command leaves nothing behind."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from flowers.alexnet import MIN_IMAGE_SIZE
from flowers.budget import parse_budget
from flowers.errors import ConfigError
from flowers.files import can_create, special_kind

# Trainer counts checked here, by name: Lightning takes some without a word and refuses others late or without
# the flag's name. The lowest sensible value, what the setting counts and what to give instead.
TRAINER_MINIMUMS = {
    "max_epochs": (-1, "epochs to train", "1 or more, or -1 to train until --trainer.max_steps or max_time"),
    "min_epochs": (0, "epochs to train at least", "0 or more"),
    "max_steps": (-1, "optimizer steps to train", "1 or more, or -1 for no limit"),
    "min_steps": (0, "optimizer steps to train at least", "0 or more"),
    "accumulate_grad_batches": (1, "batches summed into one optimizer step", "1 or more"),
    "log_every_n_steps": (0, "steps between logged values", "1 or more (0 logs none)"),
    "check_val_every_n_epoch": (1, "epochs between validations", "1 or more, or null to validate by "
                                "--trainer.val_check_interval only"),
    "num_sanity_val_steps": (-1, "validation batches run before training", "0 or more, or -1 for all"),
    "num_nodes": (1, "machines", "1 or more"),
    "gradient_clip_val": (0, "the gradient size clipped to", "a number above 0, or 0 or null for no clipping"),
}


def check_devices(trainer) -> None:
    """``--trainer.devices`` asks for at least one device, and no more GPUs than this machine has."""
    accelerator, devices = trainer.get("accelerator"), trainer.get("devices")
    with_sign = str(devices).strip()
    if with_sign.lstrip("-").isdigit() and (int(with_sign) == 0 or int(with_sign) < -1):
        raise ConfigError(f"--trainer.devices={devices} is not a number of devices: use 1 or more, -1 for all of "
                          "them, or auto.")
    if accelerator not in ("gpu", "cuda"):
        return  # on CPU, devices are processes: any number runs (slowly), as the ddp tests do
    wanted = device_count(devices)
    available = torch.cuda.device_count()
    if wanted is None or wanted <= available:
        return  # "auto" and -1 take what there is; Lightning says so itself when that is nothing
    advice = (f"Use --trainer.devices={available} (or -1 for all of them)." if available else
              "No GPU is visible (drivers, CUDA_VISIBLE_DEVICES): use --trainer.accelerator=cpu.")
    raise ConfigError(f"--trainer.devices={devices} asks for {wanted} GPU(s), but this machine has {available}. "
                      + advice)


def device_count(devices) -> int | None:
    """How many devices ``--trainer.devices`` names: 2, "2", [0, 1] and "0,1" all name two; "auto"/-1 None."""
    if isinstance(devices, list | tuple):
        return len(devices)
    text = str(devices).strip()
    if "," in text:
        return len([d for d in text.split(",") if d.strip()])
    if text.isdigit():
        return int(text)
    return None


def check_image_sizes(data) -> None:
    """The network's poolings need a side of at least ``MIN_IMAGE_SIZE`` in training and evaluation."""
    for name in ("image_size", "eval_image_size", "start_image_size"):
        size = data.get(name)
        if size is not None and size < MIN_IMAGE_SIZE:
            raise ConfigError(
                f"data.{name}={size} is too small for AlexNet's poolings; use at least {MIN_IMAGE_SIZE}."
            )


def check_trainer(trainer, *, new_fit: bool, ddp_timeout: float | None = None) -> None:
    """The trainer's counts are possible, and a new fit trains something: ``max_epochs=0`` would end at once with
    an empty run folder. (A resume with ``max_epochs`` already reached is Lightning's to report, and does.)"""
    if ddp_timeout is not None and not 0 < ddp_timeout < math.inf:
        raise ConfigError(f"--ddp_timeout={ddp_timeout} is not a number of seconds to wait for the other ddp "
                          "processes: use a number above 0 (the default is 600).")
    for name, (lowest, counts, advice) in TRAINER_MINIMUMS.items():
        value = trainer.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and not value >= lowest:
            raise ConfigError(f"--trainer.{name}={value} is not a number of {counts}: use {advice}.")
    interval = trainer.get("val_check_interval")
    if isinstance(interval, int | float) and not isinstance(interval, bool) and not interval > 0:
        raise ConfigError(f"--trainer.val_check_interval={interval} never validates: use a fraction of an epoch "
                          "(0.25), a number of batches (100) or a time (00:00:10:00).")
    if new_fit and trainer.get("max_epochs") == 0:
        raise ConfigError("--trainer.max_epochs=0 trains nothing, so no run was started: use 1 or more (to resume "
                          "a run, pass --ckpt_path).")


def check_budget(budget: str, trainer) -> None:
    """A budget is a duration and the one limit of the run's length: it sets max_epochs; max_steps or max_time
    would cut its schedule short."""
    parse_budget(budget)
    for name in ("max_steps", "max_time"):
        if trainer.get(name) not in (None, -1):
            raise ConfigError(f"--budget {budget} and --trainer.{name}={trainer.get(name)} both limit the run: the "
                              f"budget sets the number of epochs that fit its time. Unset --trainer.{name}.")


def check_regular_file(path: str | Path, flag: str, wanted: str) -> None:
    """``path`` is an existing regular file: a FIFO would block the reader forever, a folder fail deep in it."""
    if not Path(path).exists():
        raise ConfigError(f"{flag} {str(path)!r} does not exist: pass {wanted}.")
    if kind := special_kind(path):
        raise ConfigError(f"{flag} {str(path)!r} is {kind}, not a file: pass {wanted}.")


def check_writable(folders: list[Path]) -> None:
    """The run's folders take files now, not after the data is read and a model is built; none is made here."""
    for folder in folders:
        if not can_create(folder):
            raise ConfigError(
                f"The output folder {str(folder)!r} cannot be written. Fix its permissions, or write elsewhere "
                "with --trainer.logger.init_args.save_dir (and --checkpoint.dirpath if set)."
            )
