"""The GPU checks' five tables (equivalence, step anatomy, throughput, accuracy, modes), from their JSON results.

``python benchmarks/gpu/report.py RESULTS`` prints all five from ``RESULTS/<step>.json``, saying for each
table whose step did not run or failed; each step's script prints its own table with the same functions.
Plain Python on purpose: printing the tables imports no torch, so the summary costs no start-up time.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

TITLES = {
    "equivalence": "the fast path's crops against the PIL path's, and host syncs in training steps",
    "step anatomy": "where a training step's time goes (ms per step, mean over the timed steps)",
    "throughput": "train images/s: eager, CUDA graphs, the floors and each loop's ceiling",
    "accuracy": "val accuracy after the last epoch, per seed, and paired differences",
    "modes": "a short fit in every training mode the machine allows",
}
# Which step's results each table reads: the throughput table adds the ceiling step's when present.
SOURCES = {"equivalence": "equivalence", "step anatomy": "anatomy", "throughput": "throughput",
           "accuracy": "accuracy", "modes": "modes"}


def heading(name: str) -> str:
    return f"==== {name} ==== {TITLES[name]}"


def grid(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns, two spaces apart."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells)


def _num(value, fmt: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, fmt)


# -- equivalence ---------------------------------------------------------------------------------
def equivalence_table(data: dict) -> str:
    rows = [[r["name"], _num(r["max_abs"], ".4f"), _num(r["mean_abs"], ".4f"), _num(r["mean"], "+.4f")]
            for r in data["rows"]]
    lines = [grid(["comparison (same photos, boxes and flips)", "max |diff|", "mean |diff|", "mean diff"], rows)]
    lines.append(f"{data['photos']} photos, crops of {data['image_size']} px from {data['cache_side']}-px cache "
                 f"squares, on {data['device']}; normalised units (a pixel level is {2 / 255:.4f})")
    if not data.get("boxes_agree", True):
        lines.append("WARNING: the square's boxes are not the originals' boxes mapped and rounded; "
                     "the 'original' rows compare different crops")
    sync = data["sync_check"]
    lines.append(f"host syncs in {sync['steps']} fast-path training steps: {sync['status']}"
                 + (f" ({sync['detail']})" if sync.get("detail") else ""))
    return "\n".join(lines)


# -- step anatomy --------------------------------------------------------------------------------
ANATOMY_PHASES = ("data fetch (loader next)", "host→device transfer", "augmentation (on_after_batch_transfer)",
                  "forward, loss, metrics (training_step)", "backward", "optimizer step and its hooks",
                  "rest of the loop (callbacks, logging)", "whole step (wall clock)")


def anatomy_table(data: dict) -> str:
    columns = [(variant, mode) for variant in data["runs"] for mode in ("host", "synced")]
    header = ["phase"] + [f"{variant} {mode}" for variant, mode in columns]
    rows = []
    for phase in ANATOMY_PHASES:
        row = [phase]
        for variant, mode in columns:
            timings = data["runs"][variant].get(mode)
            row.append("n/a (CPU)" if timings is None else _num(timings.get(phase), ".2f"))
        rows.append(row)
    labels = "; ".join(f"{v}: {d['label']}" for v, d in data["runs"].items())
    return "\n".join([
        grid(header, rows),
        f"{labels}; {data['steps']} timed steps after {data['warmup']}, batch {data['batch_size']}, "
        f"{data['image_size']} px, on {data['device']}",
        "host: Lightning's simple profiler, what the host spends (a GPU runs behind it); synced: the same with "
        "the device synchronised at every boundary, so each phase includes its GPU work",
    ])


# -- throughput ----------------------------------------------------------------------------------
def steady_images_per_s(run: dict) -> float:
    """Train images/s over the epochs after the first (compiling, worker start-up), else over all of them."""
    history = [h for h in run.get("history", []) if "train_s" in h]
    later = history[1:] or history
    seconds = sum(h["train_s"] for h in later)
    return sum(h["train_images"] for h in later) / seconds if seconds else run["train_images_per_s"]


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})"


def throughput_table(data: dict, ceiling: dict | None = None) -> str:
    bench = data["bench"]
    variants = bench["variants"]
    base = statistics.median(steady_images_per_s(r) for r in variants["a"]["runs"]) if "a" in variants else None
    graph_floor = data.get("graph_floor") or {}
    ceilings = {}
    if ceiling:
        ceilings = {v: statistics.median(steady_images_per_s(r) for r in result["runs"])
                    for v, result in ceiling["variants"].items()}
    rows = []
    for name, label in data["labels"].items():
        if name not in variants:
            rows.append([label, "n/a (CPU)" if data["device"] == "cpu" else "not run", "", "", "", "", "", ""])
            continue
        runs = variants[name]["runs"]
        steady = [steady_images_per_s(r) for r in runs]
        median = statistics.median(steady)
        compiled = name == data.get("graphs_variant")
        rows.append([label, _spread(steady), _spread([r["train_images_per_s"] for r in runs]),
                     _num(median / base if base else None, ".2f"),
                     _num(median / graph_floor["graph"] if graph_floor.get("graph") else None, ".0%"),
                     _num(ceilings.get(name), ".1f"),
                     str(data["recompiles"]) if compiled else "", str(data["cudagraph_skips"]) if compiled else ""])
    floor = bench.get("floor") or {}
    for key, value in floor.items():
        rows.append([f"floor, eager step on tensors ({key})", f"{value:.1f}", "", _num(value / base if base else None,
                     ".2f"), _num(value / graph_floor["graph"] if graph_floor.get("graph") else None, ".0%"),
                     "", "", ""])
    if graph_floor.get("graph"):
        rows.append([f"floor, whole step as one CUDA graph ({graph_floor['settings']})", f"{graph_floor['graph']:.1f}",
                     "", _num(graph_floor["graph"] / base if base else None, ".2f"), "100%", "", "", ""])
        rows.append(["  same settings, eager, same process", f"{graph_floor['eager']:.1f}", "",
                     _num(graph_floor["eager"] / base if base else None, ".2f"),
                     _num(graph_floor["eager"] / graph_floor["graph"], ".0%"), "", "", ""])
    else:
        rows.append(["floor, whole step as one CUDA graph", graph_floor.get("status", "n/a (CPU)"), "", "", "", "",
                     "", ""])
    config = bench["config"]
    lines = [grid(["variant", "img/s after epoch 1", "img/s all epochs", "÷ a", "÷ graph floor",
                   "ceiling (free net)", "recompiles", "skipped graphs"], rows),
             f"{config['repeats']} repeats of {config['epochs']} epochs, batch {config['batch_size']}, "
             f"{config['image_size']} px, c in {config['fast_precision']}, on {config['device']}; recompiles and "
             "skipped graphs: log lines under TORCH_LOGS=recompiles,cudagraphs"]
    if ceiling is None:
        lines.append("ceiling: the ceiling step did not run")
    return "\n".join(lines)


# -- accuracy ------------------------------------------------------------------------------------
def accuracy_table(data: dict) -> str:
    seeds = data["seeds"]
    header = ["variant", *[f"seed {s}" for s in seeds], "mean"]
    rows = []
    for name, label in data["labels"].items():
        accs = data["accuracy"].get(name, {})
        values = [accs.get(str(s)) for s in seeds]
        found = [v for v in values if v is not None]
        rows.append([label, *[_num(v, ".3f", "FAILED") for v in values],
                     _num(statistics.mean(found) if found else None, ".3f")])
    for diff in data["differences"]:
        per_seed = diff["per_seed"]
        interval = ("-" if diff["half_width"] is None else
                    f"{diff['mean']:+.3f} ± {diff['half_width']:.3f} [{diff['low']:+.3f}, {diff['high']:+.3f}]")
        rows.append([diff["name"], *[_num(per_seed.get(str(s)), "+.3f") for s in seeds], interval])
    lines = [grid(header, rows),
             f"{data['epochs']} epochs; {data['parallel']} processes at a time (one per seed and variant) on "
             f"{data['device']}; differences paired by seed (the same initial weights): mean ± half-width of the "
             f"95 % interval, {data['interval']}"]
    for diff in data["differences"]:
        if diff["half_width"] is not None:
            verdict = "excludes 0" if diff["low"] > 0 or diff["high"] < 0 else "includes 0"
            lines.append(f"  {diff['name']}: the interval {verdict}")
    return "\n".join(lines)


# -- modes ---------------------------------------------------------------------------------------
def modes_table(data: dict) -> str:
    header = ["mode", "result", "strategy", "procs x dev", "precision", "compute dtype", "images/s", "val/acc",
              "checkpoint"]
    rows = [[r["mode"], r["result"], r.get("strategy", ""), r.get("procs_x_dev", ""), r.get("precision", ""),
             r.get("compute_dtype", ""), r.get("images_per_s", ""), r.get("val_acc", ""), r.get("checkpoint", "")]
            for r in data["rows"]]
    lines = [grid(header, rows)]
    if data.get("parallel", 1) > 1:
        lines.append(f"{data['parallel']} modes ran at a time: images/s shows that a mode runs, not its speed")
    lines.extend(f"skipped: {why}" for why in data.get("skipped", []))
    return "\n".join(lines)


TABLES = {"equivalence": equivalence_table, "step anatomy": anatomy_table, "throughput": throughput_table,
          "accuracy": accuracy_table, "modes": modes_table}


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_steps(path: Path) -> dict[str, dict]:
    """run_all.sh's ``steps.tsv``: name, result, seconds, limit, one step a line."""
    steps = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            name, result, seconds, limit = line.split("\t")
            steps[name] = {"result": result, "seconds": seconds, "limit": limit}
    return steps


def report(results: Path) -> str:
    steps = read_steps(results / "steps.tsv")
    out = []
    for name, function in TABLES.items():
        out.append(heading(name))
        step = SOURCES[name]
        data = read_json(results / f"{step}.json")
        status = steps.get(step)
        if data is None:
            if status is None:
                out.append(f"(not run: {step} is not in STEPS)")
            else:
                out.append(f"(no results: {step} {status['result']}; see {step}.txt)")
            continue
        try:
            if name == "throughput":
                out.append(function(data, read_json(results / "ceiling.json")))
            else:
                out.append(function(data))
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
            out.append(f"(cannot read {step}.json: {type(error).__name__}: {error})")
        if status is not None and status["result"] != "ok":
            out.append(f"(the {step} step {status['result']}: the figures above may be partial)")
    if steps:
        out.append("==== steps ====")
        out.append(grid(["step", "result", "seconds", "limit s"],
                        [[n, s["result"], s["seconds"], s["limit"]] for n, s in steps.items()]))
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python benchmarks/gpu/report.py RESULTS", file=sys.stderr)
        return 2
    print(report(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
