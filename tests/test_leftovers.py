"""Nothing left behind: a refused fit makes no run folder, and a save removes what a killed save left."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowers import files
from flowers.checkpointing import LastCheckpoint, atomic_torch_save
from flowers.cli import main
from tests.conftest import TINY_RUN
from tests.trained_run import trained_run

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


@pytest.fixture
def typo(request, in_tmp, tmp_path_factory, tiny_synthetic) -> tuple[list[str], str]:
    """The arguments of one typo, and words of the error it must get."""
    if request.param == "weights that fit another network":
        torch.save({"conv.weight": torch.zeros(3, 3)}, in_tmp / "weights.pth")
        return ["--model.weights=weights.pth"], "--model.weights weights.pth does not fit"
    if request.param == "init_from another backbone":
        ckpt = trained_run(tmp_path_factory, tiny_synthetic) / "checkpoints" / "last.ckpt"  # tutorial_alexnet
        return [f"--model.init_from={ckpt}", "--model.backbone=resnet18"], "holds a tutorial_alexnet network"
    if request.param == "a system folder as data":
        for name in ("apt", "ssh"):
            (in_tmp / "etc" / name).mkdir(parents=True)
            (in_tmp / "etc" / name / "config").write_text("no images")
        return ["--data.data_dir=etc"], "'etc/apt' holds no images"
    return ["--data.num_workers=-1"], "data.num_workers=-1"


@pytest.mark.parametrize("typo", ["weights that fit another network", "init_from another backbone",
                                  "a system folder as data", "num_workers=-1"], indirect=True)
def test_a_fit_refused_by_its_checks_makes_no_run_folder(typo, in_tmp, tiny_synthetic, capsys):
    args, words = typo
    data = [] if any(arg.startswith("--data.data_dir") for arg in args) else [f"--data.data_dir={tiny_synthetic}"]
    assert main(["fit", *TINY_RUN, *data, *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("flowers: error: ")
    assert words in err
    assert not (in_tmp / "runs").exists()
