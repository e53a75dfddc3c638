"""The env step: the GPU (name, memory, driver, from nvidia-smi), the library versions and the CPU count.

``python benchmarks/gpu/environment.py [--json FILE]``. Versions come from the installed packages' metadata,
so this step imports no torch and takes no time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

PACKAGES = ("torch", "lightning", "torchvision", "jsonargparse", "torchmetrics", "numpy", "pillow")


def gpus() -> list[dict] | str:
    if shutil.which("nvidia-smi") is None:
        return "no nvidia-smi: no NVIDIA GPU or driver"
    done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=60)
    if done.returncode:
        return f"nvidia-smi failed: {done.stderr.strip() or done.stdout.strip()}"
    found = []
    for line in done.stdout.strip().splitlines():
        name, memory, driver = (part.strip() for part in line.split(","))
        found.append({"name": name, "memory": memory, "driver": driver})
    return found


def versions() -> dict:
    found = {}
    for package in PACKAGES:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/gpu/environment.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    env = {"gpus": gpus(), "versions": versions(), "python": platform.python_version(),
           "cpus": os.cpu_count(), "cpus_usable": affinity, "platform": platform.platform(),
           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    if isinstance(env["gpus"], str):
        print(f"GPU: {env['gpus']}")
    else:
        for i, gpu in enumerate(env["gpus"]):
            print(f"GPU {i}: {gpu['name']}, {gpu['memory']}, driver {gpu['driver']}")
    print(" ".join(f"{name} {version}" for name, version in env["versions"].items()))
    print(f"python {env['python']}, {env['cpus']} CPUs ({env['cpus_usable']} usable), {env['platform']}")
    if args.json:
        args.json.write_text(json.dumps(env, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
