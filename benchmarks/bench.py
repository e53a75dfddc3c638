"""``python benchmarks/bench.py``: how fast one training epoch is, plain PyTorch vs Lightning vs the fast path.

In one process, on the same images, split, model, optimizer (Adam 2e-4), batch size and thread count:

* ``a``: a hand-written loop as the tutorial's single-device code (PIL decode per image, fp32, a train
  epoch then a val epoch under ``torch.no_grad``);
* ``b``: ``Trainer.fit`` with the tutorial's settings on the same loader in fp32, with no progress bar,
  logger or checkpointing: Lightning's own cost;
* ``b_cli``: ``b`` plus what ``flowers fit`` adds (TensorBoard logger, the project's callbacks);
* ``c``: ``fit`` with ``configs/fast.yaml`` (cache + batched augmentation, its ``precision: auto`` resolved
  as the CLI does, channels_last, the fused optimizer step, larger eval batch, pinned memory on CUDA).

The images are ``--data-dir`` (default: ``$FLOWERS_DATA_DIR`` when set, else ``data/flower_photos`` from
``make data``) or ``--synthetic``; fast.yaml is read from the repository's ``configs/``. Run it from a
checkout where ``flowers`` is installed (``make install``).

Each variant is warmed up, then run ``--repeats`` times, alternating, one full epoch each; every other
repeat runs them in reverse order (a b c, c b a, …), so a machine that drifts within a repeat does not
always favour the same variant. The table gives
medians (min–max) and each ratio to ``a``; the compute floor (train steps on tensors already in
memory, with each variant's own precision, memory format and optimizer step) and the loaders alone say
how close each variant gets to what the hardware allows. The floor is measured in every repeat, right
after the variants, and each run is compared with its own repeat's floor: a shared or throttled machine
drifts by ±15 % over minutes, which would swamp a floor taken once.
Peak memory is the GPU's on CUDA, else the main process's resident peak (loader workers not included).

``--ablate "model.channels_last=false"`` adds a variant: ``c`` with those fast.yaml settings changed
(several ``section.name=value`` pairs, separated by spaces, change several at once; repeat the flag for
more variants). So each setting's share of the speed, or of an accuracy difference, is measured side
by side with ``c`` in the same run.

``--network free`` swaps the AlexNet for a network that costs next to nothing (a pooled linear layer), in
every variant and the floor: each variant's images/s is then its loop's ceiling, what its data path,
Lightning and logging allow. On a GPU bound by kernel launches this says whether a faster network
(CUDA graphs, ``model.compile_mode=reduce-overhead``) could still make a variant faster.

``--epochs N`` trains each run N epochs (validating after each, as ``fit`` does) and adds the val
accuracy after the last one (each epoch's val accuracy and mean train loss go to ``--json``);
``--epochs 10 --repeats 2`` is the accuracy check of fast vs plain over two seeds (repeat r seeds torch
with ``--seed`` + r, so a and c start from the same weights; another ``--seed`` adds more seeds). Times
are then per epoch; each epoch's train time and images go to ``--json`` too, so a run's steady state (the
epochs after the first, which includes compiling and worker start-up) can be read apart.

The loaders alone (no model) are timed as each loop feeds its network on ``--device``: a's PIL loader with
the copy to the device, and c's data path as ``fit`` runs it there. On CUDA that is the cache held on the
GPU when it fits (batches of indices, the crop in ``on_after_batch_transfer``), else the host cache with
pinned memory and loader workers; on CPU the host cache in the training process. The window is one
epoch's batches after an untimed first batch (``--loader-batches N`` sets a longer one, running on into
further epochs).

``--accuracy-only`` is for accuracy checks (``--epochs 10``): the runs are trained and scored as usual, but
nothing that only serves the speed figures runs (no warm-up, no compute floor, no loaders alone), and
the table leaves those figures out. It is a flag, not inferred from ``--epochs``: several epochs are
also how steady-state speed is measured. ``--variants ""`` with ``--ablate`` runs only the ablations.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import yaml
from torch import nn

from flowers import precision
from flowers.callbacks import ClassIndicesWriter, TensorBoardPictures
from flowers.data import FlowerDataModule
from flowers.data.download import DEFAULT_DIR
from flowers.errors import ConfigError, FlowersError
from flowers.model import AlexNet
from flowers.module import TUTORIAL_LR, FlowerClassifier

FAST_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "fast.yaml"
VARIANTS = ("a", "b", "b_cli", "c")
LABELS = {"a": "a plain PyTorch loop", "b": "b fit, tutorial settings", "b_cli": "b_cli fit + CLI logger/callbacks",
          "c": "c fit, configs/fast.yaml"}


# -- measuring ---------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: writing 5 resets VmHWM, the resident peak, so each run gets its own
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _limited(loader, limit: int | None):
    for i, batch in enumerate(loader):
        if limit is not None and i >= limit:
            return
        yield batch


# -- the variants --------------------------------------------------------------------------------
class FreeNetwork(nn.Module):
    """``--network free``: the mean colour of each image through one linear layer (a few kernels, no work)."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.classifier = nn.Linear(3, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(images.mean(dim=(2, 3)))


def network(args, num_classes: int) -> nn.Module:
    return FreeNetwork(num_classes) if args.network == "free" else AlexNet(num_classes)


def _datamodule(args, **overrides) -> FlowerDataModule:
    # pin_memory off as in the tutorial's DataLoader, so a and b share exactly one loader; c's comes from fast.yaml.
    kwargs = dict(data_dir=str(args.data_dir), image_size=args.image_size, batch_size=args.batch_size,
                  num_workers=args.num_workers, pin_memory=False)
    kwargs.update(overrides)
    return FlowerDataModule(**kwargs)


def run_plain(args, device: torch.device) -> dict:
    datamodule = _datamodule(args)
    datamodule.setup("fit")
    model = network(args, datamodule.num_classes).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=TUTORIAL_LR)
    loss_fn = nn.CrossEntropyLoss()
    _reset_peak(device)
    train_loader, val_loader = datamodule.train_dataloader(), datamodule.val_dataloader()
    start = time.perf_counter()
    seen, val_s, history = 0, 0.0, []
    for _ in range(args.epochs):
        epoch_start, epoch_first_seen = time.perf_counter(), seen
        model.train()
        running_loss, steps = 0.0, 0
        for images, labels in _limited(train_loader, args.limit_batches):
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()  # the tutorial prints the running loss: one sync per step, as fit's logging
            seen += len(labels)
            steps += 1
        _sync(device)
        val_start = time.perf_counter()
        train_s = val_start - epoch_start
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for images, labels in _limited(val_loader, args.limit_batches):
                correct += (model(images.to(device)).argmax(1) == labels.to(device)).sum().item()
                total += len(labels)
        _sync(device)
        val_s += time.perf_counter() - val_start
        history.append({"train_loss": running_loss / max(1, steps), "val_acc": correct / max(1, total),
                        "train_s": train_s, "train_images": seen - epoch_first_seen})
    total_s = time.perf_counter() - start
    return {"train_images": seen, "train_s": total_s - val_s, "val_s": val_s / args.epochs,
            "epoch_s": total_s / args.epochs, "peak_mb": _peak_mb(device), "val_acc": correct / max(1, total),
            "history": history, "workers": datamodule.num_workers}


class _EpochTimer(L.Callback):
    # The same span as run_plain times, from before the train loader's first iter() (which Lightning
    # calls, prefetching a batch, before on_train_epoch_start) to the end of the last validation.
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seen = 0
        self.val_s = 0.0
        self.epochs = 0
        self.times: dict[str, float] = {}
        self.history: list[dict] = []
        self.epoch_train: list[dict] = []  # each epoch's train seconds and images
        self._epoch_first_seen = 0

    def on_fit_start(self, trainer, pl_module) -> None:
        _reset_peak(self.device)
        self.times["start"] = self.times["epoch_start"] = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen += len(batch[1])

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            _sync(self.device)
            self.times["val_start"] = time.perf_counter()
            self.epoch_train.append({"train_s": self.times["val_start"] - self.times["epoch_start"],
                                     "train_images": self.seen - self._epoch_first_seen})

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            _sync(self.device)
            self.times["end"] = self.times["epoch_start"] = time.perf_counter()
            self.val_s += self.times["end"] - self.times["val_start"]
            self.epochs += 1
            self._epoch_first_seen = self.seen

    # The finished epoch's values, outside the timed span. Not in on_train_epoch_end: a callback's runs
    # before the module's, which logs the epoch's training loss.
    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch > 0:
            self._record_epoch(trainer)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._record_epoch(trainer)

    def _record_epoch(self, trainer) -> None:
        metrics = trainer.callback_metrics
        if "val/acc" in metrics:
            timing = self.epoch_train[len(self.history)] if len(self.epoch_train) > len(self.history) else {}
            self.history.append({"train_loss": float(metrics["train/loss_epoch"]),
                                 "val_acc": float(metrics["val/acc"]), **timing})

    def result(self, trainer) -> dict:
        total_s = self.times["end"] - self.times["start"]
        return {"train_images": self.seen, "train_s": total_s - self.val_s, "val_s": self.val_s / self.epochs,
                "epoch_s": total_s / self.epochs, "peak_mb": _peak_mb(self.device),
                "val_acc": float(trainer.callback_metrics["val/acc"]), "history": self.history}


def fast_settings() -> dict:
    return yaml.safe_load(FAST_CONFIG.read_text())


# What an ablation may change: the settings fast.yaml's sections feed (the bench builds the Trainer,
# module and datamodule itself, so a key outside these would be silently ignored).
ABLATABLE = {"trainer": {"precision"},
             "model": {"channels_last", "compile", "compile_mode", "fused_optimizer"},
             "data": set(inspect.signature(FlowerDataModule).parameters) - {"data_dir"}}


def parse_ablation(text: str) -> dict:
    """``"model.channels_last=false data.cache=false"`` → ``{"model": {"channels_last": False}, "data": …}``."""
    changes: dict[str, dict] = {}
    for pair in text.replace(",", " ").split():
        key, sep, value = pair.partition("=")
        section, _, name = key.partition(".")
        if not sep or name not in ABLATABLE.get(section, ()):
            allowed = ", ".join(f"{sec}.{n}" for sec, names in ABLATABLE.items() for n in sorted(names))
            raise ConfigError(f"--ablate {pair!r}: expected SECTION.NAME=VALUE with one of {allowed}.")
        changes.setdefault(section, {})[name] = yaml.safe_load(value)
    if not changes:
        raise ConfigError("--ablate needs at least one SECTION.NAME=VALUE, e.g. --ablate model.channels_last=false.")
    return changes


def variant_settings(args, variant: str) -> dict:
    """fast.yaml's trainer/model/data settings for ``c`` (with --fast-precision, --compile) or an ablation."""
    fast = fast_settings()
    settings = {section: dict(fast.get(section) or {}) for section in ("trainer", "model", "data")}
    if fast.get("precision") == "auto" and "precision" not in settings["trainer"]:
        settings["trainer"]["precision"] = precision.resolve(args.device)[0]  # as the CLI resolves it
    if args.fast_precision:
        settings["trainer"]["precision"] = args.fast_precision
    if args.compile:
        settings["model"]["compile"] = True
    for section, changes in args.ablations.get(variant, {}).items():
        settings[section].update(changes)
    return settings


def fast_data_settings(settings: dict) -> dict:
    """The datamodule arguments of a ``variant_settings`` result."""
    data_kwargs = dict(settings.get("data", {}))
    # Cached batches in the model's memory order (else every float batch is copied), unless the variant sets it.
    data_kwargs.setdefault("channels_last", bool(settings.get("model", {}).get("channels_last")))
    return data_kwargs


def run_fit(args, device: torch.device, variant: str, workdir: Path) -> dict:
    timer = _EpochTimer(device)
    trainer_kwargs = dict(
        accelerator=device.type, devices=1, max_epochs=args.epochs, precision="32-true", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_train_batches=args.limit_batches, limit_val_batches=args.limit_batches,
        callbacks=[timer], default_root_dir=str(workdir),
    )
    model_kwargs, data_kwargs = {}, {}
    if variant == "b_cli":
        trainer_kwargs["logger"] = L.pytorch.loggers.TensorBoardLogger(str(workdir), name="bench",
                                                                        default_hp_metric=False)
        trainer_kwargs["callbacks"] = [timer, L.pytorch.callbacks.LearningRateMonitor(logging_interval="epoch"),
                                       ClassIndicesWriter(), TensorBoardPictures()]
    elif variant.startswith("c"):
        fast = variant_settings(args, variant)
        trainer_kwargs.update(fast.get("trainer", {}))
        model_kwargs = dict(fast.get("model", {}))
        data_kwargs = fast_data_settings(fast)
    datamodule = _datamodule(args, **data_kwargs)
    model = FlowerClassifier(datamodule.num_classes, datamodule.class_names, **model_kwargs)
    if args.network == "free":
        model.net = FreeNetwork(datamodule.num_classes)
        if model_kwargs.get("compile"):
            model.net.compile(mode=model_kwargs.get("compile_mode"))
    trainer = L.Trainer(**{k: v for k, v in trainer_kwargs.items() if v is not None})
    trainer.fit(model, datamodule=datamodule)
    # What the run really used, read back from the objects (so a report shows an ablation took effect).
    used = {"network": type(model.net).__name__, "precision": trainer.precision, "cache": datamodule.cache,
            "channels_last": model.channels_last, "data_channels_last": datamodule.channels_last,
            "fused_optimizer": bool(trainer.optimizers[0].defaults.get("fused")),
            "eval_batch_size": datamodule.eval_batch_size}
    return {**timer.result(trainer), "workers": datamodule.num_workers, "used": used}


# -- floor and loaders --------------------------------------------------------------------------
def compute_floor(args, device: torch.device, num_classes: int, names: list[str]) -> dict:
    """Train images/s on one batch already on the device, for each of ``names`` (``_floor_key``'s form): what
    the model alone allows with those settings. Only the floors the compared variants use are measured:
    an emulated bf16 floor alone takes minutes on a CPU without native bf16."""
    steps = args.floor_steps
    results = {}
    for name in names:
        dtype = torch.bfloat16 if name.startswith("bf16") else None
        channels_last, fused = "_channels_last" in name, name.endswith("_fused")
        model = network(args, num_classes).to(device)
        images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
        labels = torch.randint(0, num_classes, (args.batch_size,), device=device)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
            images = images.contiguous(memory_format=torch.channels_last)
        optimizer = torch.optim.Adam(model.parameters(), lr=TUTORIAL_LR, fused=fused or None)
        for i in range(min(3, steps) + steps):  # the first few warm up oneDNN's kernels and are not timed
            if i == min(3, steps):
                _sync(device)
                start = time.perf_counter()
            optimizer.zero_grad()
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
        _sync(device)
        results[name] = steps * args.batch_size / (time.perf_counter() - start)
    return results


def loader_alone(args, device: torch.device, workdir: Path) -> tuple[dict, dict]:
    """Train images/s of each data path with no model, as its loop feeds the network on ``device``: a's PIL
    loader plus the copy to the device, and c's path as ``fit`` runs it there (see the module's docstring).
    Returns the figures and what was measured."""
    results, detail = {}, {}
    for name in ("pil", "cache"):
        if name == "pil":
            datamodule = _datamodule(args)
        else:
            settings = variant_settings(args, "c")
            datamodule = _datamodule(args, **fast_data_settings(settings))
            # The datamodule decides from its trainer where the cache lives and the batches' dtype, as in c's fit.
            datamodule.trainer = L.Trainer(accelerator=device.type, devices=1,
                                           precision=settings["trainer"]["precision"], logger=False,
                                           enable_checkpointing=False, enable_progress_bar=False,
                                           enable_model_summary=False, default_root_dir=str(workdir))
        datamodule.setup("fit")
        loader = datamodule.train_dataloader()
        per_epoch = len(loader) if args.limit_batches is None else min(len(loader), args.limit_batches)
        window = args.loader_batches or per_epoch
        batches = _cycled(loader, per_epoch)
        for i in range(window + 1):
            if i == 1:  # the first batch starts the workers and warms the crop's kernels: not timed
                _sync(device)
                start, seen = time.perf_counter(), 0
            batch = next(batches)
            if name == "pil":  # as a's loop does
                batch = [tensor.to(device) for tensor in batch]
            else:  # as fit does
                batch = datamodule.transfer_batch_to_device(batch, device, 0)
                batch = datamodule.on_after_batch_transfer(batch, 0)
            if i >= 1:
                seen += len(batch[1])
        _sync(device)
        results[name] = seen / (time.perf_counter() - start)
        if name == "cache":
            on_device = getattr(datamodule.train_set, "as_index", False)
            path = (f"cache on {device}, batches of indices" if on_device else
                    f"cache in host memory, {datamodule.num_workers} workers"
                    + (", pinned" if loader.pin_memory else ""))
            detail = {"batches": window, "cache_path": path + f", crop on {device.type}"}
        del loader, datamodule
    return results, detail


def _cycled(loader, per_epoch: int):
    while True:
        yield from _limited(loader, per_epoch)


# -- the report -----------------------------------------------------------------------------------
def summarise(runs: list[dict]) -> dict:
    out = {}
    for key in ("train_images_per_s", "epoch_s", "train_s", "val_s", "peak_mb", "val_acc"):
        values = [r[key] for r in runs]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def _floor_key(args, variant: str) -> str:
    """The floor with the variant's own precision, memory format and optimizer step, e.g. ``fp32`` for a and b,
    ``bf16_channels_last_fused`` for c where bf16 is native."""
    if not variant.startswith("c"):
        return "fp32"
    settings = variant_settings(args, variant)
    model = settings["model"]
    name = "bf16" if str(settings["trainer"].get("precision", "32")).startswith("bf16") else "fp32"
    return name + ("_channels_last" if model.get("channels_last") else "") + ("_fused" if model.get("fused_optimizer")
                                                                           else "")


def label(report: dict, variant: str) -> str:
    if variant in LABELS:
        return LABELS[variant]
    return f"{variant} c with {report['config']['ablations'][variant]}"


def table(report: dict) -> str:
    rows = [f"{'variant':34} {'train img/s':>22} {'epoch s':>20} {'peak MB':>8} {'img/s÷a':>8} {'time÷a':>7} "
            f"{'÷floor':>7} {'val acc mean (min–max)':>24}"]
    base = report["variants"].get("a")
    for variant, result in report["variants"].items():
        s = result["summary"]
        ips, ep = s["train_images_per_s"], s["epoch_s"]
        ratio = f"{ips['median'] / base['summary']['train_images_per_s']['median']:.3f}" if base else "-"
        time_ratio = f"{ep['median'] / base['summary']['epoch_s']['median']:.3f}" if base else "-"
        of_floor = "-" if result["fraction_of_floor"] is None else f"{result['fraction_of_floor']:.1%}"
        rows.append(f"{label(report, variant):34} {ips['median']:8.1f} ({ips['min']:.1f}–{ips['max']:.1f})"
                    f" {ep['median']:7.2f} ({ep['min']:.2f}–{ep['max']:.2f}) {s['peak_mb']['median']:8.0f}"
                    f" {ratio:>8} {time_ratio:>7} {of_floor:>7}"
                    f" {result['val_acc_mean']:10.3f} ({s['val_acc']['min']:.3f}–{s['val_acc']['max']:.3f})"
                    f"  [{result['runs'][0]['workers']} workers]")
    floor, loader, c = report["floor"], report["loader"], report["config"]
    if c.get("accuracy_only"):
        rows.append(f"{'floor, loaders alone':34} not measured (--accuracy-only)")
    else:
        rows.append(f"{'floor: train step on tensors':34} " + ", ".join(
            f"{name.replace('_channels_last', '+channels_last').replace('_fused', '+fused')} {floor[name]:.1f}"
            f" ({min(runs):.1f}–{max(runs):.1f})" for name, runs in report["floor_runs"].items()) + " img/s")
        rows.append(f"{'':34} (÷floor: median over repeats of each run ÷ the floor of its own repeat and settings)")
        window = c["loader"]
        rows.append(f"{'loader alone (train)':34} PIL {loader['pil']:.1f}, c's path {loader['cache']:.1f} img/s "
                    f"({window['cache_path']}; {window['batches']} batches after an untimed one)")
    rows.append(f"cache build (once): {report['cache_build_s']:.2f} s")
    rows.append(f"{c['device']}, {c['threads']} threads, batch {c['batch_size']}, {c['image_size']} px, "
                f"{c['train_images']} train / {c['val_images']} val images, {c['repeats']} repeats of "
                f"{c['epochs']} epoch(s); val acc after the last epoch, repeat r seeded with {c['seed']} + r")
    if c.get("network") == "free":
        rows.append("--network free: every variant and the floor ran a network that costs next to nothing; "
                    "each figure is its loop's ceiling")
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python benchmarks/bench.py", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--data-dir", type=Path, default=Path(os.environ.get("FLOWERS_DATA_DIR") or DEFAULT_DIR),
                        help=f"a folder of class folders (default: $FLOWERS_DATA_DIR when set, else {DEFAULT_DIR}"
                             ", from `make data`)")
    parser.add_argument("--synthetic", action="store_true", help="use the embedded synthetic set instead")
    parser.add_argument("--synthetic-dir", type=Path, default=Path("data/synthetic"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=1, help="epochs per run; the val accuracy is the last one's")
    parser.add_argument("--seed", type=int, default=0,
                        help="repeat r seeds torch with SEED + r (more seeds: run again with another SEED)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-workers", type=int, default=None, help="default: the tutorial's min(cpu, batch, 8)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--limit-batches", type=int, default=None, help="batches per epoch (for smoke tests)")
    parser.add_argument("--floor-steps", type=int, default=20)
    parser.add_argument("--loader-batches", type=int, default=None,
                        help="batches timed for the loaders alone (default: one epoch's)")
    parser.add_argument("--accuracy-only", action="store_true",
                        help="train and score only: no warm-up, compute floor or loaders alone (accuracy checks)")
    parser.add_argument("--warmup-batches", type=int, default=3, help="batches of each variant's warm-up run (0: none)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"a subset of {','.join(VARIANTS)} (empty: only the --ablate variants)")
    parser.add_argument("--network", choices=("alexnet", "free"), default="alexnet",
                        help="free: a network that costs next to nothing, so each figure is its loop's ceiling")
    parser.add_argument("--fast-precision", default=None, help="override fast.yaml's precision for c")
    parser.add_argument("--compile", action="store_true", help="c with torch.compile")
    parser.add_argument("--ablate", action="append", default=[], metavar="SETTINGS",
                        help="add a variant: c with these fast.yaml settings changed, e.g. "
                             "'model.channels_last=false' or 'data.cache=false trainer.precision=32-true'")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--json", type=Path, default=None, help="also write the full results here")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if unknown := set(args.variants) - set(VARIANTS):
        raise ConfigError(f"--variants {sorted(unknown)} unknown; choose from {', '.join(VARIANTS)}.")
    args.ablations, args.ablation_labels = {}, {}
    for number, text in enumerate(args.ablate, start=1):
        name = f"c{number}"
        args.ablations[name] = parse_ablation(text)
        args.ablation_labels[name] = " ".join(text.replace(",", " ").split())
        args.variants.append(name)
    if args.repeats < 1 or args.epochs < 1:
        raise ConfigError(f"--repeats and --epochs must be at least 1, got {args.repeats} and {args.epochs}.")
    if not args.variants:
        raise ConfigError("--variants is empty and there is no --ablate: nothing to run.")
    if args.loader_batches is not None and args.loader_batches < 1:
        raise ConfigError(f"--loader-batches must be at least 1, got {args.loader_batches}.")
    if args.accuracy_only:
        args.warmup_batches = 0
    if args.synthetic:
        from flowers.data import synthetic

        args.data_dir = synthetic.ensure_synthetic(args.synthetic_dir)
    elif not args.data_dir.is_dir():
        raise ConfigError(f"--data-dir {str(args.data_dir)!r} does not exist; run `make data`, or pass --synthetic.")
    return args


def bench(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    probe = _datamodule(args)
    probe.setup("fit")
    start = time.perf_counter()
    _datamodule(args, cache=True).setup("fit")  # builds the cache (or finds it) outside the timed runs
    cache_build_s = time.perf_counter() - start
    runners = {"a": lambda workdir: run_plain(args, device)}
    for variant in ("b", "b_cli", "c", *args.ablations):
        runners[variant] = lambda workdir, v=variant: run_fit(args, device, v, workdir)
    runs = {v: [] for v in args.variants}
    floor_runs: dict[str, list[float]] = {}
    fast_precision = variant_settings(args, "c")["trainer"]["precision"]
    floor_names = list(dict.fromkeys(_floor_key(args, variant) for variant in args.variants))
    loader, loader_detail = None, None
    with tempfile.TemporaryDirectory(prefix="benchmark-flowers-") as tmp:
        warm = argparse.Namespace(**{**vars(args), "limit_batches": args.warmup_batches, "epochs": 1})
        for variant in args.variants if args.warmup_batches > 0 else ():
            # Warm-up: allocator, oneDNN kernel choice, page cache, Lightning's first imports.
            (run_plain(warm, device) if variant == "a" else run_fit(warm, device, variant, Path(tmp)))
        for repeat in range(args.repeats):
            for variant in args.variants if repeat % 2 == 0 else args.variants[::-1]:
                torch.manual_seed(args.seed + repeat)
                result = runners[variant](Path(tmp) / f"{variant}-{repeat}")
                result["train_images_per_s"] = result["train_images"] / result["train_s"]
                runs[variant].append(result)
                print(f"# repeat {repeat + 1}/{args.repeats} {variant}: {result['train_images_per_s']:.1f} img/s, "
                      f"epoch {result['epoch_s']:.2f} s, val acc {result['val_acc']:.3f}, train loss "
                      f"{result['history'][-1]['train_loss']:.4f}", file=sys.stderr, flush=True)
            if args.accuracy_only:
                continue
            floor_now = compute_floor(args, device, probe.num_classes, floor_names)
            for name, value in floor_now.items():
                floor_runs.setdefault(name, []).append(value)
            for variant in args.variants:
                key = _floor_key(args, variant)
                runs[variant][-1]["fraction_of_floor"] = runs[variant][-1]["train_images_per_s"] / floor_now[key]
            print(f"# repeat {repeat + 1}/{args.repeats} floor: " + ", ".join(
                f"{name} {value:.1f}" for name, value in floor_now.items()) + " img/s", file=sys.stderr, flush=True)
        if not args.accuracy_only:
            loader, loader_detail = loader_alone(args, device, Path(tmp))
    floor = {name: statistics.median(values) for name, values in floor_runs.items()}
    report = {
        "config": {"device": str(device), "threads": torch.get_num_threads(), "workers": probe.num_workers,
                   "batch_size": args.batch_size, "image_size": args.image_size, "repeats": args.repeats,
                   "limit_batches": args.limit_batches, "epochs": args.epochs, "seed": args.seed,
                   "data_dir": str(args.data_dir),
                   "train_images": len(probe.train_set), "val_images": len(probe.val_set),
                   "num_classes": probe.num_classes,
                   "fast_precision": fast_precision, "compile": args.compile, "ablations": args.ablation_labels,
                   "network": args.network, "accuracy_only": args.accuracy_only, "loader": loader_detail,
                   "torch": torch.__version__,
                   "lightning": L.__version__, "cpu_count": os.cpu_count()},
        "cache_build_s": cache_build_s,
        "floor": floor,
        "floor_runs": floor_runs,
        "loader": loader,
        "variants": {},
    }
    base = statistics.median(r["train_images_per_s"] for r in runs["a"]) if "a" in runs else None
    for variant, results in runs.items():
        summary = summarise(results)
        ips = summary["train_images_per_s"]["median"]
        report["variants"][variant] = {
            "runs": results, "summary": summary,
            "ratio_to_a": ips / base if base else None,
            "fraction_of_floor": None if args.accuracy_only else statistics.median(
                r["fraction_of_floor"] for r in results),
            "val_acc_mean": statistics.mean(r["val_acc"] for r in results),
        }
    return report


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        report = bench(args)
    except FlowersError as error:
        print(f"bench.py: error: {error}", file=sys.stderr)
        return 2
    print(table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
