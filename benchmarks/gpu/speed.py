"""The throughput step: a and c eager against c with CUDA graphs, and the floor of a whole step as one CUDA graph.

``python benchmarks/gpu/speed.py --data-dir DIR [--repeats 2] [--epochs 3] [--json FILE]``

1. ``benchmarks/bench.py --variants a,c`` plus, on CUDA, ``--ablate "model.compile=true
   model.compile_mode=reduce-overhead data.drop_last=true"`` (c with the network's forward and backward
   replayed as CUDA graphs, every batch one shape), under ``TORCH_LOGS=recompiles,cudagraphs``: the log's
   "Recompiling function" lines count the recompiles and its "skipping cudagraphs" lines the graphs torch
   fell back from. The table's main figure is each variant's train images/s over the epochs after the
   first (the first compiles, records the graphs and starts the loader workers); bench's own all-epoch
   figure is beside it.
2. On CUDA, the floor: a whole training step (forward, loss, backward and torch's fused Adam with
   ``capturable=True``) with c's precision and memory format, captured once as one CUDA graph on static
   tensors and replayed; the same step run eagerly in the same process is beside it. Nothing the
   network computes can run faster at this batch size without changing the network.

On CPU there are no CUDA graphs: those rows are "n/a (CPU)".
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import report

BENCH = Path(__file__).resolve().parents[1] / "bench.py"
# drop_last: every step has one shape, so one graph is replayed (docs/gpu.md)
GRAPHS = "model.compile=true model.compile_mode=reduce-overhead data.drop_last=true"
LABELS = {"a": "a plain PyTorch loop (eager)", "c": "c fast.yaml (eager)",
          "c1": "c + CUDA graphs (compile_mode=reduce-overhead, drop_last)"}
RECOMPILE_LINE = "Recompiling function"
SKIP_LINE = "skipping cudagraphs"


def run_bench(command: list[str]) -> tuple[int, int, int]:
    """Runs bench.py with the compile logs on, echoing its output; its exit status and the two line counts."""
    env = {**os.environ, "TORCH_LOGS": "recompiles,cudagraphs"}
    recompiles = skips = 0
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as process:
        for line in process.stdout:
            print(line, end="", flush=True)
            recompiles += RECOMPILE_LINE in line
            skips += SKIP_LINE in line
    return process.returncode, recompiles, skips


def graph_floor(*, batch_size: int, image_size: int, num_classes: int, precision: str, channels_last: bool,
                steps: int, warmup: int = 3) -> dict:
    """Train images/s of one whole step captured as a CUDA graph, and of the same step eager, on CUDA."""
    import torch
    from torch import nn

    from flowers.model import AlexNet
    from flowers.module import TUTORIAL_LR

    device = torch.device("cuda")
    dtype = {"bf16": torch.bfloat16, "16": torch.float16}.get(precision.split("-")[0])
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model = AlexNet(num_classes).to(device, memory_format=layout)
    images = torch.randn(batch_size, 3, image_size, image_size, device=device).contiguous(memory_format=layout)
    labels = torch.randint(0, num_classes, (batch_size,), device=device)
    # capturable: the step count and learning-rate math stay on the GPU, so the step can be captured.
    optimizer = torch.optim.Adam(model.parameters(), lr=TUTORIAL_LR, fused=True, capturable=True)

    def step() -> torch.Tensor:
        # No autocast weight cache: a cached cast made outside the graph would be stale inside it.
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None, cache_enabled=False):
            loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        return loss

    def eager_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        step()

    def images_per_s(run) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
        return steps * batch_size / (time.perf_counter() - start)

    side = torch.cuda.Stream()  # warm-up off the default stream, as capture requires
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            eager_step()
    torch.cuda.current_stream().wait_stream(side)
    eager = images_per_s(eager_step)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)  # the gradients are then allocated, and rewritten, inside the graph
    with torch.cuda.graph(graph):
        step()
    graphed = images_per_s(graph.replay)
    settings = f"{precision}{', channels_last' if channels_last else ''}, fused Adam"
    return {"graph": graphed, "eager": eager, "settings": settings, "steps": steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/gpu/speed.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--floor-steps", type=int, default=100, help="replays of the whole-step graph")
    parser.add_argument("--bench-args", default="", help="extra bench.py arguments")
    parser.add_argument("--graphs", choices=("auto", "on", "off"), default="auto",
                        help="c with CUDA graphs: auto = where CUDA is available")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.graphs == "auto":  # asked of nvidia-smi, not torch: on CPU this process imports no torch
        args.graphs = "on" if _has_gpu() else "off"
    with tempfile.TemporaryDirectory(prefix="flowers-speed-") as tmp:
        bench_json = Path(tmp) / "bench.json"
        command = [sys.executable, str(BENCH), "--data-dir", str(args.data_dir), "--variants", "a,c",
                   "--repeats", str(args.repeats), "--epochs", str(args.epochs), "--json", str(bench_json),
                   *(["--ablate", GRAPHS] if args.graphs == "on" else []), *shlex.split(args.bench_args)]
        print(f"# {shlex.join(command)}", flush=True)
        code, recompiles, skips = run_bench(command)
        if code:
            print(f"speed.py: bench.py exited with {code}", file=sys.stderr)
            return 1
        bench = json.loads(bench_json.read_text())
    device = bench["config"]["device"]
    result = {"device": device, "bench": bench, "labels": LABELS, "graphs_variant": "c1",
              "recompiles": recompiles, "cudagraph_skips": skips,
              "graph_floor": {"status": "n/a (CPU)" if device == "cpu" else "not run"}}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if device != "cpu":
        used = bench["variants"]["c"]["runs"][0]["used"]
        config = bench["config"]
        result["graph_floor"] = graph_floor(batch_size=config["batch_size"], image_size=config["image_size"],
                                            num_classes=config["num_classes"], precision=used["precision"],
                                            channels_last=used["channels_last"], steps=args.floor_steps)
    print(report.heading("throughput"))
    print(report.throughput_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _has_gpu() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":  # GPUs present but hidden from torch
        return False
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and "GPU" in done.stdout


if __name__ == "__main__":
    sys.exit(main())
