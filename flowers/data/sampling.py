"""The training loader's order and randomness as a function of (seed, epoch, position), so a run can stop
anywhere in an epoch and resume at the next batch exactly.

Each epoch has its own generator, from the run's seed and the epoch number. It draws the epoch's
permutation (shared by the ddp ranks, each taking every ``world_size``-th position, as torch's
DistributedSampler does) and one seed per position. An item's augmentation draws from its own seed
(``item_rng``), not from a loader worker's generator, so the draws depend on neither the number of
workers nor how far they had read ahead, and no state but (seed, epoch, batches done) is needed to resume.
The training process's own generator (dropout, batch mixing) is untouched by the loader and saved by
``flowers.rng_state.RNGStateCheckpoint``.

Lightning saves and restores a loader that has ``state_dict``/``load_state_dict`` with the fit loop's
state, and keeps a DistributedSampler as it is (calling ``set_epoch`` each epoch).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

SEED_RANGE = 2**62


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    mixed = np.random.SeedSequence([seed, epoch]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(mixed))


def run_seed() -> int:
    # seed_everything's seed, which every ddp rank shares; the CLI always sets one. 0 is torch's
    # DistributedSampler default, for a loader built outside a seeded run.
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


@contextlib.contextmanager
def item_rng(seed: int) -> Iterator[None]:
    """torch's global generator seeded with ``seed`` inside, as it was outside: the transforms (torchvision's
    random crops, flips, TrivialAugment) draw from the global generator."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class EpochSampler(DistributedSampler):
    """Yields ``(index, seed)`` for this rank's positions of the epoch, from ``skip_batches`` batches in on
    the first pass after a mid-epoch resume. Args as DistributedSampler's, plus the loader's ``batch_size``
    and ``weights``: each item's chance of being drawn, with replacement, at each position of an epoch
    (torch's WeightedRandomSampler, made resumable and shared by the ranks); unset, a permutation."""

    def __init__(self, dataset: Dataset, *, batch_size: int, num_replicas: int = 1, rank: int = 0,
                 seed: int | None = None, shuffle: bool = True, weights: Sequence[float] | None = None) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=run_seed() if seed is None else seed)
        self.batch_size = batch_size
        self.weights = None if weights is None else torch.as_tensor(weights, dtype=torch.double)
        self.skip_batches = 0  # set by load_state_dict: batches of this epoch already trained

    def __iter__(self) -> Iterator[tuple[int, int]]:
        generator = epoch_generator(self.seed, self.epoch)
        n = len(self.dataset)
        if self.weights is not None:
            order = torch.multinomial(self.weights, n, replacement=True, generator=generator)
        else:
            order = torch.randperm(n, generator=generator) if self.shuffle else torch.arange(n)
        seeds = torch.randint(0, SEED_RANGE, (self.total_size,), generator=generator)
        if self.total_size > n:  # padded with the order's start, so every rank has as many batches
            order = order.repeat(-(-self.total_size // n))[: self.total_size]
        start = self.rank + self.skip_batches * self.batch_size * self.num_replicas
        self.skip_batches = 0
        for position in range(start, self.total_size, self.num_replicas):
            yield int(order[position]), int(seeds[position])

    def state_dict(self, batches_done: int, batches_per_epoch: int) -> dict[str, int]:
        epoch = self.epoch
        if batches_done >= batches_per_epoch:  # saved at the epoch's end: resume at the next one's start
            epoch, batches_done = epoch + 1, 0
        return {"seed": self.seed, "epoch": epoch, "batches": batches_done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed = state["seed"]
        self.set_epoch(state["epoch"])
        self.skip_batches = state["batches"]


class ResumableLoader(DataLoader):
    """A training DataLoader over an ``EpochSampler`` whose position Lightning saves in each checkpoint.

    ``progress``: (batches of this epoch the training loop has finished, batches in its epoch). Not the
    loader's own count: by then it has read further ahead, in its workers and Lightning's prefetch.
    """

    progress: Callable[[], tuple[int, int]] | None = None

    def state_dict(self) -> dict[str, int]:
        done, per_epoch = self.progress() if self.progress is not None else (0, len(self))
        return self.sampler.state_dict(done, per_epoch)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)
