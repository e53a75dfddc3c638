"""Runs restarted by their launcher resume themselves: torchrun ``--max-restarts`` and sbatch ``--requeue``.

A launcher that restarts a job starts the same command again under the job's own id (``TORCHELASTIC_RUN_ID``:
torchrun's ``--rdzv-id``; ``SLURM_JOB_ID``). The job's first start records that id in its run folder
(``job.json``); a later start of the same job finds that folder and resumes its ``last.ckpt``, never another
run's. The restart count in the environment is not used: torchrun keeps one per machine, and a machine whose
workers were restarted because another machine's failed does not count it.

Each restart is recorded in the run folder (``restarts.jsonl``): when, which attempt, the checkpoint it resumed
from, and each rank of the attempt before with the reason it ended. A rank records its reason
(``attempts/rank<r>.json``) when it ends with an error; the restart reads and clears those records. A rank that
left none was killed (SIGKILL, the out-of-memory killer, a lost machine) or stopped by the launcher because
another rank failed.

Not Lightning's ``SLURMEnvironment(auto_requeue=True)`` alone: it saves an ``hpc_ckpt`` only on the signal SLURM sends
before a time limit (not when a node dies, nor under torchrun), and loads it unchecked from the working folder;
``last.ckpt`` is at most a minute old whatever ended the job, and goes through the checkpoint reader.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from flowers import runs
from flowers.files import atomic_write_text

JOB_FILE = "job.json"
RESTARTS_FILE = "restarts.jsonl"
ATTEMPTS = "attempts"
NO_RECORD = ("no record: killed by a signal (SIGKILL, the out-of-memory killer, a lost machine) or stopped by "
             "the launcher after another rank failed")

_run_folder: Path | None = None  # this process's run folder, once fit has started: where its exit reason goes


def current_job() -> str | None:
    """This process's job, when a launcher that restarts jobs started it: ``torchrun:<id>`` or ``slurm:<id>``."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":  # torchrun's default id is "none": every job would share it
        return f"torchrun:{run_id}"
    if job_id := os.environ.get("SLURM_JOB_ID"):
        return f"slurm:{job_id}"
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


def own_last_checkpoint(job: str, save_dir: str | os.PathLike, name: str) -> Path | None:
    """The last.ckpt of the run this job started, if it got as far as saving one."""
    folder = run_folder_of(job, save_dir, name)
    last = folder / runs.CHECKPOINTS / f"{runs.LAST}.ckpt" if folder is not None else None
    return last if last is not None and last.is_file() else None


def start(job: str, run_folder: Path, *, global_rank: int, world_size: int, restarted: bool,
          resumed_from: str | None, global_step: int) -> None:
    """At fit's start: note the run folder; on rank 0, record the job (first start) or the restart."""
    global _run_folder
    _run_folder = Path(run_folder)
    if global_rank != 0:
        return
    _run_folder.mkdir(parents=True, exist_ok=True)
    if not restarted:  # a run folder of its own: later restarts find it
        atomic_write_text(_run_folder / JOB_FILE, json.dumps({"job": job}))
        return
    records = _run_folder / RESTARTS_FILE
    attempt = 1 + (len(records.read_text().splitlines()) if records.is_file() else 0)
    ranks = []
    for rank in range(world_size):
        record = _run_folder / ATTEMPTS / f"rank{rank}.json"
        try:
            reason = json.loads(record.read_text())["reason"]
            record.unlink()  # read once: a rank that leaves no word next time must not show this reason again
        except (OSError, ValueError, KeyError):
            reason = NO_RECORD
        ranks.append({"rank": rank, "reason": reason})
    line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "attempt": attempt, "resumed_from": resumed_from,
            "global_step": global_step, "previous_attempt": ranks}
    with open(records, "a") as file:
        file.write(json.dumps(line) + "\n")


def record_exit(reason: str) -> None:
    """Why this rank ends with an error, for the restart's record (nothing before fit has started)."""
    if _run_folder is None or current_job() is None:
        return
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    try:
        folder = _run_folder / ATTEMPTS
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / f"rank{rank}.json", json.dumps({"reason": reason}))
    except OSError:
        pass  # the record is a courtesy: never let it hide the error itself
