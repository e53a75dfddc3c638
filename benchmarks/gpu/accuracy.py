"""The accuracy step: val accuracy of a, c and c on the PIL loader over several seeds, with paired differences.

``python benchmarks/gpu/accuracy.py --data-dir DIR [--seeds 0-7] [--epochs 10] [--parallel 8] [--json FILE]``

Each (seed, variant) is one ``benchmarks/bench.py --accuracy-only --repeats 1 --seed S`` process, run
``--parallel`` at a time (on a GPU they share it; their speed is not measured here):

* ``a``: the plain tutorial loop (PIL loader, fp32);
* ``c``: ``fit`` with configs/fast.yaml (on a GPU the cache on the device, the crop batched there);
* ``c_pil``: ``c`` with ``data.cache=false``, the PIL loader: everything of c but its data path.

A seed gives a and c the same initial weights, so differences are paired by seed: c − a, c_pil − a and
c − c_pil, each with its mean and the 95 % interval of Student's t (two-sided quantiles from the table
below, the normal quantile beyond 30 degrees of freedom). An interval that excludes 0 says the
difference is larger than what seeds alone give; c − c_pil isolates the data path.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import report

BENCH = Path(__file__).resolve().parents[1] / "bench.py"
LABELS = {"a": "a plain PyTorch loop", "c": "c fast.yaml", "c_pil": "c on the PIL loader (data.cache=false)"}
VARIANT_ARGS = {"a": ["--variants", "a"], "c": ["--variants", "c"],
                "c_pil": ["--variants", "", "--ablate", "data.cache=false"]}
DIFFERENCES = (("c", "a"), ("c_pil", "a"), ("c", "c_pil"))
# Two-sided 95 % quantiles of Student's t (0.975 quantile) for 1 to 30 degrees of freedom.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
NORMAL_975 = 1.960
INTERVAL = "Student's t from a table of its 0.975 quantiles"


def t_quantile(degrees: int) -> float:
    return T_975[degrees - 1] if degrees <= len(T_975) else NORMAL_975


def paired(first: dict[str, float], second: dict[str, float], name: str) -> dict:
    # Rounded: accuracies come as float32 or as Python fractions, and equal ones must differ by exactly 0.
    per_seed = {seed: round(first[seed] - second[seed], 6) for seed in first if seed in second}
    values = list(per_seed.values())
    result = {"name": name, "per_seed": per_seed, "n": len(values), "mean": None, "sd": None, "half_width": None,
              "low": None, "high": None}
    if values:
        result["mean"] = statistics.mean(values)
    if len(values) >= 2:
        sd = statistics.stdev(values)
        half = t_quantile(len(values) - 1) * sd / math.sqrt(len(values))
        result.update(sd=sd, half_width=half, low=result["mean"] - half, high=result["mean"] + half)
    return result


def parse_seeds(text: str) -> list[int]:
    """``0-7`` or ``0,1,5``."""
    seeds = []
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        seeds.extend(range(int(low), int(high or low) + 1))
    return seeds


def summarise(jobs: list[dict], args, device: str) -> dict:
    accuracy: dict[str, dict[str, float]] = {v: {} for v in args.variants}
    histories: dict[str, dict[str, list]] = {v: {} for v in args.variants}
    for job in jobs:
        if job.get("result") is None:
            continue
        run = next(iter(job["result"]["variants"].values()))["runs"][0]
        accuracy[job["variant"]][str(job["seed"])] = run["val_acc"]
        histories[job["variant"]][str(job["seed"])] = run["history"]
    differences = [paired(accuracy[x], accuracy[y], f"{x} − {y}") for x, y in DIFFERENCES
                   if x in accuracy and y in accuracy]
    return {"seeds": args.seeds, "epochs": args.epochs, "parallel": args.parallel, "device": device,
            "labels": {v: LABELS[v] for v in args.variants}, "accuracy": accuracy, "differences": differences,
            "interval": INTERVAL, "histories": histories,
            "failed": [f"{j['variant']} seed {j['seed']}" for j in jobs if j.get("returncode") not in (None, 0)],
            "commands": {f"{j['variant']} {j['seed']}": j["command"] for j in jobs}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/gpu/accuracy.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--seeds", default="0-7")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--parallel", type=int, default=8, help="processes at a time")
    parser.add_argument("--variants", default="a,c,c_pil")
    parser.add_argument("--bench-args", default="", help="extra bench.py arguments for every process")
    parser.add_argument("--workdir", type=Path, default=Path("accuracy-runs"), help="each process's log and JSON")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    args.seeds = parse_seeds(args.seeds)
    args.variants = [v for v in args.variants.split(",") if v]
    args.workdir.mkdir(parents=True, exist_ok=True)
    # The cores shared among the processes: torch threads and the PIL loaders' workers.
    share = str(max(1, (os.cpu_count() or 1) // args.parallel))
    jobs = []
    for seed in args.seeds:  # seed by seed, so each batch of processes mixes the variants
        for variant in args.variants:
            out = args.workdir / f"{variant}-{seed}"
            command = [sys.executable, str(BENCH), "--data-dir", str(args.data_dir), "--seed", str(seed),
                       "--repeats", "1", "--epochs", str(args.epochs), "--accuracy-only", "--threads", share,
                       *(["--num-workers", share] if variant != "c" else []), *VARIANT_ARGS[variant],
                       "--json", f"{out}.json", *shlex.split(args.bench_args)]
            jobs.append({"seed": seed, "variant": variant, "out": out, "command": shlex.join(command),
                         "argv": command})
    device = "?"
    pending, running = list(jobs), []
    started = time.perf_counter()
    while pending or running:
        while pending and len(running) < args.parallel:
            job = pending.pop(0)
            job["log"] = open(f"{job['out']}.log", "w")  # closed when its process ends
            job["process"] = subprocess.Popen(job["argv"], stdout=job["log"], stderr=subprocess.STDOUT)
            running.append(job)
        time.sleep(0.2)
        for job in [j for j in running if j["process"].poll() is not None]:
            running.remove(job)
            job["log"].close()
            job["returncode"] = job["process"].returncode
            elapsed = time.perf_counter() - started
            if job["returncode"] == 0:
                job["result"] = json.loads(Path(f"{job['out']}.json").read_text())
                device = job["result"]["config"]["device"]
                print(f"# {elapsed:6.1f} s  {job['variant']} seed {job['seed']}: val acc "
                      f"{next(iter(job['result']['variants'].values()))['runs'][0]['val_acc']:.3f}", flush=True)
            else:
                tail = Path(f"{job['out']}.log").read_text().splitlines()[-15:]
                print(f"# {elapsed:6.1f} s  {job['variant']} seed {job['seed']}: FAILED (exit {job['returncode']}): "
                      f"{job['command']}\n" + "\n".join(tail), flush=True)
            if args.json:  # finished seeds stay if the step runs out of time
                args.json.write_text(json.dumps(summarise(jobs, args, device), indent=1) + "\n")
    summary = summarise(jobs, args, device)
    print(report.heading("accuracy"))
    print(report.accuracy_table(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
