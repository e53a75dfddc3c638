"""``--budget 0:05:00``: the run measures its own speed at its start, then fixes its number of epochs so that the
whole schedule (warm-up, cosine, progressive resizing, weight averaging) completes when the budget ends.

Lightning's ``max_time`` stops a run wherever it is: the learning rate never anneals and the last resolutions are
never trained. A budget sizes the schedule to the time instead, on whatever machine runs it. It counts what the user
waits for: the process's start (imports, data setup, this measurement), every epoch's training and validation, the
checkpoints and the end of the run. The plan is saved in the checkpoints: a resumed run continues it.
"""

from __future__ import annotations

import copy
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities import move_data_to_device, rank_zero_info

from flowers.errors import ConfigError

_IMPORTED = time.monotonic()
END_OF_RUN_S = 1.0  # after the last epoch: the last hooks, the summary, the process's exit
TIMED_STEPS = 3  # per training side, after one untimed step (kernels chosen, memory allocated); their median


def parse_budget(text: str | float | int) -> float:
    """Seconds in ``[[[D:]H:]M:]S`` (``0:05:00``, ``5:00``, ``300``); refuses anything else in one line."""
    try:
        words = str(text).strip().split(":")
        parts = [float(word) for word in words]
        if not 1 <= len(parts) <= 4 or any(word.strip().startswith("-") or not math.isfinite(part)
                                           for word, part in zip(words, parts, strict=True)):
            raise ValueError
    except ValueError:
        raise ConfigError(f"--budget must be a duration as [[[D:]H:]M:]S, e.g. 0:05:00 for five minutes; got "
                          f"{text!r}.") from None
    seconds = sum(part * unit for part, unit in zip(reversed(parts), (1, 60, 3600, 86400), strict=False))
    if seconds <= 0:
        raise ConfigError(f"--budget must be more than zero; got {text!r}.")
    return seconds


def clock(seconds: float) -> str:
    """``H:MM:SS``, as ``--budget`` takes it."""
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def process_started(pid: int | str = "self") -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux); None where there is no such process."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def seconds_since_start() -> float:
    """How long this process has run: since the command started, imports included (Linux), else since flowers'
    first import."""
    started_ticks = process_started()
    try:
        if started_ticks is not None:
            uptime = float(Path("/proc/uptime").read_text().split()[0])
            return uptime - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    return time.monotonic() - _IMPORTED


@dataclass(frozen=True)
class Costs:
    """What a run's time is made of, in seconds, as measured at its start."""

    elapsed: float  # already spent when the plan is made
    step: dict[int, float]  # one training batch at each training side, its loading included
    batches_per_epoch: int
    validation: float  # one validation pass
    checkpoint: float  # one checkpoint write
    validate_every: int | None = 1  # check_val_every_n_epoch; None: no validation


@dataclass(frozen=True)
class Plan:
    budget_s: float
    epochs: int
    batches_per_epoch: int
    first_size: int
    last_size: int
    predicted_s: float

    @classmethod
    def from_state(cls, state: dict) -> Plan:
        """A plan as a checkpoint holds it; a checkpoint is data, so each field is checked."""
        kinds = {"budget_s": (int, float), "epochs": int, "batches_per_epoch": int, "first_size": int,
                 "last_size": int, "predicted_s": (int, float)}
        if not isinstance(state, dict) or set(state) != set(kinds) or not all(
                isinstance(state[key], kind) and not isinstance(state[key], bool) for key, kind in kinds.items()):
            raise ConfigError("The checkpoint's time-budget plan is not one flowers wrote: resume from another "
                              "checkpoint, or start a new run.")
        return cls(**state)

    def describe(self) -> str:
        sides = f"{self.first_size}→{self.last_size}" if self.first_size != self.last_size else f"{self.last_size}"
        return (f"budget {clock(self.budget_s)} → {self.epochs} epochs of {self.batches_per_epoch} steps at {sides} px"
                f" (ends at about {clock(self.predicted_s)})")


def predicted_seconds(costs: Costs, epochs: int, size_at: Callable[[int, int], int]) -> float:
    """The whole run's time with ``epochs`` epochs: ``size_at(epoch, epochs)`` is the training side of each."""
    total = costs.elapsed + END_OF_RUN_S
    for epoch in range(epochs):
        validated = costs.validate_every is not None and (epoch + 1) % costs.validate_every == 0
        total += costs.batches_per_epoch * costs.step[size_at(epoch, epochs)]
        # last.ckpt after every epoch; the best checkpoint after a validation, at most.
        total += costs.checkpoint + (costs.validation + costs.checkpoint if validated else 0.0)
    return total


def plan_epochs(costs: Costs, budget_s: float, size_at: Callable[[int, int], int], *,
                most: int = 100_000) -> Plan:
    """The most epochs whose whole schedule ends within ``budget_s``; a ConfigError when not even one does."""
    def fits(epochs: int) -> bool:
        return predicted_seconds(costs, epochs, size_at) <= budget_s

    if not fits(1):
        one = predicted_seconds(costs, 1, size_at)
        raise ConfigError(
            f"--budget {clock(budget_s)} is too short for one epoch: {clock(costs.elapsed)} have passed already and "
            f"one epoch with its validation would end at about {clock(one)}. Give at least --budget {clock(one * 1.2)},"
            " or train on less data."
        )
    low, high = 1, 2
    while high <= most and fits(high):  # the time grows with the epochs: double, then bisect
        low, high = high, high * 2
    high = min(high, most + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return Plan(budget_s=budget_s, epochs=low, batches_per_epoch=costs.batches_per_epoch,
                first_size=size_at(0, low), last_size=size_at(low - 1, low),
                predicted_s=predicted_seconds(costs, low, size_at))


class TimeBudget(L.Callback):
    """Sets ``max_epochs`` from a time budget before the optimizer and its schedule are built (see the module).

    Args:
        budget: ``[[[D:]H:]M:]S``, e.g. ``0:05:00``.
        planned: the run resumes a checkpoint, whose plan it continues: measure nothing.
    """

    def __init__(self, budget: str, *, planned: bool = False) -> None:
        self.budget_s = parse_budget(budget)
        self.planned = planned
        self.plan: Plan | None = None
        self._trainer: L.Trainer | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        if self.planned:
            return  # load_state_dict sets it, before the optimizer is built
        data = trainer.datamodule
        costs = measure(trainer, pl_module, data)
        decided: Plan | str | None = None
        if trainer.is_global_zero:
            try:
                decided = plan_epochs(costs, self.budget_s, data.train_image_size)
            except ConfigError as error:
                decided = str(error)  # said by every process, not left for the others to wait on
        decided = trainer.strategy.broadcast(decided, src=0)  # every ddp process runs rank 0's plan
        if isinstance(decided, str):
            raise ConfigError(decided)
        self._apply(decided)

    def _apply(self, plan: Plan) -> None:
        self.plan = plan
        self._trainer.fit_loop.max_epochs = plan.epochs
        rank_zero_info(plan.describe())

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.plan is None:
            raise ConfigError("--budget was given to resume a run that was not planned by a budget: its schedule "
                              "is set in epochs. Resume it without --budget, or start a new run with one.")

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.plan is not None:
            rank_zero_info(f"budget {clock(self.plan.budget_s)}: the training ended at "
                           f"{clock(seconds_since_start())} (planned {clock(self.plan.predicted_s)})")

    def state_dict(self) -> dict:
        return {"plan": asdict(self.plan)} if self.plan is not None else {}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("plan") and self._trainer is not None:
            plan = Plan.from_state(state_dict["plan"])
            if plan.budget_s != self.budget_s:
                rank_zero_info(f"Resuming keeps the run's plan for its budget of {clock(plan.budget_s)}, not "
                               f"{clock(self.budget_s)}: a schedule cannot change its length halfway.")
            self._apply(plan)


def measure(trainer: L.Trainer, pl_module: L.LightningModule, data) -> Costs:
    """Time a copy of the model on the run's own batches, so that the run's weights, optimizer and random numbers
    stay as they were."""
    device = trainer.strategy.root_device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model = copy.deepcopy(pl_module).to(device)
        loader = data.train_dataloader()
        batches_per_epoch = max(1, _limited(len(loader), trainer.limit_train_batches))
        # Batches straight from the run's loader: its workers then compete for the cores as they do in training.
        batches = _endless(loader)
        try:
            for _ in range(max(1, loader.num_workers * (loader.prefetch_factor or 0))):
                next(batches)  # the workers' start and their first batches, ready before any step needs them
            step = {side: _training_step_seconds(trainer, model, data, batches, side)
                    for side in data.train_image_sizes()}
        finally:
            batches.close()  # the loader's workers stop now
        val_batches = _limited(len(data.val_dataloader()), trainer.limit_val_batches)
        validation = val_batches * _evaluation_seconds(trainer, model, data.eval_batch_size, data.eval_image_size)
        checkpoint = _checkpoint_seconds(model, Path(trainer.default_root_dir))
    return Costs(elapsed=seconds_since_start(), step=step, batches_per_epoch=batches_per_epoch,
                 validation=validation, checkpoint=checkpoint,
                 validate_every=trainer.check_val_every_n_epoch if val_batches else None)


def _limited(batches: int, limit: int | float) -> int:
    """The batches an epoch runs under ``limit_{train,val}_batches`` (a count, or a fraction of the loader)."""
    return min(batches, int(limit)) if isinstance(limit, int) else int(batches * limit)


def _endless(loader) -> Iterator:
    while True:
        yield from loader


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _training_step_seconds(trainer: L.Trainer, model, data, batches: Iterator, side: int) -> float:
    """One step: the next batch, onto the device, the batch transforms, forward, backward and the update."""
    optimizer = model.make_optimizer()
    model.train()
    times = []
    for _ in range(1 + TIMED_STEPS):
        start = time.perf_counter()
        images, labels = data.on_device(move_data_to_device(next(batches), model.device), training=True, side=side)
        with trainer.precision_plugin.forward_context():
            loss = model.loss(model(images), labels)
        loss.backward()
        if trainer.world_size > 1:  # ddp's gradient all-reduce, in one piece
            trainer.strategy.reduce(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _synchronize(model.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _evaluation_seconds(trainer: L.Trainer, model, batch_size: int, side: int) -> float:
    images = torch.randn(batch_size, 3, side, side, generator=torch.Generator().manual_seed(0)).to(model.device)
    if model.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    model.eval()
    times = []
    with torch.no_grad():
        for _ in range(2):
            start = time.perf_counter()
            with trainer.precision_plugin.forward_context():
                model.eval_logits(images)
            _synchronize(model.device)
            times.append(time.perf_counter() - start)
    return times[-1]


def _checkpoint_seconds(model, folder: Path) -> float:
    """One checkpoint's write: the weights and, for Adam-type optimizers, two more tensors of their size."""
    weights = {name: value.detach().cpu() for name, value in model.state_dict().items()}
    start = time.perf_counter()
    with tempfile.TemporaryFile(dir=folder if folder.is_dir() else None) as file:
        for _ in range(3):  # torch.save writes a tensor it meets twice once
            torch.save(weights, file)
        file.flush()
        os.fsync(file.fileno())
    return time.perf_counter() - start


def saved_budget(checkpoint: dict) -> str | None:
    """The budget a checkpoint's run was planned for, as ``--budget`` takes it; None for a run set in epochs."""
    plan = (checkpoint.get("callbacks") or {}).get(TimeBudget.__qualname__, {}).get("plan")
    return clock(plan["budget_s"]) if isinstance(plan, dict) and "budget_s" in plan else None
