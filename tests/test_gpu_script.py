"""benchmarks/gpu/run_all.sh: every GPU check and figure runs its real code on the CPU (``--smoke``), and a step that
fails or runs out of time fails the script while the others still report (no timings checked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_ALL = ROOT / "benchmarks" / "gpu" / "run_all.sh"
STEPS = ("env", "checks", "throughput", "accuracy", "anatomy", "ceiling", "tta")


def run_all(tmp_path: Path, *args: str, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("STEPS", "DATA", "RESULTS", "WORK")}
    environment.update(PYTHON=sys.executable, RESULTS=str(tmp_path / "results"), WORK=str(tmp_path / "work"), **env)
    return subprocess.run(["bash", str(RUN_ALL), *args], env=environment, capture_output=True, text=True,
                          timeout=timeout, cwd=tmp_path)


def steps_file(tmp_path: Path) -> dict[str, str]:
    lines = (tmp_path / "results" / "steps.tsv").read_text().splitlines()
    return {line.split("\t")[0]: line.split("\t")[1] for line in lines}


@pytest.mark.slow
def test_smoke_runs_every_step_and_prints_every_table(tmp_path):
    # About two minutes on 2 cores: a dozen processes, each importing torch and Lightning.
    done = run_all(tmp_path, "--smoke", timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert steps_file(tmp_path) == dict.fromkeys(STEPS, "ok")
    results = tmp_path / "results"
    report = (results / "report.txt").read_text()
    for step in STEPS:
        assert f"==== {step}: ok" in report, step
        assert (results / f"{step}.txt").stat().st_size > 0, step
    checks = (results / "checks.txt").read_text()
    assert " passed" in checks and "failed" not in checks
    assert "checks CUDA itself: no CPU equivalent" in checks  # the host-sync check says why it skipped on the CPU
    assert "val acc c − a, paired by seed" in (results / "accuracy.txt").read_text()
    assert "augmentation (on_after_batch_transfer)" in (results / "anatomy.txt").read_text()
    assert "--network free" in (results / "ceiling.txt").read_text()
    assert "recompiles: 0" in (results / "throughput.txt").read_text()


def test_a_step_that_runs_out_of_time_fails_the_script_and_the_others_still_report(tmp_path):
    done = run_all(tmp_path, "--smoke", STEPS="env ceiling", CEILING_S="1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert steps_file(tmp_path) == {"env": "ok", "ceiling": "timed out after 1s"}
    assert "==== env: ok" in done.stdout and "==== ceiling: timed out after 1s" in done.stdout
    assert "failed: ceiling" in done.stderr


def test_a_step_that_fails_fails_the_script(tmp_path):
    done = run_all(tmp_path, STEPS="ceiling", DATA=str(tmp_path / "nowhere"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert steps_file(tmp_path) == {"ceiling": "failed (exit 2)"}
    assert "does not exist" in (tmp_path / "results" / "ceiling.log").read_text()


def test_unknown_steps_and_arguments_are_refused(tmp_path):
    done = run_all(tmp_path, STEPS="env bench")
    assert done.returncode == 2 and "unknown step bench" in done.stderr
    done = run_all(tmp_path, "--smok")
    assert done.returncode == 2 and "unknown argument --smok" in done.stderr
    assert "--smoke" in run_all(tmp_path, "--help").stdout
