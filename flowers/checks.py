"""Checks of a parsed configuration that fail in one paragraph before any data is read or model built."""

from __future__ import annotations

from pathlib import Path

import torch

from flowers.errors import ConfigError
from flowers.files import is_writable
from flowers.model import MIN_IMAGE_SIZE


def check_devices(trainer) -> None:
    """``--trainer.devices`` asks for no more GPUs than this machine has."""
    accelerator, devices = trainer.get("accelerator"), trainer.get("devices")
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


def check_writable(folders: list[Path]) -> None:
    """The run's folders take files now, not after the data is read and a model is built."""
    for folder in folders:
        if not is_writable(folder):
            raise ConfigError(
                f"The output folder {str(folder)!r} cannot be written. Fix its permissions, or write elsewhere "
                "with --trainer.logger.init_args.save_dir (and --checkpoint.dirpath if set)."
            )
