"""A checkpoint in, a model ready to predict out, with everything its answers depend on: the classes, the side it
evaluates at, its normalisation and whether it averages each image with its mirror image.

``predict``, ``validate`` and ``test`` (through the CLI's defaults), ``flowers.analysis``, ``flowers serve`` and
``flowers export`` all take these from the checkpoint, so they answer alike unless a flag says otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from flowers.backbones import TUTORIAL_ALEXNET
from flowers.checkpoint_reader import read
from flowers.data.transforms import eval_transform
from flowers.errors import ConfigError
from flowers.module import FlowerClassifier, normalisation_of
from flowers.runs import CONFIG, LOG_DIR, NAME, newest_best_checkpoint, newest_last_checkpoint, run_dir_of

ALIASES = ("best", "last")  # the newest run's best-*.ckpt and last.ckpt, for every command that takes a checkpoint
DEFAULT_IMAGE_SIZE = 224  # the tutorial's side, for a checkpoint that records none and has no run folder beside it


@dataclass
class ReadyModel:
    """A checkpoint's model in eval mode, with the settings its predictions depend on."""

    model: FlowerClassifier
    path: Path
    hparams: dict[str, Any]  # the checkpoint's settings, as data
    epoch: int | None = None  # where in its run the checkpoint was saved
    global_step: int | None = None

    @property
    def classes(self) -> list[str]:
        return list(self.model.class_names)

    @property
    def image_size(self) -> int:
        return int(self.model.hparams.eval_image_size)

    @property
    def eval_hflip(self) -> bool:
        return bool(self.model.eval_hflip)

    def transform(self, image_size: int | None = None) -> Callable:
        """The evaluation transform: squashed to the run's side (or ``image_size``), normalised as in training."""
        return eval_transform_of(self.model, image_size)


def eval_transform_of(model: FlowerClassifier, image_size: int | None = None) -> Callable:
    """The evaluation transform a model was trained for: its normalisation, squashed to ``image_size``; unset, the
    side its run evaluated at (else the tutorial's 224)."""
    mean, std = model.normalisation()
    size = image_size or model.hparams.get("eval_image_size") or DEFAULT_IMAGE_SIZE
    return eval_transform(crop_size=size, mean=mean, std=std)


def resolve(ckpt: str | Path, flag: str = "--ckpt_path", *, save_dir: str = LOG_DIR, name: str = NAME) -> Path:
    """``ckpt`` as a path: ``best`` and ``last`` (when no such file is here) name the newest run's checkpoints."""
    if str(ckpt) not in ALIASES or Path(ckpt).exists():
        return Path(ckpt)
    if str(ckpt) == "last":
        found = newest_last_checkpoint(save_dir, name)
    else:
        try:
            found = newest_best_checkpoint(Path(save_dir, name))
        except FileNotFoundError:
            found = None
    if found is None:
        raise ConfigError(f"{flag} {ckpt}: no {save_dir}/{name}/version_*/checkpoints/ holds a "
                          f"{'last.ckpt' if ckpt == 'last' else 'checkpoint'} here. Run in the folder that holds "
                          f"{save_dir}/, train one with `flowers fit` (or `make train`), or pass a checkpoint file.")
    return found


def eval_image_size(hparams: dict[str, Any], path: str | Path) -> int:
    """The side a checkpoint's run evaluated at: recorded in the checkpoint, else in its run's config.yaml
    (checkpoints from before it was recorded), else the tutorial's 224."""
    if hparams.get("eval_image_size"):
        return int(hparams["eval_image_size"])
    return run_settings(read_run_config(run_dir_of(path) / CONFIG))["eval_image_size"]


def read_run_config(path: Path) -> dict:
    """A run's config.yaml as a dict; ``{}`` when there is none or it cannot be read as one."""
    try:
        config = yaml.safe_load(path.read_text()) if path.is_file() else {}
    except (OSError, yaml.YAMLError):
        return {}
    return config if isinstance(config, dict) else {}


def run_settings(config: dict) -> dict[str, Any]:
    """How a run's config.yaml says its model is evaluated, for a file that records none of it (an export, an older
    checkpoint): ``eval_image_size``, ``mean``, ``std``, ``eval_hflip`` and ``backbone``."""
    data = config.get("data") if isinstance(config.get("data"), dict) else {}
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    model = model.get("init_args", model) if isinstance(model.get("init_args", model), dict) else {}
    size = data.get("eval_image_size") or data.get("image_size")
    # The data's normalisation is what the run applied (the CLI records it there); the model's, from older configs.
    mean, std = normalisation_of(data if data.get("mean") and data.get("std") else model)
    return {"eval_image_size": int(size) if isinstance(size, int) and size > 0 else DEFAULT_IMAGE_SIZE,
            "mean": mean, "std": std, "eval_hflip": bool(model.get("eval_hflip", False)),
            "backbone": str(model.get("backbone") or TUTORIAL_ALEXNET)}


def load(ckpt: str | Path, *, map_location: str = "cpu", flag: str = "--ckpt_path") -> ReadyModel:
    """The model of ``ckpt`` (a path, ``best`` or ``last``) in eval mode. The file is read as untrusted data
    (flowers.checkpoint_reader) and only the network is built from it: never its optimizer or scheduler."""
    path = resolve(ckpt, flag)
    checkpoint = read(path, flag, model_class=FlowerClassifier)
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    settings = {key: value for key, value in hparams.items() if not key.startswith("_")}
    settings.update(optimizer=None, scheduler=None, compile=False, eval_image_size=eval_image_size(hparams, path))
    try:
        model = FlowerClassifier(**settings)
        model.load_state_dict(checkpoint["state_dict"])
    except ConfigError:
        raise
    except (TypeError, ValueError, RuntimeError, KeyError) as error:
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise ConfigError(f"{flag} {str(path)!r} holds settings or weights that do not make a model ({first_line}). "
                          "Use a last.ckpt or best-*.ckpt written by `flowers fit`.") from None
    model._restored = True  # the checkpoint's network: --model.weights and init_from are never read
    model.to(map_location).eval()
    return ReadyModel(model=model, path=path, hparams={**{k: v for k, v in hparams.items() if not k.startswith("_")},
                                                       "eval_image_size": settings["eval_image_size"]},
                      epoch=checkpoint.get("epoch"), global_step=checkpoint.get("global_step"))
