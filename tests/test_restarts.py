"""Jobs that torchrun or SLURM restart resume their own run by themselves (flowers.restarts).

The launcher's variables are set as torchrun sets them on a restart; the runs are real ``fit`` runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from flowers import restarts


def test_a_restart_resumes_its_own_jobs_run_and_never_the_newest(in_tmp, tiny_synthetic, monkeypatch):
    from flowers.cli import cli_main
    from tests.conftest import TINY_RUN

    args = ["fit", *TINY_RUN, f"--data.data_dir={tiny_synthetic}", "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=1"]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    cli_main(args)  # job a: version_0, which records its job
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    cli_main(args)  # another job, newer: version_1
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    resumed = cli_main([*args, "--trainer.max_epochs=2", "--ckpt_path=last"])
    assert Path(resumed.trainer.log_dir).name == "version_0" and resumed.trainer.global_step == 4
    (record,) = [json.loads(line) for line in (in_tmp / "runs/flowers/version_0" / restarts.RESTARTS_FILE)
                 .read_text().splitlines()]
    assert record["attempt"] == 1 and record["global_step"] == 2
    assert record["previous_attempt"] == [{"rank": 0, "reason": restarts.NO_RECORD}]

    # A job restarted before it saved anything starts over, in a folder of its own.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-c")
    fresh = cli_main(args)
    assert Path(fresh.trainer.log_dir).name == "version_2" and fresh.trainer.global_step == 2


def test_the_job_comes_from_the_launchers_variables(monkeypatch):
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    assert restarts.current_job() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default: shared by every job, so not an id
    assert restarts.current_job() is None
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    assert restarts.current_job() == "slurm:123"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert restarts.current_job() == "torchrun:abc"


def test_a_restart_records_why_each_rank_of_the_attempt_before_ended(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-r")
    for rank in (0, 1):  # each rank notes its run folder when fit starts
        restarts.start("torchrun:job-r", tmp_path, global_rank=rank, world_size=2, restarted=False,
                       resumed_from=None, global_step=0)
    monkeypatch.setenv("RANK", "1")
    restarts.record_exit("DataError: a photo went missing")  # rank 1 ended with an error; rank 0 left no word
    for step in (7, 9):  # two restarts; in the second attempt no rank left a word
        restarts.start("torchrun:job-r", tmp_path, global_rank=0, world_size=2, restarted=True,
                       resumed_from="last.ckpt", global_step=step)
    first, second = [json.loads(line) for line in (tmp_path / restarts.RESTARTS_FILE).read_text().splitlines()]
    assert (first["attempt"], first["global_step"], second["attempt"], second["global_step"]) == (1, 7, 2, 9)
    assert first["previous_attempt"] == [{"rank": 0, "reason": restarts.NO_RECORD},
                                         {"rank": 1, "reason": "DataError: a photo went missing"}]
    assert second["previous_attempt"] == [{"rank": 0, "reason": restarts.NO_RECORD},
                                          {"rank": 1, "reason": restarts.NO_RECORD}]
    assert json.loads((tmp_path / restarts.JOB_FILE).read_text()) == {"job": "torchrun:job-r"}
