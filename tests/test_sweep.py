"""flowers sweep: an Optuna study whose trials are real `flowers fit` processes on tiny synthetic flowers."""

from __future__ import annotations

import csv
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers.processes import finish, kill, run_flowers, start

optuna = pytest.importorskip("optuna", reason="flowers sweep runs on Optuna (pip install -e '.[sweep]')")

# Two epochs of a tiny run: each trial validates twice, so the pruner has something to judge.
TRIAL_ARGS = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.max_epochs=2",
              "--trainer.enable_progress_bar=false", "--data.image_size=64", "--data.batch_size=4",
              "--data.num_workers=0", "--model.fused_optimizer=true", "--trainer.deterministic=true"]
LR = "model.optimizer.init_args.lr"


def write_sweep(folder: Path, data: Path, **entries) -> Path:
    sweep = {"fit": [str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")],
             "args": [*TRIAL_ARGS, f"--data.data_dir={data}"],
             "space": {LR: {"low": 0.0001, "high": 10.0, "log": True},
                       "data.crop_scale": {"choices": [[0.6, 1.0], [0.9, 1.0]]}},
             "metric": "val/loss", "direction": "minimize", "trials": 4, "heartbeat_s": 5,
             "sampler": {"name": "random", "seed": 3}, **entries}
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    return path


def sweep_command(path: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "flowers", "sweep", "--config", str(path), *args]


def trials_of(folder: Path, name: str = "tiny", storage: str | None = None) -> list:
    """The study's trials; none while the sweep has yet to make it."""
    from flowers.sweep.study import storage as opened

    url = storage or f"sqlite:///{folder / 'runs' / 'sweeps' / name / 'study.db'}"
    try:  # opened as the sweep opens it: it waits for a sweep that is creating the tables at this moment
        return optuna.load_study(study_name=name, storage=opened(url)).get_trials()
    except KeyError:
        return []


def finished(trials) -> list:
    return [t for t in trials if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)]


# --- bad sweep files and command lines: one line, exit 2, nothing created -----------------------------------

def run_sweep(args: list[str], capsys) -> tuple[int, str]:
    from flowers.sweep import main

    code = main(args)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("change", "said"), [
    ({"space": {"model.optimizer.init_args.lrr": {"low": 0.1, "high": 1.0}}}, "space.model.optimizer.init_args.lrr"),
    ({"space": {LR: {"low": 0.1, "high": 0.01}}}, "low (0.1) must be below high (0.01)"),
    ({"space": {LR: {"low": 0.0, "high": 0.01, "log": True}}}, "a log range needs low above 0"),
    ({"space": {}}, "space is empty"),
    ({"space": {"data.batch_size": {"choices": ["many", 8]}}}, "space.data.batch_size at 'many': fit refuses it"),
    ({"trials": 0}, "trials is a whole number of at least 1"),
    ({"pruner": "sometimes"}, "pruner is one of median, hyperband, none"),
    ({"pruner": {"name": "median", "n_startup": 2}}, "the sweep's pruner MedianPruner refuses"),
    ({"fit": ["nowhere.yaml"]}, "fit names nowhere.yaml, which is not a file"),
    ({"epochs": 3}, "unknown entries 'epochs'"),
    ({"storage": "postgresql://flowers@127.0.0.1:9/none"}, "cannot open the study's storage"),
    ({"enqueue": [{"data.crop_scale": [0.1, 1.0]}]}, "which is not one of its choices"),
])
def test_a_bad_sweep_file_is_one_line_exit_2_and_creates_nothing(in_tmp, tiny_synthetic, capsys, change, said):
    path = write_sweep(in_tmp, tiny_synthetic, **change)
    code, err = run_sweep(["--config", str(path)], capsys)
    assert code == 2
    assert err.startswith("flowers sweep: error: ") and said in err and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert sorted(p.name for p in in_tmp.iterdir()) == ["tiny.yaml"]


def test_a_fit_flag_fit_does_not_know_and_a_missing_file_are_refused(in_tmp, tiny_synthetic, capsys):
    path = write_sweep(in_tmp, tiny_synthetic)
    code, err = run_sweep(["--config", str(path), "--trainer.max_epoch", "3"], capsys)
    assert code == 2 and "fit refuses its configs or flags" in err and "max_epoch" in err, err
    code, err = run_sweep(["--config", str(in_tmp / "none.yaml")], capsys)
    assert code == 2 and "the sweep file" in err and "does not exist" in err, err
    assert sorted(p.name for p in in_tmp.iterdir()) == ["tiny.yaml"]


def test_a_sweep_file_reads_into_its_settings(tmp_path):
    from flowers.sweep import fit_flags
    from flowers.sweep.spec import read

    path = write_sweep(tmp_path, tmp_path, space={LR: {"low": "1e-4", "high": 0.01, "log": True},
                                                 "data.batch_size": {"low": 8, "high": 32, "step": 8},
                                                 "data.crop_scale": {"choices": [[0.5, 1.0], [0.8, 1.0]]}})
    sweep = read(path, extra_args=fit_flags(["--seed_everything", "7"]))
    lr, batch, crop = sweep.space
    assert (lr.low, lr.log, lr.is_int) == (0.0001, True, False)
    assert (batch.is_int, batch.corners()) == (True, [8, 32])
    assert crop.corners() == [[0.5, 1.0], [0.8, 1.0]]
    assert sweep.args[-1] == "--seed_everything=7" and sweep.folder == Path("runs/sweeps/tiny")
    assert sweep.fit_words({"data.crop_scale": [0.5, 1.0]})[-1] == "--data.crop_scale=[0.5, 1.0]"


def test_a_study_joined_with_another_space_is_refused(tmp_path):
    from flowers.errors import ConfigError
    from flowers.sweep.choices import make_pruner, make_sampler
    from flowers.sweep.spec import read
    from flowers.sweep.study import open_study

    url = f"sqlite:///{tmp_path / 'study.db'}"
    first = read(write_sweep(tmp_path, tmp_path, enqueue=[{LR: 0.001}]))
    study, _ = open_study(first, url, make_sampler(first.sampler), make_pruner(first.pruner))
    assert [t.system_attrs["fixed_params"] for t in study.get_trials()] == [{LR: 0.001}]  # enqueued by its maker
    open_study(first, url, make_sampler(first.sampler), make_pruner(first.pruner))
    assert len(study.get_trials()) == 1
    other = read(write_sweep(tmp_path, tmp_path, direction="maximize"))
    with pytest.raises(ConfigError, match="searches another space, metric or direction"):
        open_study(other, url, make_sampler(other.sampler), make_pruner(other.pruner))


def test_a_trial_another_sweep_failed_stops_its_run_and_is_not_told_again(tmp_path, capsys):
    # Under load a heartbeat can come later than the grace period: another machine then fails the trial and
    # queues it again, while its run goes on.
    from types import SimpleNamespace

    from flowers.sweep.choices import make_pruner, make_sampler
    from flowers.sweep.report import ReportToStudy
    from flowers.sweep.spec import read
    from flowers.sweep.study import Workers, open_study

    url = f"sqlite:///{tmp_path / 'study.db'}"
    sweep = read(write_sweep(tmp_path, tmp_path))
    study, database = open_study(sweep, url, make_sampler(sweep.sampler), make_pruner(sweep.pruner))
    trial = study.ask()
    study.tell(trial.number, state=optuna.trial.TrialState.FAIL)  # as the other machine's stale check does

    trainer = SimpleNamespace(sanity_checking=False, callback_metrics={"val/loss": 0.5}, is_global_zero=True,
                              current_epoch=0, should_stop=False, strategy=SimpleNamespace(broadcast=lambda x, src: x))
    trial_id = database.get_trial_id_from_study_id_trial_number(database.get_study_id_from_name(sweep.name), 0)
    reporter = ReportToStudy(url, sweep.name, trial_id, metric="val/loss")
    with pytest.warns(UserWarning, match="failed by another sweep of the study: this run stops"):
        reporter.on_validation_end(trainer, None)
    assert trainer.should_stop

    Workers(sweep, study, database, url)._tell(trial, 0, tmp_path / "trial_000.log")
    assert "trial 0 was failed by another sweep" in capsys.readouterr().out
    assert [t.state.name for t in study.get_trials()] == ["FAIL"]


# --- real sweeps ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_two_workers_share_a_study_prune_a_trial_and_best_yaml_reproduces_the_best(in_tmp, tiny_synthetic):
    # Enqueued: two sane learning rates first, then one that diverges, judged once a trial has finished.
    path = write_sweep(in_tmp, tiny_synthetic, trials=4,
                       pruner={"name": "median", "n_startup_trials": 1, "n_warmup_steps": 0},
                       enqueue=[{LR: 0.001}, {LR: 0.0005}, {LR: 10.0}])
    out = finish([start(sweep_command(path, "--workers", "2"), in_tmp)], timeout=600)[0]
    trials = trials_of(in_tmp)
    assert len(finished(trials)) == 4 == len(trials), out
    assert trials[2].state == optuna.trial.TrialState.PRUNED and trials[2].user_attrs["pruned_at_epoch"] == 0, out
    folder = in_tmp / "runs" / "sweeps" / "tiny"
    for trial in trials:  # each an ordinary run folder
        run = in_tmp / trial.user_attrs["run"]
        assert (run / "config.yaml").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
    with open(folder / "trials.csv") as file:
        rows = list(csv.DictReader(file))
    assert [(int(r["trial"]), r["state"]) for r in rows] == [(t.number, t.state.name) for t in trials]
    assert [float(r[LR]) for r in rows] == [t.params[LR] for t in trials]
    best = min((t for t in trials if t.state.name == "COMPLETE"), key=lambda t: t.value)
    assert float(rows[best.number]["val/loss"]) == best.value
    for plot in ("optimization_history", "param_importances", "parallel_coordinate"):
        assert (folder / f"{plot}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", out
    assert f"best: trial {best.number}, val/loss {best.value:.4f}" in out
    # best.yaml alone, run as a user would, gives the best trial's own result, bit for bit.
    again = in_tmp / "again"
    again.mkdir()
    run_flowers(["fit", "--config", str(folder / "best.yaml")], again)
    events = EventAccumulator(str(again / "runs" / "flowers" / "version_0"), size_guidance={"scalars": 0})
    assert events.Reload().Scalars("val/loss")[-1].value == best.value


@pytest.mark.slow
def test_a_killed_sweep_run_again_keeps_its_finished_trials_and_retries_the_interrupted_one(in_tmp, tiny_synthetic):
    # A long heartbeat: the rerun must see by itself that the trial's sweep is gone, not wait for it to go silent.
    path = write_sweep(in_tmp, tiny_synthetic, trials=2, pruner="none", heartbeat_s=60)
    sweep = start(sweep_command(path), in_tmp)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # one trial done, the next one under way
            study_db = in_tmp / "runs" / "sweeps" / "tiny" / "study.db"
            trials = trials_of(in_tmp) if study_db.is_file() else []  # not load_study's new empty file
            if len(finished(trials)) == 1 and any(t.state.name == "RUNNING" for t in trials):
                break
            assert sweep.poll() is None, sweep.communicate()[0]
            time.sleep(0.5)
        else:
            pytest.fail("the first trial did not finish in time")
        time.sleep(3)  # well into the second trial's process
        os.kill(sweep.pid, signal.SIGKILL)  # the sweep alone: its trial's process must go with it
        sweep.wait()
    finally:
        kill(sweep)
    before = trials_of(in_tmp)
    out = finish([start(sweep_command(path), in_tmp)], timeout=600)[0]
    after = trials_of(in_tmp)
    assert (after[0].number, after[0].state, after[0].value) == (before[0].number, before[0].state, before[0].value)
    interrupted = after[1]
    assert interrupted.state == optuna.trial.TrialState.FAIL, out
    retry = after[2]
    assert retry.state == optuna.trial.TrialState.COMPLETE and retry.params == interrupted.params, out
    assert retry.system_attrs["failed_trial"] == interrupted.number
    assert len(finished(after)) == 2 == len(after) - 1
    assert "trial 1 was interrupted" in out


@pytest.mark.slow
def test_two_machines_share_one_postgresql_study(in_tmp, tiny_synthetic):
    from tests.helpers.postgres import postgres_server

    path = write_sweep(in_tmp, tiny_synthetic, trials=4, pruner="none")
    with postgres_server() as url:
        machines = []
        for name in ("a", "b"):  # two folders, as two machines have: only the study is shared
            (in_tmp / name).mkdir()
            machines.append(start(sweep_command(path, "--storage", url), in_tmp / name))
        outputs = finish(machines, timeout=600)
        trials = trials_of(in_tmp, storage=url)
    assert len(finished(trials)) == 4 == len(trials), outputs
    pids = {t.user_attrs["pid"] for t in trials}
    assert len(pids) == 2 and {m.pid for m in machines} == pids, outputs
    for machine, name in zip(machines, ("a", "b"), strict=True):
        ran = [t for t in trials if t.user_attrs["pid"] == machine.pid]
        assert all((in_tmp / name / t.user_attrs["run"] / "config.yaml").is_file() for t in ran)
        assert (in_tmp / name / "runs" / "sweeps" / "tiny" / "trials.csv").read_text().count("\n") == 5


@pytest.mark.slow
def test_machines_that_create_one_studys_tables_at_once_all_open_it(tmp_path):
    # Before the losers waited for the winner, two rounds in three of six such starts had one fail (UniqueViolation).
    from tests.helpers.postgres import postgres_server

    opens = "import sys; from flowers.sweep.study import storage; storage(sys.argv[1], heartbeat_s=5)"
    with postgres_server() as url:
        url = url.replace("postgresql://", "postgresql+psycopg://")
        starts = [start([sys.executable, "-c", opens, url], tmp_path) for _ in range(6)]
        finish(starts, timeout=120)
