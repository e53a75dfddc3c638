"""Checkpoint writes are atomic: a failed or killed save keeps the previous file whole, says so in one paragraph,
and whatever a killed save left is removed by the next save, never a live writer's file.

Kills in the middle of a training run, and the resume after them, are in tests/test_resume.py.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import flowers.checkpoint_writer
from flowers import files, runs
from flowers.checkpoint_writer import atomic_torch_save
from flowers.checkpointing import LastCheckpoint
from flowers.cli import cli_main
from flowers.errors import CheckpointWriteError
from tests.helpers.processes import child_env
from tests.helpers.runs import TINY_RUN

BATCHES = ["--trainer.limit_train_batches=3", "--trainer.limit_val_batches=1"]
LAST = Path("runs/flowers/version_0/checkpoints/last.ckpt")


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

    monkeypatch.setattr(flowers.checkpoint_writer.torch, "save", broken_save)
    kept = r"last.ckpt \(No space left on device\)\. The previous last.ckpt is untouched"
    with pytest.raises(CheckpointWriteError, match=kept):
        atomic_torch_save({"step": torch.tensor(2)}, target)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temporary file left behind
    monkeypatch.undo()
    assert int(torch.load(target, weights_only=True)["step"]) == 1


def test_the_trainer_writes_checkpoints_through_the_atomic_writer(in_tmp, tiny_synthetic, monkeypatch):
    written = []
    real = flowers.checkpoint_writer.atomic_torch_save
    monkeypatch.setattr(flowers.checkpoint_writer, "atomic_torch_save", lambda obj, path: (written.append(path),
                                                                                       real(obj, path)))
    cli = cli_main(["fit", *TINY_RUN, f"--data.data_dir={tiny_synthetic}", *BATCHES])
    names = sorted(Path(p).name for p in written)
    assert "last.ckpt" in names and any(n.startswith("best-") for n in names)
    assert Path(runs.last_checkpoint(cli.trainer)).is_file()


# A process that dies in the middle of atomic_write, as under kill -9: it blocks inside the write callback.
# flowers.files is loaded by its path, so the child starts in a fraction of a second (no torch, no Lightning).
WRITER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("files", sys.argv[1])
files = importlib.util.module_from_spec(spec)
spec.loader.exec_module(files)

def write(file):
    file.write(b"half a checkpoint" * 100_000)
    file.flush()
    print("writing", flush=True)
    time.sleep(600)

files.atomic_write(sys.argv[2], write)
"""


def start_writer(target: Path) -> subprocess.Popen:
    writer = subprocess.Popen([sys.executable, "-c", WRITER, files.__file__, str(target)], stdout=subprocess.PIPE,
                              text=True)
    assert writer.stdout.readline() == "writing\n"
    return writer


def temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob(".*.tmp"))


def test_a_save_removes_what_a_killed_save_left_and_nothing_a_live_one_writes(tmp_path):
    target = tmp_path / "last.ckpt"
    killed, alive = start_writer(target), start_writer(target)
    try:
        killed.kill()  # SIGKILL: no except, no finally; its temporary file stays
        killed.wait()
        other = tmp_path / f".best.ckpt.{killed.pid}@{files._HOST}.abcd1234.tmp"  # another target's, kept
        other.write_bytes(b"x")
        old = tmp_path / ".last.ckpt.k2j4h5g6.tmp"  # a writer that named no process, untouched since before
        old.write_bytes(b"x")
        os.utime(old, (files.STARTED - 60, files.STARTED - 60))
        assert len(temporaries(tmp_path)) == 4

        atomic_torch_save({"step": torch.tensor(1)}, target)

        left = temporaries(tmp_path)
        assert [name for name in left if name.startswith(f".last.ckpt.{alive.pid}@")]  # still being written
        assert other.name in left and len(left) == 2
        assert int(torch.load(target, weights_only=True)["step"]) == 1
    finally:
        alive.kill()
        alive.wait()


def test_a_run_start_removes_what_a_killed_save_of_any_of_its_checkpoints_left(tmp_path):
    # A best checkpoint's next save has another name, so the run's start (a resume) removes its leftovers.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".best-epoch=03-val_acc=0.9000.ckpt.{dead.stdout.strip()}@{files._HOST}.abcd1234.tmp"
    stale.write_bytes(b"x")
    live = tmp_path / f".last.ckpt.{os.getpid()}@{files._HOST}.abcd1234.tmp"
    live.write_bytes(b"x")
    kept = tmp_path / f".config.yaml.{dead.stdout.strip()}@{files._HOST}.abcd1234.tmp"  # not a checkpoint's
    kept.write_bytes(b"x")
    callback = LastCheckpoint(dirpath=tmp_path, filename="last")
    callback.on_train_start(SimpleNamespace(is_global_zero=True), None)
    assert temporaries(tmp_path) == sorted([live.name, kept.name])


def _file_size_limit(limit: int):
    def apply() -> None:
        # The kernel then fails every write past `limit` bytes (EFBIG), as a full disk fails them (ENOSPC).
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_checkpoint_write_that_the_disk_refuses_stops_with_one_paragraph_and_keeps_last(in_tmp, tiny_synthetic):
    fit = ["fit", *TINY_RUN, f"--data.data_dir={tiny_synthetic}", *BATCHES]
    cli_main(fit)  # the first epoch in this process: only the resume needs the size limit of a child's own
    before = (in_tmp / LAST).read_bytes()
    args = [sys.executable, "-m", "flowers", *fit]

    # The resumed epoch's checkpoint (tens of MB) cannot be written; the small logs and configs can.
    resumed = subprocess.run([*args, "--trainer.max_epochs=2", "--ckpt_path=last"], env=child_env(), text=True,
                             capture_output=True, preexec_fn=_file_size_limit(4 * 2**20), timeout=300)
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr
    assert re.search(r"could not write the checkpoint \S+\.ckpt \(File too large\)\. The previous \S+ is untouched",
                     resumed.stderr), resumed.stderr[-3000:]
    assert "--ckpt_path last" in resumed.stderr
    assert (in_tmp / LAST).read_bytes() == before
    assert not list(in_tmp.rglob("*.tmp"))  # no half-written temporary file left behind
    assert torch.load((in_tmp / LAST), map_location="cpu", weights_only=True)["epoch"] == 0
