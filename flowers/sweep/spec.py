"""A sweep file, read and checked: the fit configs each trial starts from, the search space, the metric, the study.
docs/sweeps.md describes each entry; flowers.sweep.check checks the fit settings with fit's own parser.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from flowers.errors import ConfigError

KEYS = {"fit", "args", "space", "metric", "direction", "trials", "sampler", "pruner", "storage", "enqueue",
        "heartbeat_s", "name"}
SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "hyperband", "none")
PRUNED_AT = "pruned_at_epoch"  # the user attribute of a trial its pruner stopped


@dataclass(frozen=True)
class Param:
    """One search-space entry: a float or int range (``low``..``high``, ``log`` or ``step``) or ``choices``."""

    flag: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple[Any, ...] = ()

    @property
    def is_int(self) -> bool:
        return not self.choices and all(isinstance(v, int) for v in (self.low, self.high, self.step or 1))

    def suggest(self, trial) -> Any:
        """The value ``trial`` takes for this setting (Optuna's own for a trial enqueued or retried)."""
        if self.choices:
            # Optuna stores choices as scalars: a list such as a crop scale travels as its JSON text.
            return self.value_of(trial.suggest_categorical(self.flag, [stored_choice(c) for c in self.choices]))
        if self.is_int:
            return trial.suggest_int(self.flag, self.low, self.high, step=self.step or 1, log=self.log)
        return trial.suggest_float(self.flag, float(self.low), float(self.high), step=self.step, log=self.log)

    def value_of(self, stored: Any) -> Any:
        """The setting's value from what Optuna stored for it."""
        if self.choices:
            return self.choices[[stored_choice(choice) for choice in self.choices].index(stored)]
        return stored

    def corners(self) -> list[Any]:
        """Values that stand for the whole range when the fit parser checks it: both ends, or every choice."""
        return list(self.choices) if self.choices else [self.low, self.high]


@dataclass(frozen=True)
class Sweep:
    name: str
    file: Path
    fit: tuple[str, ...]
    args: tuple[str, ...]
    space: tuple[Param, ...]
    metric: str = "val/acc"
    direction: str = "maximize"
    trials: int = 20
    sampler: dict = field(default_factory=lambda: {"name": "tpe"})
    pruner: dict = field(default_factory=lambda: {"name": "median"})
    storage: str | None = None
    enqueue: tuple[dict, ...] = ()
    heartbeat_s: int = 30  # how often a running trial says it is alive; silent for 3 x this, it is retried

    @property
    def folder(self) -> Path:
        return Path("runs") / "sweeps" / self.name

    def fit_words(self, values: dict[str, Any]) -> list[str]:
        """The fit command line, less ``fit``, of a trial with these values of the search space."""
        words = [word for config in self.fit for word in ("--config", config)] + list(self.args)
        return words + [f"--{flag}={as_flag(value)}" for flag, value in values.items()]

    def identity(self) -> dict:
        """What every process joining one study must agree on."""
        space = {p.flag: {"low": p.low, "high": p.high, "log": p.log, "step": p.step, "choices": list(p.choices)}
                 for p in self.space}
        return {"space": space, "metric": self.metric, "direction": self.direction}


def as_flag(value: Any) -> str:
    """A value as the fit command line takes it: lists and None as JSON/YAML, the rest as text."""
    if isinstance(value, list | tuple | dict) or value is None or isinstance(value, bool):
        return json.dumps(value)
    return str(value)


def stored_choice(choice: Any) -> Any:
    return choice if choice is None or isinstance(choice, str | int | float | bool) else json.dumps(choice)


def read(path: str | Path, *, extra_args: list[str] | None = None) -> Sweep:
    """The sweep in ``path``; a ConfigError that names the file and the entry for anything wrong in it."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"the sweep file {path} does not exist. configs/sweeps/ has examples.") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise ConfigError(f"cannot read the sweep file {path}: {' '.join(str(error).split())}") from None
    where = f"{path}:"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} a sweep file is a mapping with fit, space, metric and trials; configs/sweeps/ "
                          "has examples.")
    if unknown := sorted(set(raw) - KEYS):
        raise ConfigError(f"{where} unknown entries {', '.join(map(repr, unknown))}: a sweep file takes "
                          f"{', '.join(sorted(KEYS))}.")
    fit = _strings(raw.get("fit"), f"{where} fit", required=True)
    for config in fit:
        if not Path(config).is_file():
            raise ConfigError(f"{where} fit names {config}, which is not a file (paths are from the folder the "
                              "sweep runs in, as for `flowers fit --config`).")
    args = _strings(raw.get("args"), f"{where} args") + tuple(extra_args or ())
    for word in args:
        if not word.startswith("--") or "=" not in word:
            raise ConfigError(f"{where} {word!r} is not a fit flag: write each as --name=value.")
    space = _space(raw.get("space"), where)
    metric = raw.get("metric", "val/acc")
    if not isinstance(metric, str) or not metric:
        raise ConfigError(f"{where} metric is the name of a logged value, e.g. val/acc.")
    direction = raw.get("direction", "maximize")
    if direction not in ("maximize", "minimize"):
        raise ConfigError(f"{where} direction is maximize or minimize, not {direction!r}.")
    trials = raw.get("trials", 20)
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ConfigError(f"{where} trials is a whole number of at least 1, not {trials!r}.")
    heartbeat = raw.get("heartbeat_s", 30)
    if isinstance(heartbeat, bool) or not isinstance(heartbeat, int) or heartbeat < 1:
        raise ConfigError(f"{where} heartbeat_s is a whole number of seconds, at least 1, not {heartbeat!r}.")
    storage = raw.get("storage")
    if storage is not None and (not isinstance(storage, str) or "://" not in storage):
        raise ConfigError(f"{where} storage is a database URL such as postgresql://user@host/db, not {storage!r}.")
    name = raw.get("name", path.stem)
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise ConfigError(f"{where} name is a folder name under runs/sweeps/, not {name!r}.")
    return Sweep(name=name, file=path, fit=fit, args=args, space=space, metric=metric, direction=direction,
                 trials=trials, sampler=_named(raw.get("sampler", "tpe"), SAMPLERS, f"{where} sampler"),
                 pruner=_named(raw.get("pruner", "median"), PRUNERS, f"{where} pruner"), storage=storage,
                 enqueue=_enqueue(raw.get("enqueue"), space, where), heartbeat_s=heartbeat)


def _strings(value, where: str, *, required: bool = False) -> tuple[str, ...]:
    if value is None and not required:
        return ()
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not value and required or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where} is a list of {'paths' if 'fit' in where else 'flags'}" +
                          (", at least one." if required else "."))
    return tuple(value)


def _space(raw, where: str) -> tuple[Param, ...]:
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{where} space is empty: name at least one fit flag with a range (low, high) or choices, "
                          "e.g. model.optimizer.init_args.lr: {low: 0.0001, high: 0.01, log: true}.")
    return tuple(_param(str(flag).removeprefix("--"), entry, where) for flag, entry in raw.items())


def _param(flag: str, entry, where: str) -> Param:
    at = f"{where} space.{flag}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{at} is a mapping: {{low: …, high: …}} or {{choices: [...]}}.")
    if unknown := sorted(set(entry) - {"low", "high", "log", "step", "choices"}):
        raise ConfigError(f"{at}: unknown {', '.join(unknown)}; a range takes low, high, log and step, a set choices.")
    if "choices" in entry:
        choices = entry["choices"]
        if set(entry) != {"choices"} or not isinstance(choices, list) or not choices:
            raise ConfigError(f"{at}: choices is a non-empty list, alone.")
        if len({json.dumps(c, sort_keys=True) for c in choices}) != len(choices):
            raise ConfigError(f"{at}: the choices repeat a value.")
        return Param(flag, choices=tuple(choices))
    low, high = (_number(entry.get(key), f"{at}.{key}") for key in ("low", "high"))
    log, step = entry.get("log", False), _number(entry.get("step"), f"{at}.step", optional=True)
    if not isinstance(log, bool):
        raise ConfigError(f"{at}.log is true or false.")
    if not low < high:
        raise ConfigError(f"{at}: low ({low}) must be below high ({high}).")
    if log and low <= 0:
        raise ConfigError(f"{at}: a log range needs low above 0 (it is {low}).")
    if log and step is not None:
        raise ConfigError(f"{at}: a range is log or stepped, not both.")
    if step is not None and not 0 < step <= high - low:
        raise ConfigError(f"{at}.step must be above 0 and at most high - low ({high - low}).")
    return Param(flag, low=low, high=high, log=log, step=step)


def _number(value, at: str, *, optional: bool = False):
    if value is None and optional:
        return None
    if isinstance(value, str):  # YAML reads 1e-4 (no dot) as text
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{at} must be a number, not {value!r}.")
    return value


def _named(value, known: tuple[str, ...], where: str) -> dict:
    settings = {"name": value} if isinstance(value, str) else dict(value) if isinstance(value, dict) else None
    if settings is None or settings.get("name") not in known:
        raise ConfigError(f"{where} is one of {', '.join(known)}, or a mapping with name: and the options of its "
                          f"Optuna class; not {value!r}.")
    return settings


def _enqueue(raw, space: tuple[Param, ...], where: str) -> tuple[dict, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(entry, dict) for entry in raw):
        raise ConfigError(f"{where} enqueue is a list of mappings from space flags to values.")
    params = {p.flag: p for p in space}
    for entry in raw:
        if unknown := sorted(set(entry) - set(params)):
            raise ConfigError(f"{where} enqueue sets {', '.join(unknown)}, which the space does not name.")
        for flag, value in entry.items():
            if params[flag].choices and value not in params[flag].choices:
                raise ConfigError(f"{where} enqueue sets {flag} to {value!r}, which is not one of its choices.")
    return tuple(raw)
