"""Which checkpoint a command starts from and which run folder it continues, decided from the settings and the run
folders alone (flowers.resume.plan), before anything is built."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flowers import resume
from flowers.errors import ConfigError


def checkpoint(root: Path, version: int, name: str = "last.ckpt", *, job: str | None = None, age_s: int = 0) -> Path:
    """An empty checkpoint file in ``root/flowers/version_N/checkpoints/``: the plan reads names and times only."""
    folder = root / "flowers" / f"version_{version}"
    path = folder / "checkpoints" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    stamp = 1_700_000_000 - age_s
    os.utime(path, (stamp, stamp))
    if job is not None:
        (folder / "job.json").write_text(json.dumps({"job": job}))
    return path


def test_a_new_fit_loads_nothing_and_names_no_folder(tmp_path):
    plan = resume.plan("fit", None, save_dir=str(tmp_path), name="flowers")
    assert plan == resume.Plan(ckpt_path=None) and not plan.resumes


@pytest.mark.parametrize("name", resume.REFUSED_CKPT_NAMES)
def test_checkpoint_names_flowers_cannot_check_first_are_refused(tmp_path, name):
    with pytest.raises(ConfigError, match=f"--ckpt_path {name}: flowers loads only checkpoints it can check"):
        resume.plan("fit", name, save_dir=str(tmp_path), name="flowers")


def test_last_is_the_newest_runs_last_and_a_fit_continues_that_runs_folder(tmp_path):
    checkpoint(tmp_path, 0, age_s=60)
    newest = checkpoint(tmp_path, 1)
    checkpoint(tmp_path, 2, age_s=120)
    plan = resume.plan("fit", "last", save_dir=str(tmp_path), name="flowers")
    assert plan.ckpt_path == str(newest) and plan.version == "version_1" and not plan.restarted
    assert plan.notes == (f"--ckpt_path: {newest}", f"Resuming {tmp_path}/flowers/version_1 from {newest}")


def test_best_is_the_newest_runs_best_checkpoint_and_evaluation_continues_no_folder(tmp_path):
    best = checkpoint(tmp_path, 3, "best-epoch=04-val_acc=0.8000.ckpt")
    checkpoint(tmp_path, 3)
    plan = resume.plan("validate", "best", save_dir=str(tmp_path), name="flowers")
    assert plan.ckpt_path == str(best) and plan.version is None


def test_a_chosen_logger_folder_is_kept_and_a_checkpoint_elsewhere_starts_a_new_folder(tmp_path):
    own = checkpoint(tmp_path, 0)
    assert resume.plan("fit", str(own), save_dir=str(tmp_path), name="flowers", folder_chosen=True).version is None
    moved = tmp_path / "elsewhere.ckpt"
    moved.write_bytes(b"")
    plan = resume.plan("fit", str(moved), save_dir=str(tmp_path), name="flowers")
    assert plan.ckpt_path == str(moved) and plan.version is None and plan.notes == ()


def test_last_with_no_run_says_how_to_get_one(tmp_path):
    with pytest.raises(ConfigError, match="no .*version_\\*/checkpoints/ holds a last.ckpt here"):
        resume.plan("fit", "last", save_dir=str(tmp_path), name="flowers")


def test_a_restarted_job_goes_on_with_its_own_run_not_the_newest(tmp_path):
    own = checkpoint(tmp_path, 0, job="torchrun:abc", age_s=300)
    checkpoint(tmp_path, 1, job="torchrun:other")  # newer, another job's
    for ckpt_path in (None, "last"):
        plan = resume.plan("fit", ckpt_path, job="torchrun:abc", save_dir=str(tmp_path), name="flowers")
        assert plan.ckpt_path == str(own) and plan.restarted and plan.version == "version_0"
        assert plan.notes[0] == f"torchrun:abc started again: resuming its own run from {own}"


def test_a_job_that_saved_nothing_yet_starts_fresh_and_an_explicit_checkpoint_wins(tmp_path):
    plan = resume.plan("fit", None, job="slurm:7", save_dir=str(tmp_path), name="flowers")
    assert plan == resume.Plan(ckpt_path=None)
    checkpoint(tmp_path, 0, job="slurm:7")
    chosen = checkpoint(tmp_path, 1)
    plan = resume.plan("fit", str(chosen), job="slurm:7", save_dir=str(tmp_path), name="flowers")
    assert plan.ckpt_path == str(chosen) and not plan.restarted and plan.version == "version_1"
