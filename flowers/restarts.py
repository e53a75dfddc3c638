"""Runs restarted by their launcher resume themselves: torchrun ``--max-restarts`` and sbatch ``--requeue``.

A launcher that restarts a job starts the same command again, with a restart count in the environment
(``TORCHELASTIC_RESTART_COUNT``, ``SLURM_RESTART_COUNT``) and the job's own id (``TORCHELASTIC_RUN_ID``:
torchrun's ``--rdzv-id``; ``SLURM_JOB_ID``). The first attempt records that id in its run folder
(``job.json``); a restart finds the run folder with its id and resumes that run's ``last.ckpt``, never
another run's. Each restart is recorded in the run folder (``restarts.jsonl``): when, which attempt, the
checkpoint it resumed from, and each rank of the attempt before with the reason it ended.

A rank records its reason (``attempts/<attempt>-rank<r>.json``) when it ends with an error; a rank that
left no record was killed (SIGKILL, the out-of-memory killer, a lost machine) or stopped by the launcher
because another rank failed.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from flowers import runs
from flowers.files import atomic_write_text

JOB_FILE = "job.json"
RESTARTS_FILE = "restarts.jsonl"
ATTEMPTS = "attempts"
NO_RECORD = ("no record: killed by a signal (SIGKILL, the out-of-memory killer, a lost machine) or stopped by "
             "the launcher after another rank failed")

_run_folder: Path | None = None  # this process's run folder, once fit has started: where its exit reason goes


@dataclass(frozen=True)
class Attempt:
    job: str  # "torchrun:<rdzv id>" or "slurm:<job id>"
    number: int  # 0 for the first start, then one more per restart

    @property
    def is_restart(self) -> bool:
        return self.number > 0


def current_attempt() -> Attempt | None:
    """This process's job and attempt, when a launcher that restarts jobs started it."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":  # torchrun's default id is "none": every job would share it
        return Attempt(f"torchrun:{run_id}", int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    if job_id := os.environ.get("SLURM_JOB_ID"):
        return Attempt(f"slurm:{job_id}", int(os.environ.get("SLURM_RESTART_COUNT", 0)))
    return None


def run_folder_of(job: str, save_dir: str | os.PathLike, name: str) -> Path | None:
    """The newest run folder this job started (a restart before the first save starts another)."""
    folders = [f for f in Path(save_dir, name).glob("version_*") if f.name.removeprefix("version_").isdigit()]
    for folder in sorted(folders, key=lambda f: int(f.name.removeprefix("version_")), reverse=True):
        try:
            if json.loads((folder / JOB_FILE).read_text()).get("job") == job:
                return folder
        except (OSError, ValueError):
            continue
    return None


def own_last_checkpoint(attempt: Attempt, save_dir: str | os.PathLike, name: str) -> Path | None:
    """The last.ckpt of the run this job started, if it got as far as saving one."""
    folder = run_folder_of(attempt.job, save_dir, name)
    last = folder / runs.CHECKPOINTS / f"{runs.LAST}.ckpt" if folder is not None else None
    return last if last is not None and last.is_file() else None


def start(attempt: Attempt, run_folder: Path, *, global_rank: int, world_size: int, resumed_from: str | None,
          global_step: int) -> None:
    """At fit's start: note the run folder; on rank 0, record the job (first attempt) or the restart."""
    global _run_folder
    _run_folder = Path(run_folder)
    if global_rank != 0:
        return
    _run_folder.mkdir(parents=True, exist_ok=True)
    if not attempt.is_restart or resumed_from is None:  # a run folder of its own: later restarts find it
        atomic_write_text(_run_folder / JOB_FILE, json.dumps({"job": attempt.job}))
    if not attempt.is_restart:
        return
    previous = attempt.number - 1
    ranks = []
    for rank in range(world_size):
        record = _run_folder / ATTEMPTS / f"{previous}-rank{rank}.json"
        try:
            reason = json.loads(record.read_text())["reason"]
        except (OSError, ValueError, KeyError):
            reason = NO_RECORD
        ranks.append({"rank": rank, "reason": reason})
    line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "attempt": attempt.number, "resumed_from": resumed_from,
            "global_step": global_step, "previous_attempt": ranks}
    with open(_run_folder / RESTARTS_FILE, "a") as file:
        file.write(json.dumps(line) + "\n")


def record_exit(reason: str) -> None:
    """Why this rank ends with an error, for the restart's record (nothing before fit has started)."""
    attempt = current_attempt()
    if _run_folder is None or attempt is None:
        return
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    try:
        folder = _run_folder / ATTEMPTS
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / f"{attempt.number}-rank{rank}.json", json.dumps({"reason": reason}))
    except OSError:
        pass  # the record is a courtesy: never let it hide the error itself
