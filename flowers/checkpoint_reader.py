"""Reading a checkpoint as untrusted data: one reader for every command and API that opens one.

``torch.load(weights_only=True)`` stops pickled code, but a checkpoint's ``hyper_parameters`` are plain dicts and
strings that LightningCLI hands to jsonargparse, which builds whatever ``class_path`` it meets, at any depth. So
before anything is parsed or built, the settings are checked as data:

- every key is an argument of the model class (plus the instantiator LightningCLI records);
- a ``class_path`` may stand only where the model takes a callable (``optimizer``, ``scheduler``), and must name a
  torch optimizer, a torch learning-rate scheduler or a flowers schedule;
- the arguments given to that class are its own, and those it would take as code (a callable, an object) are null;
- everything else is a number, a string, a list or a mapping of them.

Anything else is refused with one sentence naming the key and what it holds.
"""

from __future__ import annotations

import functools
import inspect
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from flowers import backbones
from flowers.errors import ConfigError
from flowers.lightning_internals import CLASS_PATH_KEY, INSTANTIATOR_KEY, LIGHTNING_INSTANTIATOR
from flowers.runs import CHECKPOINTS, LOG_DIR, NAME
from flowers.schedules import WarmupCosineLR

_PLAIN = (type(None), bool, int, float, str)
# An annotation made of these words only takes data; any other word (Callable, Optimizer, Any, ...) takes code.
_DATA_WORDS = {"float", "int", "bool", "str", "None", "NoneType", "Tensor", "tuple", "Tuple", "list", "List",
               "Sequence", "Iterable", "Union", "Optional", "Literal", "typing", "torch", "collections", "abc",
               "builtins", "class", "SupportsFloat"}


@functools.cache
def allowed_classes() -> dict[str, type]:
    """The classes a checkpoint may name, by every path jsonargparse writes them under."""
    from torch.optim import Optimizer, lr_scheduler

    found: dict[str, type] = {}
    for module, base in ((torch.optim, Optimizer), (lr_scheduler, (lr_scheduler.LRScheduler,
                                                                    lr_scheduler.ReduceLROnPlateau))):
        for name, value in vars(module).items():
            if isinstance(value, type) and issubclass(value, base) and not name.startswith("_") \
                    and value not in (Optimizer, lr_scheduler.LRScheduler):
                found[f"{module.__name__}.{name}"] = value
                found[f"{value.__module__}.{value.__name__}"] = value
    # The schedule's home before it had a module of its own: older checkpoints and configs name it so.
    for path in ("flowers.schedules.WarmupCosineLR", "flowers.module.WarmupCosineLR"):
        found[path] = WarmupCosineLR
    return found


def read(path: str | Path, flag: str = "--ckpt_path", *, model_class: type) -> dict[str, Any]:
    """The checkpoint at ``path``, loaded without running any of its code and with its settings checked as
    data against ``model_class``. Raises ConfigError, in one sentence that names ``flag`` and the file."""
    path = Path(path)
    where = f"{flag} {str(path)!r}"
    if not path.exists():
        raise ConfigError(f"{where} does not exist. Checkpoints are under {LOG_DIR}/{NAME}/version_N/{CHECKPOINTS}/ "
                          "(best-*.ckpt and last.ckpt); best and last name the newest run's.")
    if not path.is_file():
        raise ConfigError(f"{where} is not a regular file (a folder, FIFO or device): pass a checkpoint file (.ckpt).")
    if path.stat().st_size == 0:
        raise ConfigError(f"{where} is empty (0 bytes), as an interrupted copy leaves it: use another checkpoint, "
                          "e.g. the run's last.ckpt or best-*.ckpt.")
    try:
        # mmap: a 170 MB last.ckpt costs page-ins of the few tensors read, not a copy.
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        raise ConfigError(f"{where} holds Python objects beyond tensors and plain data, which could run code when "
                          "loaded, so flowers refused it. flowers never writes such a file: do not open it with "
                          "weights_only=False unless you trust where it came from.") from None
    except Exception as error:  # a truncated or foreign file surfaces as one of many torch.load errors
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise ConfigError(f"{where} cannot be read as a checkpoint: it is truncated or no checkpoint at all "
                          f"({first_line}). Use another checkpoint, e.g. the run's last.ckpt.") from None
    if not isinstance(checkpoint, dict):
        raise ConfigError(f"{where} is not a flowers checkpoint (it holds a {type(checkpoint).__name__}, not a "
                          "checkpoint's mapping). Use a last.ckpt or best-*.ckpt written by `flowers fit`.")
    check_hyper_parameters(checkpoint.get("hyper_parameters"), model_class, where)
    check_resumable(checkpoint, str(path), None, flag)
    return checkpoint


def check_hyper_parameters(hparams: Any, model_class: type, where: str) -> None:
    """Refuse settings that are not plain data for ``model_class``: see the module's docstring."""
    if hparams is None:
        return
    if not isinstance(hparams, dict) or not all(isinstance(key, str) for key in hparams):
        _refuse(where, "hyper_parameters", "is not a mapping of setting names")
    arguments = inspect.signature(model_class).parameters
    own_path = f"{model_class.__module__}.{model_class.__qualname__}"
    for key, value in hparams.items():
        if key == INSTANTIATOR_KEY:
            if value != LIGHTNING_INSTANTIATOR:
                _refuse(where, key, f"names {value!r}, not LightningCLI's {LIGHTNING_INSTANTIATOR}")
        elif key == CLASS_PATH_KEY:
            if value != own_path:
                _refuse(where, key, f"names the class {value!r}, not {own_path}")
        elif key not in arguments or arguments[key].kind in (inspect.Parameter.VAR_POSITIONAL,
                                                               inspect.Parameter.VAR_KEYWORD):
            _refuse(where, key, f"is not a setting of {model_class.__name__}")
        elif _takes_code(arguments[key]) and value is not None:
            _check_class(value, key, where)
        else:
            _check_data(value, key, where)


def _check_class(value: Any, key: str, where: str) -> None:
    name = value.get("class_path") if isinstance(value, dict) else None
    cls = allowed_classes().get(name) if isinstance(name, str) else None
    if cls is None:
        shown = f"the class {name!r}" if name is not None else repr(value)[:80]
        _refuse(where, key, f"names {shown}; from a checkpoint flowers builds only torch.optim optimizers, "
                            "torch.optim.lr_scheduler schedulers and flowers.schedules")
    if extra := sorted(set(value) - {"class_path", "init_args"}):
        _refuse(where, f"{key}.{extra[0]}", f"is not allowed beside class_path {name}")
    init_args = value.get("init_args") or {}
    if not isinstance(init_args, dict):
        _refuse(where, f"{key}.init_args", "is not a mapping of argument names")
    arguments = inspect.signature(cls).parameters
    for argument, given in init_args.items():
        path = f"{key}.init_args.{argument}"
        parameter = arguments.get(argument) if isinstance(argument, str) else None
        if parameter is None or parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            _refuse(where, path, f"is not an argument of {name}")
        if _takes_code(parameter) and given is not None:
            _refuse(where, path, f"must be null: {name} would take it as a callable or an object, and a "
                                 "checkpoint passes none")
        _check_data(given, path, where)


def _check_data(value: Any, key: str, where: str) -> None:
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check_data(item, f"{key}[{index}]", where)
        return
    if isinstance(value, dict):
        if "class_path" in value or CLASS_PATH_KEY in value:
            _refuse(where, key, f"names the class {value.get('class_path', value.get(CLASS_PATH_KEY))!r} where "
                                "a setting is plain data")
        for name, item in value.items():
            if not isinstance(name, str):
                _refuse(where, key, "is a mapping with a key that is not a string")
            _check_data(item, f"{key}.{name}", where)
        return
    _refuse(where, key, f"holds a {type(value).__name__}, where a setting is a number, a string, a list or a mapping")


@functools.cache
def _annotation_words(annotation: str) -> frozenset[str]:
    without_literals = re.sub(r"'[^']*'|\"[^\"]*\"", "", annotation)
    return frozenset(re.findall(r"[A-Za-z_]+", without_literals))


def _takes_code(parameter: inspect.Parameter) -> bool:
    """Whether jsonargparse could turn a value for ``parameter`` into a callable or an object: any annotation
    beyond numbers, strings, booleans and their containers, or none at all."""
    annotation = parameter.annotation
    if annotation is inspect.Parameter.empty:
        return True
    text = annotation if isinstance(annotation, str) else str(annotation) if not isinstance(annotation, type) \
        else annotation.__name__
    return not _annotation_words(text) <= _DATA_WORDS


def _refuse(where: str, key: str, why: str) -> None:
    raise ConfigError(f"{where} is refused: its hyper_parameters key {key!r} {why}. A checkpoint's settings are "
                      "data, never code; this file was not written by `flowers fit` as it is. Use a checkpoint from "
                      "a source you trust.")


def check_resumable(checkpoint: dict[str, Any], path: str, num_classes: int | None, flag: str = "--ckpt_path") -> None:
    """Refuse, in one sentence, a checkpoint that ``FlowerClassifier`` would reject with a shape dump."""
    state = checkpoint.get("state_dict")
    hparams = checkpoint.get("hyper_parameters") or {}
    backbone = hparams.get("backbone", backbones.TUTORIAL_ALEXNET) if isinstance(hparams, dict) else None
    head = f"net.{backbones.head_key(backbone)}" if backbone in backbones.names() else None
    if not isinstance(state, dict) or head not in state:
        raise ConfigError(
            f"{flag} {path!r} is not a flowers checkpoint (it holds no FlowerClassifier weights). Use a "
            "last.ckpt or best-*.ckpt from runs/flowers/version_N/checkpoints/."
        )
    classes = state[head].shape[0]
    if num_classes is not None and classes != num_classes:
        raise ConfigError(
            f"{flag} {path!r} was trained for {classes} classes, but the data has {num_classes}. "
            "Point --data.data_dir at data with the checkpoint's classes, or train from scratch without --ckpt_path."
        )
