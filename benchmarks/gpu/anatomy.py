"""The anatomy step: where a training step's time goes, on the fast path (c) and with the tutorial's settings (b).

``python benchmarks/gpu/anatomy.py --data-dir DIR [--steps 50] [--warmup-steps 10] [--json FILE]``

Each variant is ``flowers fit`` as the CLI builds it (c: configs/tutorial.yaml + configs/fast.yaml with the
cache on the GPU; b: configs/tutorial.yaml) for ``--warmup-steps + --steps`` training steps with no
validation, under Lightning's simple profiler. The phases are Lightning's own actions: the loader's
``next``, ``transfer_batch_to_device``, ``on_after_batch_transfer`` (the fast path's crop), ``training_step``
(forward, loss, metrics, logging), ``backward``, and ``optimizer_step`` less those two (the optimizer's
step and its hooks). The whole step is the wall clock over the timed steps, synchronised at both ends;
what the phases leave of it is Lightning's loop between them (callbacks, logging, bookkeeping).

Two passes per variant on CUDA: "host" is what the host spends in each phase while the GPU runs behind
it (what bounds a launch-bound loop); "synced" synchronises the GPU at every profiler boundary, so each
phase includes the GPU work it queued. On CPU the two are the same and only "host" runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import report
import torch
from lightning.pytorch.profilers import SimpleProfiler

from flowers.cli import cli_main

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
VARIANTS = {"c": ("c fast.yaml", ["tutorial.yaml", "fast.yaml"]), "b": ("b tutorial settings", ["tutorial.yaml"])}


class StepProfiler(SimpleProfiler):
    """Lightning's simple profiler, optionally synchronising the GPU at each action's start and end."""

    def __init__(self, synced: bool) -> None:
        super().__init__()
        self.synced = synced and torch.cuda.is_available()

    def start(self, action_name: str) -> None:
        if self.synced:
            torch.cuda.synchronize()
        super().start(action_name)

    def stop(self, action_name: str) -> None:
        if self.synced:
            torch.cuda.synchronize()
        super().stop(action_name)

    def summary(self) -> str:
        return ""  # the table below replaces Lightning's report


class StepClock(L.Callback):
    """The wall clock from the end of the warm-up steps to the end of the last one."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.started: float | None = None
        self.seconds, self.steps = 0.0, 0

    def _now(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.warmup - 1:
            self.started = self._now()
        elif self.started is not None:
            self.steps += 1

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.started is not None:
            self.seconds = self._now() - self.started


def _per_step(durations: dict[str, list[float]], warmup: int, match) -> list[float]:
    """Each timed step's total over the actions ``match`` accepts (one call per step each; a fetch ahead of the
    last step may add one call, left out)."""
    lists = [values[warmup:] for name, values in durations.items() if match(name)]
    return [sum(step) for step in zip(*lists, strict=False)] if lists else []


def phases(durations: dict[str, list[float]], warmup: int, clock: StepClock) -> dict[str, float]:
    def mean_ms(values: list[float]) -> float | None:
        return 1000 * statistics.mean(values) if values else None

    fetch = _per_step(durations, warmup, lambda n: n == "[_TrainingEpochLoop].train_dataloader_next")
    to_device = _per_step(durations, warmup, lambda n: n.startswith("[Strategy]") and n.endswith(".batch_to_device"))
    transfer = _per_step(durations, warmup, lambda n: n.endswith(".transfer_batch_to_device"))
    augment = _per_step(durations, warmup, lambda n: n.endswith(".on_after_batch_transfer"))
    forward = _per_step(durations, warmup, lambda n: n.startswith("[Strategy]") and n.endswith(".training_step"))
    backward = _per_step(durations, warmup, lambda n: n.startswith("[Strategy]") and n.endswith(".backward"))
    optimizer = _per_step(durations, warmup, lambda n: n.startswith("[LightningModule]")
                          and n.endswith(".optimizer_step"))
    batch = _per_step(durations, warmup, lambda n: n == "run_training_batch")
    whole = 1000 * clock.seconds / clock.steps if clock.steps else None
    accounted = [mean_ms(v) for v in (fetch, to_device, batch)]
    return {
        "data fetch (loader next)": mean_ms(fetch),
        "host→device transfer": mean_ms(transfer),
        "augmentation (on_after_batch_transfer)": mean_ms(augment),
        "forward, loss, metrics (training_step)": mean_ms(forward),
        "backward": mean_ms(backward),
        "optimizer step and its hooks": mean_ms([o - f - b for o, f, b in zip(optimizer, forward, backward,
                                                                              strict=False)]),
        "rest of the loop (callbacks, logging)": (whole - sum(accounted)
                                                  if whole is not None and None not in accounted else None),
        "whole step (wall clock)": whole,
    }


def profile(variant: str, *, data_dir: Path, steps: int, warmup: int, synced: bool, on_cuda: bool, workdir: Path,
            extra: list[str]) -> dict[str, float]:
    configs = [word for name in VARIANTS[variant][1] for word in ("--config", str(CONFIGS / name))]
    args = [*configs, "--data.data_dir", str(data_dir), "--trainer.max_epochs=1",
            f"--trainer.limit_train_batches={warmup + steps}", "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            "--trainer.logger.init_args.save_dir", str(workdir / f"{variant}-{int(synced)}"),
            f"--trainer.accelerator={'gpu' if on_cuda else 'cpu'}", "--trainer.devices=1", *extra]
    if on_cuda and variant == "c":
        args.append("--data.cache_on_device=true")
    cli = cli_main(args, run=False)
    profiler, clock = StepProfiler(synced), StepClock(warmup)
    cli.trainer.profiler = profiler
    cli.trainer.callbacks.append(clock)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return phases(profiler.recorded_durations, warmup, clock)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/gpu/anatomy.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--variants", default="c,b")
    parser.add_argument("--fit-args", default="", help="extra `flowers fit` arguments for every run")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    sys.argv[1:] = []  # LightningCLI gets its arguments as a list; this script's own would look mixed in
    on_cuda = torch.cuda.is_available()
    extra = args.fit_args.split()
    settings = {w.split("=")[0]: w.split("=", 1)[1] for w in extra if w.startswith("--data.") and "=" in w}
    result = {"device": "cuda" if on_cuda else "cpu", "steps": args.steps, "warmup": args.warmup_steps,
              "batch_size": settings.get("--data.batch_size", "32"),
              "image_size": settings.get("--data.image_size", "224"), "runs": {}}
    with tempfile.TemporaryDirectory(prefix="flowers-anatomy-") as tmp:
        for variant in args.variants.split(","):
            runs = {"label": VARIANTS[variant][0], "host": None, "synced": None}
            for synced in (False, True) if on_cuda else (False,):
                runs["synced" if synced else "host"] = profile(
                    variant, data_dir=args.data_dir, steps=args.steps, warmup=args.warmup_steps, synced=synced,
                    on_cuda=on_cuda, workdir=Path(tmp), extra=extra)
            result["runs"][variant] = runs
            if args.json:  # one variant's figures stay if the next one fails
                args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(report.heading("step anatomy"))
    print(report.anatomy_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
