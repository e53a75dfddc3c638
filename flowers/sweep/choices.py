"""The Optuna sampler and pruner a sweep file names, with the options it gives them."""

from __future__ import annotations

import optuna

from flowers.errors import ConfigError


def make_sampler(settings: dict) -> optuna.samplers.BaseSampler:
    options = {key: value for key, value in settings.items() if key != "name"}
    if settings["name"] == "tpe":
        # Several workers ask while others run: the constant liar keeps them from all trying one spot.
        options.setdefault("constant_liar", True)
    kind = {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler}[settings["name"]]
    return _made(kind, options, "sampler")


def make_pruner(settings: dict) -> optuna.pruners.BasePruner:
    options = {key: value for key, value in settings.items() if key != "name"}
    kind = {"median": optuna.pruners.MedianPruner, "hyperband": optuna.pruners.HyperbandPruner,
            "none": optuna.pruners.NopPruner}[settings["name"]]
    return _made(kind, options, "pruner")


def _made(kind, options: dict, what: str):
    try:
        return kind(**options)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"the sweep's {what} {kind.__name__} refuses {options}: {error}.") from None
