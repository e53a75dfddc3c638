"""``--budget 0:05:00``: the run measures its own speed at its start, then fixes its number of epochs so that the
whole schedule (warm-up, cosine, progressive resizing, weight averaging) completes when the budget ends.

Lightning's ``max_time`` stops a run wherever it is: the learning rate never anneals and the last resolutions are
never trained. A budget sizes the schedule to the time instead, on whatever machine runs it. It counts what the user
waits for: the process's start (imports, data setup, this measurement), every epoch's training and validation, the
checkpoints and the end of the run. A machine's speed drifts during a run, so at each epoch's end the run compares
its epochs' times with the plan and re-plans the rest: the schedule is stretched or squeezed from there on
(flowers.stretch), with no jump. The plan is saved in the checkpoints: a resumed run continues it as saved.
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
from flowers.schedules import WarmupCosineLR
from flowers.stretch import position, stretched

_IMPORTED = time.monotonic()
END_OF_RUN_S = 1.0  # after the last epoch: the last hooks, the summary, the process's exit
TIMED_STEPS = 3  # per training side, after one untimed step (kernels chosen, memory allocated); their median
PACE_EPOCHS = 3  # a re-plan reads the speed of the last few epochs: it follows a drift, not one slow epoch
MIN_PACE = 0.25  # epochs four times faster than measured mean a measurement gone wrong, not a faster machine
GROWTH = 2  # a re-plan at most doubles the epochs left: a burst of speed does not stretch the schedule far


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


def epoch_seconds(costs: Costs, epoch: int, side: int) -> float:
    """One epoch at ``side``: its steps, its validation if it has one, and its checkpoints."""
    validated = costs.validate_every is not None and (epoch + 1) % costs.validate_every == 0
    # last.ckpt after every epoch; the best checkpoint after a validation, at most.
    return (costs.batches_per_epoch * costs.step[side] + costs.checkpoint
            + (costs.validation + costs.checkpoint if validated else 0.0))


def predicted_seconds(costs: Costs, epochs: int, size_at: Callable[[int, int], int]) -> float:
    """The whole run's time with ``epochs`` epochs: ``size_at(epoch, epochs)`` is the training side of each."""
    return costs.elapsed + END_OF_RUN_S + sum(epoch_seconds(costs, epoch, size_at(epoch, epochs))
                                              for epoch in range(epochs))


def _nearest(end: Callable[[int], float], budget_s: float, low: int, most: int) -> int:
    """The epoch count from ``low`` up to ``most`` whose ``end`` comes nearest the budget, before or after it: the
    most that end within it (strides that double, then bisect), or one more when that ends nearer past it."""
    stride = 1
    while low + stride <= most and end(low + stride) <= budget_s:
        low, stride = low + stride, stride * 2
    high = min(low + stride, most + 1)  # ends past the budget, or is past ``most``
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if end(middle) <= budget_s else (low, middle)
    if low < most and end(low + 1) - budget_s < budget_s - end(low):
        return low + 1  # whole epochs: half an epoch past the budget is nearer than most of one before it
    return low


def plan_epochs(costs: Costs, budget_s: float, size_at: Callable[[int, int], int], *,
                most: int = 100_000) -> Plan:
    """The epochs whose whole schedule ends nearest ``budget_s``; a ConfigError when not even one ends within it."""
    def end(epochs: int) -> float:
        return predicted_seconds(costs, epochs, size_at)

    if end(1) > budget_s:
        one = predicted_seconds(costs, 1, size_at)
        raise ConfigError(
            f"--budget {clock(budget_s)} is too short for one epoch: {clock(costs.elapsed)} have passed already and "
            f"one epoch with its validation would end at about {clock(one)}. Give at least --budget {clock(one * 1.2)},"
            " or train on less data."
        )
    low = _nearest(end, budget_s, 1, most)  # the time grows with the epochs
    return Plan(budget_s=budget_s, epochs=low, batches_per_epoch=costs.batches_per_epoch,
                first_size=size_at(0, low), last_size=size_at(low - 1, low),
                predicted_s=predicted_seconds(costs, low, size_at))


def replan_epochs(costs: Costs, budget_s: float, *, now: float, done: int, pace: float,
                  size_at: Callable[[int, int], int], most: int = 100_000) -> tuple[int, float]:
    """After ``done`` epochs, at ``now``: the epochs (at least one more) whose rest ends nearest ``budget_s`` when
    each takes ``pace`` × its measured time, and when that end comes. ``size_at(epoch, epochs)`` is an epoch's
    side with the schedule stretched to ``epochs``."""
    def end(epochs: int) -> float:
        return now + END_OF_RUN_S + pace * sum(epoch_seconds(costs, epoch, size_at(epoch, epochs))
                                               for epoch in range(done, epochs))

    epochs = _nearest(end, budget_s, done + 1, most)
    return epochs, end(epochs)


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
        self._costs: Costs | None = None  # measured in this process: a resumed run keeps its plan as saved
        self._epoch_ends: list[float] = []  # seconds since the start: when training began, then each epoch ended
        self._sides: list[int] = []  # each epoch's training side

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
        self._costs = costs
        self._apply(decided)

    def _apply(self, plan: Plan) -> None:
        self.plan = plan
        self._trainer.fit_loop.max_epochs = plan.epochs
        rank_zero_info(plan.describe())

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.plan is None:
            raise ConfigError("--budget was given to resume a run that was not planned by a budget: its schedule "
                              "is set in epochs. Resume it without --budget, or start a new run with one.")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_ends = [seconds_since_start()]

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._sides.append(trainer.datamodule.train_image_size())

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and trainer.state.fn == "fit" and trainer.is_last_batch:
            self._replan(trainer)  # before the epoch's checkpoints, which then hold the new plan

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._replan(trainer)  # an epoch with no validation

    def _replan(self, trainer: L.Trainer) -> None:
        done = trainer.current_epoch + 1
        if (self._costs is None or self.plan is None or len(self._epoch_ends) != done or done >= self.plan.epochs
                or trainer.should_stop or not _stretchable(trainer)):
            return
        now = seconds_since_start()
        self._epoch_ends.append(now)
        data, epochs = trainer.datamodule, self.plan.epochs
        first = max(0, done - PACE_EPOCHS)
        expected = sum(epoch_seconds(self._costs, epoch, self._sides[epoch]) for epoch in range(first, done))
        pace = max(MIN_PACE, (now - self._epoch_ends[first]) / expected)

        def size_at(epoch: int, new_epochs: int) -> int:
            knots = stretched(data.resize_knots, at=done, end=epochs, new_end=new_epochs)
            return data.train_image_size(position(epoch, knots), position(new_epochs, knots))

        decided = replan_epochs(self._costs, self.budget_s, now=now, done=done, pace=pace, size_at=size_at,
                                most=done + GROWTH * (epochs - done)) if trainer.is_global_zero else None
        new_epochs, ends = trainer.strategy.broadcast(decided, src=0)  # every ddp process stretches alike
        if new_epochs == epochs:
            return
        data.stretch_resizing(at_epoch=done, epochs=epochs, new_epochs=new_epochs)
        steps = trainer.num_training_batches / trainer.accumulate_grad_batches
        for config in trainer.lr_scheduler_configs:
            config.scheduler.stretch(at_step=trainer.global_step, run_steps=math.ceil(epochs * steps),
                                     new_run_steps=math.ceil(new_epochs * steps))
        self.plan = Plan(**{**asdict(self.plan), "epochs": new_epochs, "last_size": size_at(new_epochs - 1, new_epochs),
                            "predicted_s": ends})
        trainer.fit_loop.max_epochs = new_epochs
        rank_zero_info(f"budget {clock(self.budget_s)}: {clock(now)} after epoch {done}, the epochs take {pace:.2f} "
                       f"× their measured time: {epochs} → {new_epochs} epochs (ends at about {clock(ends)})")

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


def _stretchable(trainer: L.Trainer) -> bool:
    """Whether the run's schedule can follow a re-plan: flowers' warm-up and cosine, stepped every step, or none."""
    return all(isinstance(config.scheduler, WarmupCosineLR) and config.interval == "step"
               for config in trainer.lr_scheduler_configs)


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
