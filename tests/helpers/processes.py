"""Real ``python -m flowers`` child processes: a clean environment, a process group of their own, bounded waits.

Each child gets OMP_NUM_THREADS=1 and no cluster variables of the test run around it; every wait has a timeout
that kills the child's whole process group, so a hung collective fails its test instead of the suite.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# Arguments that shrink a ddp fit on CPU (gloo) to a few seconds; the test adds devices and batch limits.
DDP_RUN = [
    "--trainer.accelerator=cpu",
    "--trainer.strategy=ddp",
    "--trainer.enable_progress_bar=false",
    "--data.image_size=64",
    "--data.batch_size=4",
    "--data.num_workers=0",
    "--model.fused_optimizer=true",
]
# Variables through which Lightning would detect a cluster around the test run itself.
CLUSTER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE",
                     "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED")


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARIABLES and not k.startswith("SLURM_")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a SIGABRT makes each process print every thread's stack (timed_out)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def start(command: list[str], cwd: Path, variables: dict[str, str] | None = None) -> subprocess.Popen:
    # A process group of its own (setsid), so a timeout can kill the launcher's children (the other ranks) too.
    return subprocess.Popen(command, cwd=cwd, env={**child_env(), **(variables or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def timed_out(process: subprocess.Popen, timeout: float) -> str:
    """The output of a child that ran past ``timeout``, ending with the stack of every thread of every process in
    its group (SIGABRT and the fault handler), so a hang says where it hung; the group is then killed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGABRT)
    try:
        output = process.communicate(timeout=10)[0]
    except subprocess.TimeoutExpired:
        kill(process)
        output = process.communicate()[0]
    kill(process)
    return f"{output}\n[ran past {timeout:.0f} s: the stacks above, then killed]"


def finish(processes: list[subprocess.Popen], timeout: float) -> list[str]:
    """Wait for all; on a timeout or any failure kill every one and fail with their output."""
    outputs = []
    try:
        for process in processes:
            out, _ = process.communicate(timeout=timeout)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        hung = next((p for p in processes if p.poll() is None), processes[0])
        stacks = timed_out(hung, timeout)
        for process in processes:
            kill(process)
        pytest.fail(f"a child ran past {timeout} s and was killed:\n{stacks[-6000:]}")
    failed = [(p.returncode, out[-4000:]) for p, out in zip(processes, outputs, strict=True) if p.returncode != 0]
    if failed:
        for process in processes:
            kill(process)
        pytest.fail(f"exit status {failed[0][0]}:\n{failed[0][1]}")
    return outputs


def run_flowers(args: list[str], cwd: Path, timeout: float = 240) -> str:
    """The output of ``python -m flowers ARGS`` in ``cwd``, which must succeed."""
    return finish([start([sys.executable, "-m", "flowers", *args], cwd)], timeout)[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def probes(folder: Path, stage: str) -> dict[int, dict]:
    """What each rank's ``tests.helpers.callbacks.Probe`` recorded, by global rank."""
    records = [json.loads(path.read_text()) for path in folder.glob(f"{stage}_rank*.json")]
    return {record["global_rank"]: record for record in records}


def state_dict(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
