"""A sweep's fit settings, checked by fit's own parser before any trial starts, and written as one config."""

from __future__ import annotations

from typing import Any

from flowers.cli import parse_fit
from flowers.errors import ConfigError
from flowers.sweep.spec import Sweep, as_flag
from flowers.sweep.study import placement


def check(sweep: Sweep) -> None:
    """Every fit config and flag of the sweep, and every setting at both ends of its range (each of its choices),
    as fit parses them: what fit would refuse is a ConfigError that names it."""
    base = sweep.fit_words({})
    try:
        parse_fit(base + placement(sweep, 0))
    except ConfigError as error:
        raise ConfigError(f"{sweep.file}: fit refuses its configs or flags: {error}") from None
    for param in sweep.space:
        for value in param.corners():
            try:
                parse_fit(base + [f"--{param.flag}={as_flag(value)}"])
            except ConfigError as error:
                raise ConfigError(f"{sweep.file}: space.{param.flag} at {value!r}: fit refuses it: {error}") from None
    for values in sweep.enqueue:
        try:
            parse_fit(sweep.fit_words(values))
        except ConfigError as error:
            raise ConfigError(f"{sweep.file}: enqueue {values}: fit refuses it: {error}") from None


def fit_config(sweep: Sweep, values: dict[str, Any]) -> str:
    """The whole fit config, as YAML, of a trial with these values: what `flowers fit --config` runs as it ran."""
    parser, config = parse_fit(sweep.fit_words(values))
    config.pop("config", None)  # the files it came from: their settings are all written out here
    return parser.dump(config)
