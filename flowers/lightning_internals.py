"""The only place flowers touches Lightning's private attributes, for what its public API does not offer.

``tests/test_lightning_internals.py`` checks each of these against the installed Lightning, so an upgrade
that moves one fails there, by name, instead of somewhere deep in a run.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger


def set_logger_version(logger: TensorBoardLogger, version: int | str) -> None:
    """Make ``logger`` write to ``version``: TensorBoardLogger takes a version only in its constructor."""
    logger._version = version


def logged_step(trainer: L.Trainer) -> int:
    """The step Lightning's logger connector gives the scalars logged now (``val/acc`` at validation's end),
    so images logged beside them line up on TensorBoard's step axis."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def subcommand_defaults(cli, subcommand: str):
    """The defaults of a LightningCLI subcommand's parser (its config files included), as a Namespace."""
    return cli._parser(subcommand).get_defaults()
