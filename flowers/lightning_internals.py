"""The only place flowers touches Lightning's private attributes, for what its public API does not offer.

``tests/test_lightning_internals.py`` checks each of these against the installed Lightning, so an upgrade
that moves one fails there, by name, instead of somewhere deep in a run.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler

# The keys LightningCLI adds to a checkpoint's hyper_parameters so that load_from_checkpoint rebuilds the model
# through jsonargparse, and the instantiator it names.
INSTANTIATOR_KEY = "_instantiator"
CLASS_PATH_KEY = "_class_path"
LIGHTNING_INSTANTIATOR = "lightning.pytorch.cli.instantiate_module"


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


def epoch_progress(trainer: L.Trainer) -> tuple[int, int]:
    """(batches of this epoch the training loop has finished, batches in the epoch): where a checkpoint saved
    now stands, for the parts of it that must know (the training loader's position, the epoch's metrics)."""
    return trainer.fit_loop.epoch_loop.batch_progress.current.processed, trainer.num_training_batches


def each_once_sampler(dataset, *, num_replicas: int, rank: int):
    """Lightning's evaluation sampler that gives each of ``num_replicas`` ranks images r, r + world, …: every
    image exactly once, where torch's DistributedSampler pads the last shard with repeats."""
    return UnrepeatedDistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
