"""``python benchmarks/bench.py``: how fast one training epoch is, plain PyTorch vs Lightning vs the fast path.

docs/benchmarks.md describes the variants, flags and figures; docs/benchmarks-gpu.md the GPU ones.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import chain, count, islice
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, ProgressBar
from lightning.pytorch.profilers import SimpleProfiler
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from flowers.alexnet import AlexNet
from flowers.budget import clock
from flowers.cli import cli_main
from flowers.data.folders import find_classes, is_split_layout, list_images, stratified_split
from flowers.module import TUTORIAL_LR

ROOT = Path(__file__).resolve().parents[1]
FAST_CONFIG = ROOT / "configs" / "fast.yaml"
DEFAULT_DATA = "data/flower_photos"
VARIANTS = ("a", "b", "b_cli", "c")
LABELS = {"a": "a plain PyTorch loop", "b": "b fit, tutorial settings", "b_cli": "b_cli fit + CLI logger/callbacks",
          "c": "c fit, configs/fast.yaml"}
LOOP = "tutorial loop"
# Two-sided 95 % quantiles of Student's t for 1 to 30 degrees of freedom; the normal one beyond.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
# The anatomy's phases: Lightning's profiler actions, by the start and end of their names.
ANATOMY = {"data fetch (loader next)": ("[_TrainingEpochLoop]", ".train_dataloader_next"),
           "to device (transfer_batch_to_device)": ("", ".transfer_batch_to_device"),
           "augmentation (on_after_batch_transfer)": ("", ".on_after_batch_transfer"),
           "forward, loss, metrics (training_step)": ("[Strategy]", ".training_step"),
           "backward": ("[Strategy]", ".backward"),
           "optimizer step, the two above included": ("[LightningModule]", ".optimizer_step"),
           "whole batch but the fetch (run_training_batch)": ("run_training_batch", "")}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def network(args, num_classes: int) -> nn.Module:
    """``--network free``: each image's mean colour through one linear layer, so a figure is its loop's ceiling."""
    if args.network == "free":
        return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, num_classes))
    return AlexNet(num_classes)


def fit_cli(args, device: torch.device, variant: str, workdir: Path):
    """``flowers fit``'s model, datamodule and settings for a variant, nothing run. a and b share b's loader."""
    if variant.startswith("c"):  # the config first: the flags after it win over it
        words = ["--config", str(FAST_CONFIG), *(f"--{change}" for change in args.ablations.get(variant, []))]
    else:  # the tutorial's DataLoader: no pinned memory, fp32
        words = ["--trainer.precision=32-true", "--data.pin_memory=false"]
    words += ["--data.data_dir", str(args.data_dir), f"--data.image_size={args.image_size}",
              f"--data.batch_size={args.batch_size}", "--trainer.devices=1", "--seed_everything=false",
              f"--trainer.accelerator={'gpu' if device.type == 'cuda' else 'cpu'}",
              f"--trainer.logger.init_args.save_dir={workdir}"]
    words += [f"--data.num_workers={args.num_workers}"] if args.num_workers is not None else []
    return cli_main(words, run=False)


def summary(history: list[dict], total_s: float, val_s: float) -> dict:
    return {"train_images": sum(h["train_images"] for h in history), "train_s": total_s - val_s,
            "val_s": val_s / len(history), "epoch_s": total_s / len(history), "val_acc": history[-1]["val_acc"],
            "history": history}


def run_plain(args, device: torch.device, variant: str, workdir: Path) -> dict:
    """Variant a: the tutorial's loop on b's loader, timed over the same span as ``_EpochTimer``."""
    datamodule = fit_cli(args, device, variant, workdir).datamodule
    datamodule.setup("fit")
    model = network(args, datamodule.num_classes).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=TUTORIAL_LR)
    train_loader, val_loader = datamodule.train_dataloader(), datamodule.val_dataloader()
    start, val_s, history = time.perf_counter(), 0.0, []
    for _ in range(args.epochs):
        epoch_start, seen, running_loss, steps = time.perf_counter(), 0, 0.0, 0
        model.train()
        for images, labels in islice(train_loader, args.limit_batches):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()  # the tutorial prints the running loss: one sync per step, as fit's logging
            seen, steps = seen + len(labels), steps + 1
        _sync(device)
        val_start = time.perf_counter()
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for images, labels in islice(val_loader, args.limit_batches):
                correct += (model(images.to(device)).argmax(1) == labels.to(device)).sum().item()
                total += len(labels)
        _sync(device)
        val_s += time.perf_counter() - val_start
        history.append({"train_loss": running_loss / max(1, steps), "val_acc": correct / max(1, total),
                        "train_s": val_start - epoch_start, "train_images": seen})
    return {**summary(history, time.perf_counter() - start, val_s), "workers": datamodule.num_workers}


class _EpochTimer(L.Callback):
    """run_plain's span: from before the train loader's first iter() to the end of the last validation."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.seen, self.val_s, self.spans, self.history = device, 0, 0.0, [], []

    def on_fit_start(self, trainer, pl_module) -> None:
        self.start = self.epoch_start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen += len(batch[1])

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        _sync(self.device)
        self.val_start = time.perf_counter()
        self.spans.append({"train_s": self.val_start - self.epoch_start, "train_images": self.seen})
        self.seen = 0

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        _sync(self.device)
        self.end = self.epoch_start = time.perf_counter()
        self.val_s += self.end - self.val_start

    # The finished epoch's values, outside the timed span: the module logs its epoch loss after on_train_epoch_end.
    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch > 0:
            self.on_fit_end(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        metrics = trainer.callback_metrics
        self.history.append({"train_loss": float(metrics["train/loss_epoch"]), "val_acc": float(metrics["val/acc"]),
                             **self.spans[len(self.history)]})


def fit_parts(args, device: torch.device, variant: str, workdir: Path, **trainer_kwargs):
    cli = fit_cli(args, device, variant, workdir)
    model, datamodule = cli.model, cli.datamodule
    if args.network == "free":
        model.net = network(args, datamodule.num_classes)
        if model.hparams.get("compile"):
            model.net.compile(mode=model.hparams.get("compile_mode"))
    callbacks, logger = trainer_kwargs.pop("callbacks", []), False
    if variant == "b_cli":  # what `flowers fit` adds, less checkpointing and the console's progress and summary
        logger = cli.trainer.logger
        skip = ModelCheckpoint | ProgressBar | ModelSummary
        callbacks += [c for c in cli.trainer.callbacks if not isinstance(c, skip)]
    kwargs = dict(accelerator=device.type, devices=1, max_epochs=args.epochs, logger=logger, callbacks=callbacks,
                  precision=cli.config["trainer"]["precision"], enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                  limit_train_batches=args.limit_batches, limit_val_batches=args.limit_batches,
                  default_root_dir=str(workdir))
    return model, datamodule, L.Trainer(**(kwargs | trainer_kwargs))


def run_fit(args, device: torch.device, variant: str, workdir: Path) -> dict:
    timer = _EpochTimer(device)
    model, datamodule, trainer = fit_parts(args, device, variant, workdir, callbacks=[timer])
    trainer.fit(model, datamodule=datamodule)
    # What the run really used, read back from the objects (so a report shows an ablation took effect).
    used = {"network": type(model.net).__name__, "precision": trainer.precision, "cache": datamodule.cache,
            "channels_last": model.channels_last, "data_channels_last": datamodule.channels_last,
            "fused_optimizer": bool(trainer.optimizers[0].defaults.get("fused")),
            "eval_batch_size": datamodule.eval_batch_size}
    return {**summary(timer.history, timer.end - timer.start, timer.val_s), "workers": datamodule.num_workers,
            "used": used}


def floor_key(used: dict) -> str:
    """The floor with a run's own precision, memory format and optimizer step, e.g. ``bf16_channels_last_fused``."""
    name = "bf16" if str(used["precision"]).startswith("bf16") else "fp32"
    return name + ("_channels_last" if used["channels_last"] else "") + ("_fused" if used["fused_optimizer"] else "")


def compute_floor(args, device: torch.device, num_classes: int, name: str) -> float:
    """Train images/s on one batch already on the device, with ``floor_key``'s settings (``_graph``: a CUDA graph)."""
    bf16, graph = name.startswith("bf16"), name.endswith("_graph")
    layout = torch.channels_last if "_channels_last" in name else torch.contiguous_format
    model = network(args, num_classes).to(device, memory_format=layout)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device).to(memory_format=layout)
    labels = torch.randint(0, num_classes, (args.batch_size,), device=device)
    # capturable: the step count and learning-rate math stay on the GPU, so the step can be captured.
    optimizer = torch.optim.Adam(model.parameters(), lr=TUTORIAL_LR, fused=("_fused" in name) or None, capturable=graph)

    def step() -> None:
        optimizer.zero_grad(set_to_none=not graph)  # a graph keeps its gradients' memory between replays
        # No autocast weight cache under a graph: a cast cached outside it would be stale inside.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16, cache_enabled=not graph):
            loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()

    side = torch.cuda.Stream() if graph else None  # capture wants its warm-up off the default stream
    with torch.cuda.stream(side):  # None: no change of stream
        for _ in range(min(3, args.floor_steps)):  # oneDNN's and cuDNN's kernel choice
            step()
    run = step
    if graph:
        torch.cuda.current_stream().wait_stream(side)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            step()
        run = captured.replay
    _sync(device)
    start = time.perf_counter()
    for _ in range(args.floor_steps):
        run()
    _sync(device)
    return args.floor_steps * args.batch_size / (time.perf_counter() - start)


def loader_alone(args, device: torch.device, workdir: Path) -> tuple[dict, dict]:
    """Train images/s of a's PIL loader (with the copy to the device) and of c's data path as ``fit`` runs it."""
    results = {}
    for name, variant in (("pil", "a"), ("cache", "c")):
        cli = fit_cli(args, device, variant, workdir)
        datamodule = cli.datamodule
        if name == "cache":  # where the cache lives, the batches' dtype and memory order follow fit's trainer and model
            cli.trainer.strategy.connect(cli.model)
            datamodule.trainer = cli.trainer
        datamodule.setup("fit")
        loader = datamodule.train_dataloader()
        per_epoch = len(loader) if args.limit_batches is None else min(len(loader), args.limit_batches)
        batches = chain.from_iterable(islice(loader, per_epoch) for _ in count())  # on into further epochs
        window, seen = args.loader_batches or per_epoch, 0
        for i in range(window + 1):
            if i == 1:  # untimed, the first batch: it starts the workers and warms the crop's kernels
                _sync(device)
                start, seen = time.perf_counter(), 0
            batch = next(batches)
            batch = ([tensor.to(device) for tensor in batch] if name == "pil" else
                     datamodule.on_after_batch_transfer(datamodule.transfer_batch_to_device(batch, device, 0), 0))
            seen += len(batch[1])
        _sync(device)
        results[name] = seen / (time.perf_counter() - start)
    # datamodule and loader are c's, the last measured
    path = (f"cache on {device}, batches of indices" if getattr(datamodule.train_set, "as_index", False) else
            f"cache in host memory, {datamodule.num_workers} workers" + (", pinned" * loader.pin_memory))
    return results, {"batches": window, "cache_path": f"{path}, crop on {device.type}"}


def anatomy(args, device: torch.device, workdir: Path) -> dict:
    """ms per training step in each phase (Lightning's simple profiler) after ``--warmup-batches`` untimed steps."""
    out = {}
    for variant in (v for v in args.variants if v != "a"):
        profiler = SimpleProfiler()
        model, datamodule, trainer = fit_parts(args, device, variant, workdir / variant, profiler=profiler,
                                               max_epochs=1, limit_val_batches=0,
                                               limit_train_batches=args.warmup_batches + args.anatomy)
        trainer.fit(model, datamodule=datamodule)
        out[variant] = {}
        for phase, (first, last) in ANATOMY.items():
            calls = [v[args.warmup_batches:] for k, v in profiler.recorded_durations.items()
                     if k.startswith(first) and k.endswith(last)]
            per_step = [sum(step) for step in zip(*calls, strict=False)]  # a step's calls of the matching actions
            out[variant][phase] = 1000 * statistics.mean(per_step) if per_step else float("nan")
    return out


def split_folder(data_dir: Path, into: Path) -> Path:
    """``data_dir`` itself when it has ``train/`` and ``val/``, else its flowers split as folders of links."""
    if is_split_layout(data_dir):
        return data_dir
    classes = find_classes(data_dir)
    train, val = stratified_split(list_images(data_dir, classes), val_fraction=0.1, seed=42)
    for split, samples in (("train", train), ("val", val)):
        for sample in samples:
            link = into / split / classes[sample.label] / Path(sample.path).name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(Path(sample.path).resolve())
    return into


def loop_process(data_dir: Path, seed: int, extra: list[str]) -> dict:
    """The tutorial's loop as a process: each epoch's accuracy with its time since the process started."""
    start = time.time()
    command = [sys.executable, str(ROOT / "benchmarks" / "tutorial_loop.py"), "--data-dir", str(data_dir),
               "--seed", str(seed), *extra]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:  # a line flushed at each epoch's end
        epochs = [{**json.loads(line), "time_s": time.time() - start} for line in process.stdout]
    if process.returncode:
        raise RuntimeError(f"{shlex.join(command)} exited with {process.returncode}")
    return {"epochs": epochs, "total_s": time.time() - start}


def fit_process(recipe: list[str], data_dir: Path, seed: int, runs_dir: Path, extra: list[str]) -> dict:
    """``flowers fit`` as a process; each epoch's ``val/acc`` with its time, read from TensorBoard's events."""
    start = time.time()
    command = [sys.executable, "-m", "flowers", "fit", *(w for c in recipe for w in ("--config", c)),
               "--data.data_dir", str(data_dir), "--seed_everything", str(seed),
               "--trainer.check_val_every_n_epoch=1", "--trainer.enable_progress_bar=false",
               "--trainer.logger.init_args.save_dir", str(runs_dir), *extra]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    total_s = time.time() - start
    if done.returncode:
        raise RuntimeError(f"{shlex.join(command)} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    events = EventAccumulator(str(next(runs_dir.glob("flowers/version_*"))), size_guidance={"scalars": 0})
    events.Reload()
    # One point per validation; the HPARAMS record at fit's end repeats the last one at its step.
    points = list({p.step: p for p in reversed(events.Scalars("val/acc"))}.values())[::-1]
    epochs = [{"epoch": i + 1, "val_acc": p.value, "time_s": p.wall_time - start} for i, p in enumerate(points)]
    return {"epochs": epochs, "total_s": total_s}


def first_time_at(run: dict, target: float) -> float | None:
    return next((e["time_s"] for e in run["epochs"] if e["val_acc"] >= target), None)


def tta(args: argparse.Namespace) -> dict:
    """Each recipe, and the tutorial's loop unless ``--no-loop``, as whole processes once per seed; with
    ``--budgets``, each recipe under each budget, a multiple of the loop's time (its first run, or --loop-seconds)."""
    fit_extra = shlex.split(args.fit_args)
    names = {" + ".join(recipe): (recipe, [], None) for recipe in args.recipes}
    for settings in args.ablate:  # the first recipe with some settings changed
        names[f"{' + '.join(args.recipes[0])} with {settings}"] = (
            args.recipes[0], [f"--{setting}" for setting in shlex.split(settings)], None)
    if args.budgets:
        names = {f"{name} at {multiple:g} × the loop": (recipe, changes, multiple)
                 for name, (recipe, changes, _) in names.items() for multiple in args.budgets}
    loop_s = args.loop_seconds
    with tempfile.TemporaryDirectory(prefix="tta-flowers-") as tmp:
        data_dir = split_folder(args.data_dir.resolve(), Path(tmp) / "split")
        warm_up_s = {}  # one batch of each recipe builds its cache, untimed; the last flag validates its one epoch
        for n, (name, (recipe, changes, _)) in enumerate(names.items()):
            warm_up_s[name] = fit_process(recipe, data_dir, 0, Path(tmp) / f"warm-up-{n}", [
                *fit_extra, *changes, "--budget=null", "--trainer.max_epochs=1", "--trainer.limit_train_batches=1",
                "--trainer.limit_val_batches=1", "--trainer.check_val_every_n_epoch=1"])["total_s"]
        recipes: dict[str, list[dict]] = {name: [] for name in [LOOP] * (not args.no_loop) + list(names)}
        for repeat in range(args.repeats):
            seed = args.seed + repeat
            order = list(recipes) if repeat % 2 == 0 else list(recipes)[::-1]  # so drift favours none
            if loop_s is None and LOOP in order:  # the budgets are multiples of the loop's first time
                order.insert(0, order.pop(order.index(LOOP)))
            for n, name in enumerate(order):
                recipe, changes, multiple = names.get(name, ([], [], None))
                budget_s = round(multiple * loop_s) if multiple is not None else None  # whole seconds, as --budget
                budget = [f"--budget={clock(budget_s)}"] if budget_s is not None else []
                run = (loop_process(data_dir, seed, shlex.split(args.loop_args)) if name == LOOP else
                       fit_process(recipe, data_dir, seed, Path(args.keep_runs or tmp) / f"runs-{seed}-{n}",
                                   [*fit_extra, *changes, *budget]))
                if budget_s is not None:
                    run["budget_s"] = budget_s
                if name == LOOP and loop_s is None:
                    loop_s = run["total_s"]
                recipes[name].append({"seed": seed, **run})
                print(f"# seed {seed} {name}: final val acc {run['epochs'][-1]['val_acc']:.3f} in "
                      f"{run['total_s']:.1f} s", file=sys.stderr, flush=True)
        train_images, val_images = (sum(1 for p in (data_dir / split).rglob("*") if p.is_file() or p.is_symlink())
                                    for split in ("train", "val"))
    if loop := recipes.pop(LOOP, None):  # named by the epochs it ran
        recipes[f"{LOOP} ({len(loop[0]['epochs'])} epochs)"] = loop
    config = {"seeds": [args.seed + r for r in range(args.repeats)], "targets": args.targets, "ablate": args.ablate,
              "fit_args": args.fit_args, "loop_args": args.loop_args, "data_dir": str(args.data_dir),
              "train_images": train_images, "val_images": val_images, "cpu_count": os.cpu_count(),
              "budgets": args.budgets, "loop_s": loop_s, "loop_s_given": args.loop_seconds is not None}
    return {"config": config, "warm_up_s": warm_up_s, "recipes": recipes}


def grid(rows: list[list[str]], widths: list[int]) -> list[str]:
    return [" ".join(f"{cell:{'<' if i == 0 else '>'}{width}}" for i, (cell, width) in
                     enumerate(zip(row, widths, strict=False))).rstrip() for row in rows]


def spread(values: list[float], digits: int = 1, unit: str = "") -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.{digits}f}{unit} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def steady(run: dict) -> float:
    """Train images/s over the epochs after the first (compiling, worker start-up), else over all of them."""
    later = run["history"][1:] or run["history"]
    return sum(h["train_images"] for h in later) / sum(h["train_s"] for h in later)


def paired(first: list[float], second: list[float]) -> dict:
    """Differences paired by seed, their mean and the half-width of its 95 % interval (Student's t)."""
    values = [round(x - y, 6) for x, y in zip(first, second, strict=True)]  # equal accuracies differ by exactly 0
    half = None
    if len(values) >= 2:
        half = (T_975[len(values) - 2] if len(values) <= 31 else 1.960) * statistics.stdev(values) / len(values) ** 0.5
    return {"per_seed": values, "mean": statistics.mean(values), "half_width": half}


def table(report: dict) -> str:
    c, variants, base = report["config"], report["variants"], report["variants"].get("a")
    several = c["epochs"] > 1
    rows = [["variant", "train img/s", "epoch s", "img/s÷a", "time÷a", "÷floor", "val acc mean (min–max)",
             " img/s after epoch 1" * several]]
    for variant, result in variants.items():
        runs, accs = result["runs"], [r["val_acc"] for r in result["runs"]]
        rows.append([LABELS.get(variant) or f"{variant} c with {c['ablations'][variant]}",
                     spread([r["train_images_per_s"] for r in runs]), spread([r["epoch_s"] for r in runs], 2),
                     f"{result['ratio_to_a']:.3f}" if base else "-",
                     f"{result['median_epoch_s'] / base['median_epoch_s']:.3f}" if base else "-",
                     "-" if result["fraction_of_floor"] is None else f"{result['fraction_of_floor']:.1%}",
                     f"{statistics.mean(accs):.3f} ({min(accs):.3f}–{max(accs):.3f})",
                     f" [{runs[0]['workers']} workers]", f" {spread([steady(r) for r in runs])}" * several])
    lines = grid(rows, [34, 22, 20, 8, 7, 7, 24, 0, 0])
    if c["accuracy_only"]:
        lines.append(f"{'floor, loaders alone':34} not measured (--accuracy-only)")
    else:
        floors = ", ".join(name.replace("_channels_last", "+channels_last").replace("_fused", "+fused")
                           .replace("_graph", " as a CUDA graph") + f" {spread(values)}"
                           for name, values in report["floor_runs"].items())
        loader = report["loader"]
        lines += [f"{'floor: train step on tensors':34} {floors} img/s",
                  f"{'':34} (÷floor: median over repeats of each run ÷ the floor of its own repeat and settings)",
                  f"{'loader alone (train)':34} PIL {loader['pil']:.1f}, c's path {loader['cache']:.1f} img/s "
                  f"({c['loader']['cache_path']}; {c['loader']['batches']} batches after an untimed one)"]
    pairs = [(v, "a") for v in variants if base and v != "a"] + [(v, "c") for v in c["ablations"] if "c" in variants]
    for first, second in pairs if c["repeats"] > 1 else ():
        d = paired([r["val_acc"] for r in variants[first]["runs"]], [r["val_acc"] for r in variants[second]["runs"]])
        interval = "" if d["half_width"] is None else f" ± {d['half_width']:.3f} (95 % interval, Student's t)"
        lines.append(f"val acc {first} − {second}, paired by seed: {d['mean']:+.3f}{interval}; per seed "
                     + " ".join(f"{x:+.3f}" for x in d["per_seed"]))
    lines.append(f"cache build (once): {report['cache_build_s']:.2f} s")
    lines.append(f"{c['device']}, {c['threads']} threads, batch {c['batch_size']}, {c['image_size']} px, "
                 f"{c['train_images']} train / {c['val_images']} val images, {c['repeats']} repeats of "
                 f"{c['epochs']} epoch(s); val acc after the last epoch, repeat r seeded with {c['seed']} + r"
                 + (f"; {c['parallel']} repeats at a time, one process each" if c["parallel"] > 1 else ""))
    if c["network"] == "free":
        lines.append("--network free: every variant and the floor ran a network that costs next to nothing; "
                     "each figure is its loop's ceiling")
    return "\n".join(lines)


def anatomy_table(report: dict, args) -> str:
    result = report["anatomy"]
    rows = [["phase (ms per step)", *result]] + [[phase, *(f"{result[v][phase]:.2f}" for v in result)]
                                                 for phase in ANATOMY]
    blocking = os.environ.get("CUDA_LAUNCH_BLOCKING") == "1"
    return "\n".join(grid(rows, [48] + [9] * len(result)) + [
        f"{args.anatomy} steps after {args.warmup_batches}, batch {args.batch_size}, {args.image_size} px, on "
        f"{args.device}: " + ("each phase with its GPU work (CUDA_LAUNCH_BLOCKING=1)" if blocking else
                              "the host's time, Lightning's simple profiler")])


def tta_table(report: dict) -> str:
    config = report["config"]
    budgeted = bool(config.get("budgets"))
    rows = [["recipe", "final val acc", *(f"time to {t:.2f}" for t in config["targets"]), "total s",
             *(["total / budget", "epochs"] if budgeted else [])]]
    for name, runs in report["recipes"].items():
        row = [name, spread([r["epochs"][-1]["val_acc"] for r in runs], 3)]
        for target in config["targets"]:
            reached = [t for r in runs if (t := first_time_at(r, target)) is not None]
            row.append(spread(reached, unit=" s") + ("" if len(reached) == len(runs) else
                                                     f" [{len(reached)}/{len(runs)}]"))
        row.append(spread([r["total_s"] for r in runs], unit=" s"))
        if budgeted:
            within = [r["total_s"] / r["budget_s"] for r in runs if "budget_s" in r]
            row += [spread(within, 3) if within else "", spread([len(r["epochs"]) for r in runs], 0)]
        rows.append(row)
    lines = grid(rows, [48, 22] + [24] * (len(config["targets"]) + 1) + [18, 12] * budgeted)
    lines += [f"warm-up of {name} (builds its cache once, not in the table): {seconds:.1f} s"
              for name, seconds in report["warm_up_s"].items()]
    lines.append(f"seeds {config['seeds']}, whole processes, {config['train_images']} train / "
                 f"{config['val_images']} val images; [k/n]: only k of the n seeds reached that accuracy "
                 "(median over those k)")
    if budgeted:
        source = "given (--loop-seconds)" if config["loop_s_given"] else "its first run here"
        lines.append(f"budgets: multiples of the tutorial loop's time, {config['loop_s']:.0f} s ({source})")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/bench.py", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--data-dir", type=Path, default=Path(os.environ.get("FLOWERS_DATA_DIR") or DEFAULT_DATA),
                   help=f"class folders (default: $FLOWERS_DATA_DIR, else {DEFAULT_DATA})")
    p.add_argument("--repeats", type=int, default=3, help="runs of each variant, or of each recipe with --tta")
    p.add_argument("--seed", type=int, default=0, help="repeat r seeds torch with SEED + r")
    p.add_argument("--epochs", type=int, default=1, help="epochs per run; the val accuracy is the last one's")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--num-workers", type=int, help="default: the tutorial's min(cpu, batch, 8)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--limit-batches", type=int, help="batches per epoch (for smoke tests)")
    p.add_argument("--floor-steps", type=int, default=20)
    p.add_argument("--graph-floor", action="store_true", help="CUDA: also c's floor as one captured CUDA graph")
    p.add_argument("--loader-batches", type=int, help="batches the loaders alone are timed over (default: an epoch)")
    p.add_argument("--accuracy-only", action="store_true", help="no warm-up, compute floor or loaders alone")
    p.add_argument("--parallel", type=int, default=1, help="repeats at a time, a process each; implies --accuracy-only")
    p.add_argument("--anatomy", type=int, metavar="STEPS", help="instead: ms per phase of STEPS training steps")
    p.add_argument("--warmup-batches", type=int, default=3, help="batches of each variant's warm-up run (0: none)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="a subset (empty: only the --ablate variants)")
    p.add_argument("--network", choices=("alexnet", "free"), default="alexnet", help="free: a loop's ceiling")
    p.add_argument("--ablate", action="append", default=[], metavar="SETTINGS",
                   help="add c (with --tta: the first recipe) with these `flowers fit` settings changed")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path, help="also write the full results here")
    p.add_argument("--tta", action="store_true", help="instead: time to accuracy, whole processes")
    p.add_argument("--recipe", action="append", default=[], metavar="CONFIGS",
                   help="a recipe's config files, space-separated (default: configs/tutorial.yaml configs/fast.yaml)")
    p.add_argument("--targets", default="0.70,0.80", help="accuracies to time, comma-separated")
    p.add_argument("--no-loop", action="store_true", help="leave out the tutorial's loop")
    p.add_argument("--budgets", default="", help="run each recipe under `--budget`s, these multiples of the tutorial "
                                                 "loop's time, comma-separated (e.g. 0.65,2)")
    p.add_argument("--keep-runs", type=Path, help="--tta: keep each run's folder (checkpoints, logs) here")
    p.add_argument("--loop-seconds", type=float, help="the loop's time for --budgets (default: its first run here)")
    p.add_argument("--fit-args", default="", help="extra `flowers fit` arguments (one alone needs =: --fit-args=--x=1)")
    p.add_argument("--loop-args", default="", help="extra arguments for benchmarks/tutorial_loop.py")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if unknown := set(args.variants) - set(VARIANTS):
        p.error(f"--variants {sorted(unknown)} unknown; choose from {', '.join(VARIANTS)}.")
    args.ablations = {f"c{n}": shlex.split(text) for n, text in enumerate(args.ablate, start=1)}
    args.variants += list(args.ablations)
    args.recipes = [r.split() for r in args.recipe] or [["configs/tutorial.yaml", "configs/fast.yaml"]]
    args.targets = [float(t) for t in args.targets.split(",") if t.strip()]
    args.budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    if args.keep_runs is not None and args.keep_runs.exists() and any(args.keep_runs.iterdir()):
        p.error(f"--keep-runs {str(args.keep_runs)!r} is not empty: each run's results are read from its own folder.")
    if args.budgets and args.no_loop and args.loop_seconds is None:
        p.error("--budgets are multiples of the tutorial loop's time: leave out --no-loop or give --loop-seconds.")
    if min(args.repeats, args.epochs, args.parallel) < 1:
        p.error("--repeats, --epochs and --parallel must be at least 1.")
    if not args.variants and not args.tta:
        p.error("--variants is empty and there is no --ablate: nothing to run.")
    if args.accuracy_only or args.parallel > 1:
        args.accuracy_only, args.warmup_batches = True, 0
    if not args.data_dir.is_dir():
        p.error(f"--data-dir {str(args.data_dir)!r} does not exist; run `make data` or set FLOWERS_DATA_DIR.")
    return args


def in_parallel(args) -> dict:
    """Each repeat as a process of its own, ``--parallel`` at a time, sharing the cores; their reports merged."""
    share = str(max(1, (os.cpu_count() or 1) // args.parallel))
    with tempfile.TemporaryDirectory(prefix="benchmark-flowers-") as tmp:
        def one(r: int) -> dict:
            command = [sys.executable, __file__, *args.argv, "--parallel", "1", "--accuracy-only", "--repeats", "1",
                       f"--seed={args.seed + r}", f"--json={tmp}/{r}.json", f"--threads={args.threads or share}",
                       *([] if args.num_workers is not None else [f"--num-workers={share}"])]
            if code := subprocess.run(command, stdout=subprocess.DEVNULL).returncode:
                raise SystemExit(f"bench.py: seed {args.seed + r} failed (exit {code}): {shlex.join(command)}")
            return json.loads(Path(f"{tmp}/{r}.json").read_text())

        with ThreadPoolExecutor(args.parallel) as pool:
            reports = list(pool.map(one, range(args.repeats)))
    report = reports[0]
    for variant, result in report["variants"].items():
        result["runs"] = [each["variants"][variant]["runs"][0] for each in reports]
    report["config"].update(repeats=args.repeats, seed=args.seed, parallel=args.parallel)
    return report


def bench(args: argparse.Namespace) -> dict:
    if args.parallel > 1:
        return finish(in_parallel(args))
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory(prefix="benchmark-flowers-") as tmp:
        workdir = Path(tmp)
        # A refused setting stops the benchmark before any run.
        fast, *_ = [fit_cli(args, device, variant, workdir) for variant in ("c", *args.ablations)]
        start = time.perf_counter()
        fast.datamodule.setup("fit")  # builds the cache (or finds it) outside the timed runs
        cache_build_s, data = time.perf_counter() - start, fast.datamodule
        if args.anatomy:
            return {"anatomy": anatomy(args, device, workdir)}
        runs, floor_runs = {v: [] for v in args.variants}, {}
        if args.warmup_batches > 0:  # allocator, oneDNN's kernel choice, page cache, Lightning's first imports
            warm = argparse.Namespace(**{**vars(args), "limit_batches": args.warmup_batches, "epochs": 1})
            for variant in args.variants:
                (run_plain if variant == "a" else run_fit)(warm, device, variant, workdir)
        for repeat in range(args.repeats):
            for variant in args.variants if repeat % 2 == 0 else args.variants[::-1]:  # so drift favours none
                torch.manual_seed(args.seed + repeat)
                run = run_plain if variant == "a" else run_fit
                result = run(args, device, variant, workdir / f"{variant}-{repeat}")
                result["train_images_per_s"] = result["train_images"] / result["train_s"]
                runs[variant].append(result)
                print(f"# repeat {repeat + 1}/{args.repeats} {variant}: {result['train_images_per_s']:.1f} img/s, "
                      f"epoch {result['epoch_s']:.2f} s, val acc {result['val_acc']:.3f}, train loss "
                      f"{result['history'][-1]['train_loss']:.4f}", file=sys.stderr, flush=True)
            if args.accuracy_only:
                continue
            # Each run against its own repeat's floor: a shared machine drifts by ±15 % over minutes.
            keys = {v: floor_key(runs[v][-1]["used"]) if v != "a" else "fp32" for v in args.variants}
            names = list(dict.fromkeys(keys.values()))
            names += [keys["c"] + "_graph"] if args.graph_floor and device.type == "cuda" and "c" in keys else []
            # Only the floors the variants use: an emulated bf16 floor alone takes minutes without native bf16.
            floor_now = {name: compute_floor(args, device, data.num_classes, name) for name in names}
            for name, value in floor_now.items():
                floor_runs.setdefault(name, []).append(value)
            for variant, key in keys.items():
                runs[variant][-1]["fraction_of_floor"] = runs[variant][-1]["train_images_per_s"] / floor_now[key]
            print(f"# repeat {repeat + 1}/{args.repeats} floor: " + ", ".join(
                f"{name} {value:.1f}" for name, value in floor_now.items()) + " img/s", file=sys.stderr, flush=True)
        loader, detail = (None, None) if args.accuracy_only else loader_alone(args, device, workdir)
    config = {"device": str(device), "threads": torch.get_num_threads(), "batch_size": args.batch_size,
              "image_size": args.image_size, "repeats": args.repeats, "limit_batches": args.limit_batches,
              "epochs": args.epochs, "seed": args.seed, "parallel": 1, "data_dir": str(args.data_dir),
              "train_images": len(data.train_set), "val_images": len(data.val_set), "num_classes": data.num_classes,
              "fast_precision": fast.config["trainer"]["precision"], "network": args.network, "loader": detail,
              "ablations": {name: " ".join(words) for name, words in args.ablations.items()},
              "accuracy_only": args.accuracy_only,
              "torch": torch.__version__, "lightning": L.__version__, "cpu_count": os.cpu_count()}
    return finish({"config": config, "cache_build_s": cache_build_s, "floor_runs": floor_runs, "loader": loader,
                   "variants": {variant: {"runs": results} for variant, results in runs.items()}})


def finish(report: dict) -> dict:
    report["floor"] = {name: statistics.median(values) for name, values in report["floor_runs"].items()}
    for result in report["variants"].values():
        runs = result["runs"]
        result["median_ips"] = statistics.median(r["train_images_per_s"] for r in runs)
        result["median_epoch_s"] = statistics.median(r["epoch_s"] for r in runs)
        result["val_acc_mean"] = statistics.mean(r["val_acc"] for r in runs)
        result["fraction_of_floor"] = None if report["config"]["accuracy_only"] else statistics.median(
            r["fraction_of_floor"] for r in runs)
    base = report["variants"].get("a")
    for result in report["variants"].values():
        result["ratio_to_a"] = result["median_ips"] / base["median_ips"] if base else None
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = tta(args) if args.tta else bench(args)
    print(tta_table(report) if args.tta else anatomy_table(report, args) if args.anatomy else table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
