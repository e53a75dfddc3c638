"""``python benchmarks/tta.py --data-dir DIR``: time to accuracy, beside the tutorial's loop, whole processes.

Each recipe (``--recipe "configs/tutorial.yaml configs/fast.yaml"``, repeatable) is trained once per seed
as ``flowers fit`` in a process of its own, and so is the tutorial's loop (``benchmarks/tutorial_loop.py``),
on the same train/val split. For every run the validation accuracy after each epoch is read with its time
since the process started (imports and data setup included). The table gives, per recipe, the time to
first reach each ``--targets`` accuracy, the final accuracy (the last epoch's: no epoch is picked on the
validation split) and the total time: medians with min–max over the seeds.

A recipe's decoded cache is built once per data folder, before the timed runs, by an untimed one-batch
run whose time is reported apart. Recipes are validated every epoch here
(``--trainer.check_val_every_n_epoch=1``), so a recipe that validates less often is timed a little slower
than it runs. A folder of class folders is split as ``flowers fit`` splits it (``data.split_seed`` 42,
10 %), into ``train/`` and ``val/`` folders of links that both the loop and ``fit`` read.
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
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from flowers.data.download import DEFAULT_DIR
from flowers.data.folders import find_classes, is_split_layout, list_images, stratified_split

ROOT = Path(__file__).resolve().parents[1]
LOOP = "tutorial loop"


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


def run_loop(data_dir: Path, seed: int, epochs: int, extra: list[str]) -> dict:
    """The tutorial's loop as a process: each epoch's accuracy with its time since the process started."""
    start = time.time()
    command = [sys.executable, str(ROOT / "benchmarks" / "tutorial_loop.py"), "--data-dir", str(data_dir),
               "--epochs", str(epochs), "--seed", str(seed), *extra]
    epochs_seen = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
        for line in process.stdout:  # a line is printed and flushed at each epoch's end
            epochs_seen.append({**json.loads(line), "time_s": time.time() - start})
    if process.returncode:
        raise RuntimeError(f"{' '.join(command)} exited with {process.returncode}")
    return {"epochs": epochs_seen, "total_s": time.time() - start}


def run_fit(recipe: list[str], data_dir: Path, seed: int, runs_dir: Path, extra: list[str]) -> dict:
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


def spread(values: list[float], unit: str = "", digits: int = 1) -> str:
    if not values:
        return "-"
    median = statistics.median(values)
    return f"{median:.{digits}f}{unit} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def table(report: dict) -> str:
    targets = report["config"]["targets"]
    header = f"{'recipe':48} {'final val acc':>22} " + " ".join(f"{f'time to {t:.2f}':>24}" for t in targets) + \
        f" {'total s':>24}"
    rows = [header]
    for name, runs in report["recipes"].items():
        cells = [f"{name:48}", f"{spread([r['epochs'][-1]['val_acc'] for r in runs], digits=3):>22}"]
        for target in targets:
            reached = [t for r in runs if (t := first_time_at(r, target)) is not None]
            note = "" if len(reached) == len(runs) else f" [{len(reached)}/{len(runs)}]"
            cells.append(f"{spread(reached, ' s') + note:>24}")
        cells.append(f"{spread([r['total_s'] for r in runs], ' s'):>24}")
        rows.append(" ".join(cells))
    for name, seconds in report["warm_up_s"].items():
        rows.append(f"warm-up of {name} (builds its cache once, not in the table): {seconds:.1f} s")
    config = report["config"]
    rows.append(f"seeds {config['seeds']}, whole processes, {config['train_images']} train / {config['val_images']}"
                f" val images; [k/n]: only k of the n seeds reached that accuracy (median over those k)")
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python benchmarks/tta.py", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--data-dir", type=Path, default=Path(os.environ.get("FLOWERS_DATA_DIR") or DEFAULT_DIR),
                        help=f"class folders, or train/ and val/ (default: $FLOWERS_DATA_DIR, else {DEFAULT_DIR})")
    parser.add_argument("--recipe", action="append", default=[], metavar="CONFIGS",
                        help="config files for one recipe, space-separated (repeat the flag for more recipes; "
                             "default: configs/tutorial.yaml configs/fast.yaml)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated; each recipe and the loop run once per seed")
    parser.add_argument("--loop-epochs", type=int, default=10, help="epochs of the tutorial's loop (its recipe: 10)")
    parser.add_argument("--targets", default="0.70,0.80", help="accuracies to time, comma-separated")
    parser.add_argument("--no-loop", action="store_true", help="leave out the tutorial's loop")
    parser.add_argument("--fit-args", default="", help="extra `flowers fit` arguments for every recipe (one flag "
                        "alone needs the = form: --fit-args=--trainer.max_epochs=5)")
    parser.add_argument("--loop-args", default="", help="extra arguments for benchmarks/tutorial_loop.py")
    parser.add_argument("--ablate", action="append", default=[], metavar="SETTINGS",
                        help="add a recipe: the first one with these `fit` settings changed, space-separated, e.g. "
                             "'data.mixup_alpha=0 trainer.max_epochs=16' (repeatable)")
    parser.add_argument("--json", type=Path, default=None, help="also write every run's epochs here")
    args = parser.parse_args(argv)
    args.recipes = [r.split() for r in args.recipe] or [["configs/tutorial.yaml", "configs/fast.yaml"]]
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.targets = [float(t) for t in args.targets.split(",") if t.strip()]
    if not args.data_dir.is_dir():
        parser.error(f"--data-dir {str(args.data_dir)!r} does not exist; run `make data` or set FLOWERS_DATA_DIR.")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fit_extra, loop_extra = shlex.split(args.fit_args), shlex.split(args.loop_args)
    with tempfile.TemporaryDirectory(prefix="tta-flowers-") as tmp:
        data_dir = split_folder(args.data_dir.resolve(), Path(tmp) / "split")
        names = {" + ".join(recipe): (recipe, []) for recipe in args.recipes}
        for settings in args.ablate:  # the first recipe with some settings changed
            names[f"{' + '.join(args.recipes[0])} with {settings}"] = (
                args.recipes[0], [f"--{setting}" for setting in shlex.split(settings)])
        warm_up_s = {}
        for name, (recipe, changes) in names.items():
            started = time.time()
            run_fit(recipe, data_dir, 0, Path(tmp) / f"warm-up-{len(warm_up_s)}", [
                *fit_extra, *changes, "--trainer.max_epochs=1", "--trainer.limit_train_batches=1",
                "--trainer.limit_val_batches=1", "--trainer.check_val_every_n_epoch=1"])  # validates its one epoch
            warm_up_s[name] = time.time() - started
        recipes: dict[str, list[dict]] = {name: [] for name in ([] if args.no_loop else [LOOP]) + list(names)}
        for seed in args.seeds:
            # Every other seed runs the recipes in reverse order, so drift does not always favour one.
            order = list(recipes) if seed % 2 == 0 else list(recipes)[::-1]
            for name in order:
                if name == LOOP:
                    run = run_loop(data_dir, seed, args.loop_epochs, loop_extra)
                else:
                    recipe, changes = names[name]
                    run = run_fit(recipe, data_dir, seed, Path(tmp) / f"runs-{seed}-{order.index(name)}",
                                  [*fit_extra, *changes])
                recipes[name].append({"seed": seed, **run})
                print(f"# seed {seed} {name}: final val acc {run['epochs'][-1]['val_acc']:.3f} in "
                      f"{run['total_s']:.1f} s", file=sys.stderr, flush=True)
        train_images = sum(1 for p in (data_dir / "train").rglob("*") if p.is_file() or p.is_symlink())
        val_images = sum(1 for p in (data_dir / "val").rglob("*") if p.is_file() or p.is_symlink())
    if not args.no_loop:
        recipes[f"{LOOP} ({args.loop_epochs} epochs)"] = recipes.pop(LOOP)
    report = {"config": {"data_dir": str(args.data_dir), "seeds": args.seeds, "targets": args.targets,
                         "ablate": args.ablate,
                         "loop_epochs": args.loop_epochs, "fit_args": args.fit_args, "loop_args": args.loop_args,
                         "train_images": train_images, "val_images": val_images, "cpu_count": os.cpu_count()},
              "warm_up_s": warm_up_s, "recipes": recipes}
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
