"""A dead or hung ddp rank ends the others with the one-paragraph PeerError, within a bounded time.

Real ``python -m flowers fit`` processes on CPU (gloo). ``tests.ddp_probe.Fault`` makes rank 1 die
(``os._exit``) or hang (sleep without joining the gradient all-reduce) at the second training batch of
epoch 1, after epoch 0 has written its checkpoints, and writes the moment to a marker file.
Observed: a dead peer's socket closes, so rank 0 fails at once ("Connection reset by peer"), before
Lightning's launcher (which polls its children every 5 s) kills it. A hung peer keeps its socket open:
only the gloo timeout, ``--ddp_timeout``, ends rank 0 ("Timed out waiting 15000ms for recv operation").
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.test_ddp import TINY, free_port, kill, start

TIMEOUT_S = 15  # --ddp_timeout of the hang case: long enough for a slow start-up, short for a test


def fault_fit(data: Path, marker: Path, action: str) -> list[str]:
    return ["fit", *TINY, "--trainer.max_epochs=2", "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=1",
            f"--data.data_dir={data}", f"--ddp_timeout={TIMEOUT_S}", "--trainer.callbacks+=tests.ddp_probe.Fault",
            f"--trainer.callbacks.marker={marker}", f"--trainer.callbacks.action={action}",
            "--trainer.callbacks.epoch=1"]


def wait_for(process: subprocess.Popen, timeout: float) -> tuple[str, float]:
    """Its output and the moment it exited; fails (the finally of the caller kills) on a timeout."""
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"rank 0 still running after {timeout} s: it hangs")
    return out, time.time()


def assert_peer_error(out: str) -> None:
    assert "flowers: error: rank 0 lost contact with another ddp process" in out, out[-3000:]
    assert "--ddp_timeout" in out and "--ckpt_path last" in out
    assert "Traceback" not in out, out[-3000:]


def assert_epoch_0_checkpoint(run_dir: Path) -> None:
    # The failure came mid-epoch 1: last.ckpt is epoch 0's, complete and loadable.
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["epoch"] == 0 and "state_dict" in checkpoint


@pytest.mark.slow
def test_dead_rank_under_lightning_launcher_ends_the_run(tmp_path, tiny_synthetic):
    marker = tmp_path / "fault"
    process = start([sys.executable, "-m", "flowers", *fault_fit(tiny_synthetic, marker, "exit"),
                     "--trainer.devices=2"], tmp_path)
    try:
        out, ended = wait_for(process, timeout=180)
        assert process.returncode == 2, out[-3000:]  # our os._exit(2), not the launcher's SIGKILL (-9)
        assert ended - float(marker.read_text().split()[0]) < 10
        assert_peer_error(out)
        assert_epoch_0_checkpoint(tmp_path / "runs" / "flowers" / "version_0")
    finally:
        kill(process)


@pytest.mark.slow
@pytest.mark.parametrize("action", ["exit", "hang"])
def test_two_nodes_rank_0_gives_up_on_a_dead_or_hung_peer(action, tmp_path, tiny_synthetic):
    # No launcher between the nodes: only gloo's error or its timeout can end rank 0.
    marker = tmp_path / "fault"
    args = [*fault_fit(tiny_synthetic, marker, action), "--trainer.num_nodes=2", "--trainer.devices=1"]
    port, processes = free_port(), []
    try:
        for node in (0, 1):
            (tmp_path / f"node{node}").mkdir()
            variables = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                         "NODE_RANK": str(node)}
            processes.append(start([sys.executable, "-m", "flowers", *args], tmp_path / f"node{node}", variables))
        out, ended = wait_for(processes[0], timeout=180)
        waited = ended - float(marker.read_text().split()[0])
        assert processes[0].returncode == 2, out[-3000:]
        if action == "exit":
            assert waited < 10, waited  # the closed socket, not the timeout
            assert "Connection reset by peer" in out or "Connection closed by peer" in out
        else:
            assert TIMEOUT_S - 1 < waited < TIMEOUT_S + 15, waited
            assert "Timed out" in out
        assert_peer_error(out)
        assert_epoch_0_checkpoint(tmp_path / "node0" / "runs" / "flowers" / "version_0")
    finally:
        for process in processes:
            kill(process)  # the hung rank 1 would sleep on for minutes
