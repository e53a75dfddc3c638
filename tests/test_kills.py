"""``kill -9`` at a bad moment leaves a loadable ``last.ckpt`` and the run resumes to the end.

The children are real ``python -m flowers fit`` processes. A test-only callback (below, loaded with
``--trainer.callbacks+=tests.test_kills.Pause``) writes a marker file at the chosen moment and then waits,
so the SIGKILL lands exactly there rather than at a random point of a run that takes seconds.
"""

from __future__ import annotations

import io
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

import flowers.checkpointing
from flowers import runs
from flowers.checkpointing import atomic_torch_save
from flowers.cli import cli_main
from flowers.errors import CheckpointWriteError
from tests.conftest import TINY_RUN
from tests.test_ddp import child_env, kill, start

REAL_SAVE = torch.save
BATCHES = ["--trainer.limit_train_batches=3", "--trainer.limit_val_batches=1"]


class Pause(L.Callback):
    """In epoch 1, at ``moment``, write ``marker`` and wait to be killed.

    ``moment``: "train" (mid-epoch, after a training batch), "validation" (mid-validation), or "write"
    (inside the checkpoint write: half of last.ckpt's bytes are out when the process dies).
    """

    def __init__(self, marker: str, moment: str) -> None:
        self.marker, self.moment = Path(marker), moment

    def _stop_here(self) -> None:
        self.marker.write_text(str(os.getpid()))
        time.sleep(120)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.moment == "train" and trainer.current_epoch == 1 and batch_idx == 1:
            self._stop_here()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.moment == "validation" and trainer.current_epoch == 1 and not trainer.sanity_checking:
            self._stop_here()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self.moment == "write" and trainer.current_epoch == 1:
            flowers.checkpointing.torch.save = self._die_halfway

    def _die_halfway(self, obj, file) -> None:
        buffer = io.BytesIO()
        REAL_SAVE(obj, buffer)
        file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        file.flush()
        self.marker.write_text(str(os.getpid()))
        os._exit(137)  # what SIGKILL looks like to the parent: no cleanup, no except/finally


def wait_for(path: Path, process, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            pytest.fail(f"the child ended (status {process.returncode}) before the marker:\n{process.stdout.read()}")
        if time.monotonic() > deadline:
            kill(process)
            pytest.fail("the child never reached the marker")
        time.sleep(0.2)


def last_checkpoint(root: Path) -> Path:
    return root / "runs" / "flowers" / "version_0" / "checkpoints" / "last.ckpt"


@pytest.mark.parametrize("moment", ["train", "validation", "write"])
def test_kill_9_leaves_a_loadable_last_ckpt_and_the_run_resumes(moment, in_tmp, tiny_synthetic):
    marker = in_tmp / "marker"
    args = [*TINY_RUN, f"--data.data_dir={tiny_synthetic}", *BATCHES]
    child = start([sys.executable, "-m", "flowers", "fit", *args, "--trainer.max_epochs=3",
                   "--trainer.callbacks+=tests.test_kills.Pause", f"--trainer.callbacks.marker={marker}",
                   f"--trainer.callbacks.moment={moment}"], in_tmp)
    wait_for(marker, child)
    kill(child)
    assert child.returncode != 0

    # Epoch 0's checkpoint, whole: the killed epoch left no partial file in its place.
    saved = torch.load(last_checkpoint(in_tmp), map_location="cpu", weights_only=True)
    assert (saved["epoch"], saved["global_step"]) == (0, 3)
    if moment == "write":
        # The half-written temporary file sits beside it, hidden, and is never mistaken for a checkpoint.
        assert [p.name for p in last_checkpoint(in_tmp).parent.glob(".last.ckpt.*.tmp")]

    # Finish the killed epoch 1 (max_epochs=2 keeps the test short; the child would have run 3).
    resumed = cli_main(["fit", *args, "--trainer.max_epochs=2", "--ckpt_path=last"])
    assert resumed.trainer.current_epoch == 2 and resumed.trainer.global_step == 6
    final = torch.load(last_checkpoint(in_tmp), map_location="cpu", weights_only=True)
    assert (final["epoch"], final["global_step"]) == (1, 6)


def test_a_checkpoint_gets_the_permissions_a_plain_save_would(tmp_path):
    # The temporary file it is renamed from is private (mkstemp's 0600): others in the group could not read it.
    previous = os.umask(0o027)
    try:
        atomic_torch_save({"step": torch.tensor(1)}, tmp_path / "last.ckpt")
        torch.save({"step": torch.tensor(1)}, tmp_path / "plain.ckpt")
    finally:
        os.umask(previous)
    assert (tmp_path / "last.ckpt").stat().st_mode & 0o777 == (tmp_path / "plain.ckpt").stat().st_mode & 0o777 == 0o640


def test_an_exception_inside_the_write_keeps_the_previous_file_and_cleans_up(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    atomic_torch_save({"step": torch.tensor(1)}, target)
    before = target.read_bytes()

    def broken_save(obj, file):
        file.write(b"PK\x03\x04 half a zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(flowers.checkpointing.torch, "save", broken_save)
    kept = r"last.ckpt \(No space left on device\)\. The previous last.ckpt is untouched"
    with pytest.raises(CheckpointWriteError, match=kept):
        atomic_torch_save({"step": torch.tensor(2)}, target)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temporary file left behind
    monkeypatch.undo()
    assert int(torch.load(target, weights_only=True)["step"]) == 1


def test_the_trainer_writes_checkpoints_through_the_atomic_writer(in_tmp, tiny_synthetic, monkeypatch):
    written = []
    real = flowers.checkpointing.atomic_torch_save
    monkeypatch.setattr(flowers.checkpointing, "atomic_torch_save", lambda obj, path: (written.append(path),
                                                                                       real(obj, path)))
    cli = cli_main(["fit", *TINY_RUN, f"--data.data_dir={tiny_synthetic}", *BATCHES])
    names = sorted(Path(p).name for p in written)
    assert "last.ckpt" in names and any(n.startswith("best-") for n in names)
    assert Path(runs.last_checkpoint(cli.trainer)).is_file()


def _file_size_limit(limit: int):
    def apply() -> None:
        # The kernel then fails every write past `limit` bytes (EFBIG), as a full disk fails them (ENOSPC).
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_checkpoint_write_that_the_disk_refuses_stops_with_one_paragraph_and_keeps_last(in_tmp, tiny_synthetic):
    args = [sys.executable, "-m", "flowers", "fit", *TINY_RUN, f"--data.data_dir={tiny_synthetic}", *BATCHES]
    subprocess.run(args, check=True, env=child_env(), capture_output=True)
    before = last_checkpoint(in_tmp).read_bytes()

    # The resumed epoch's checkpoint (tens of MB) cannot be written; the small logs and configs can.
    resumed = subprocess.run([*args, "--trainer.max_epochs=2", "--ckpt_path=last"], env=child_env(), text=True,
                             capture_output=True, preexec_fn=_file_size_limit(4 * 2**20), timeout=300)
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr
    assert re.search(r"could not write the checkpoint \S+\.ckpt \(File too large\)\. The previous \S+ is untouched",
                     resumed.stderr), resumed.stderr[-3000:]
    assert "--ckpt_path last" in resumed.stderr
    assert last_checkpoint(in_tmp).read_bytes() == before
    assert not list(in_tmp.rglob("*.tmp"))  # no half-written temporary file left behind
    assert torch.load(last_checkpoint(in_tmp), map_location="cpu", weights_only=True)["epoch"] == 0
