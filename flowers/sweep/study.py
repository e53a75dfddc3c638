"""A sweep's Optuna study, and the workers that run its trials, each as its own ``flowers fit`` process.

Workers share nothing but the study's storage: threads on one machine, and any number of machines running the
same command against one database. A trial whose sweep died is failed and run again at the same settings: at
once by a sweep on the same machine (its process is gone), else by Optuna's heartbeat once it goes silent.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback, fail_stale_trials
from optuna.trial import TrialState
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError, ProgrammingError

from flowers.budget import process_started
from flowers.errors import ConfigError
from flowers.sweep.spec import PRUNED_AT, Sweep, stored_choice

MAX_RETRY = 2  # an interrupted trial runs again at most this often
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
HOST = socket.gethostname()
IDENTITY = "sweep"  # the study's user attribute that every joining process must match
_LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None


def storage_url(sweep: Sweep, given: str | None) -> str:
    url = given or sweep.storage or f"sqlite:///{(sweep.folder / 'study.db').resolve()}"
    # psycopg (3) by name: SQLAlchemy's default driver for postgresql:// differs between its versions.
    return "postgresql+psycopg://" + url.removeprefix("postgresql://") if url.startswith("postgresql://") else url


def shown(url: str) -> str:
    """A storage URL fit to print: no password."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy reads: say it as given, it names no password it understood
        return url


def storage(url: str, *, heartbeat_s: int | None = None) -> RDBStorage:
    # SQLite: the trials' processes write beside the sweep's, so wait for the file's lock rather than fail.
    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
    retry = RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)
    heartbeat = dict(heartbeat_interval=heartbeat_s, grace_period=3 * heartbeat_s,
                     heartbeat_stale_trial_callback=retry) if heartbeat_s else {}
    for wait_s in (1, 2, None):
        try:
            return RDBStorage(url, engine_kwargs=engine, **heartbeat)
        except (IntegrityError, ProgrammingError):
            # Machines that start at once all create the tables, and all but one fail; the tables are there then.
            if wait_s is None:
                raise ConfigError(f"cannot create the study's tables in {shown(url)}: see the database's log, and "
                                  "that this user may create tables there.") from None
            time.sleep(wait_s)
        except Exception as error:  # a missing driver, a server that does not answer, a URL that is not one
            first = " ".join(str(error).strip().splitlines()[0].split()) if str(error).strip() else \
                type(error).__name__
            raise ConfigError(f"cannot open the study's storage {shown(url)}: {first[:300]}. Check the URL, that the "
                              "database server runs and lets this machine in, and its driver (psycopg for "
                              "postgresql://: pip install 'flowers[sweep]').") from None


def open_study(sweep: Sweep, url: str, sampler: optuna.samplers.BaseSampler,
               pruner: optuna.pruners.BasePruner) -> tuple[optuna.Study, RDBStorage]:
    """The sweep's study and its storage: created on first use, joined by every later process, which must search
    the same space."""
    database = storage(url, heartbeat_s=sweep.heartbeat_s)
    study = optuna.create_study(storage=database, study_name=sweep.name, direction=sweep.direction,
                                sampler=sampler, pruner=pruner, load_if_exists=True)
    identity = json.loads(json.dumps(sweep.identity()))
    recorded = study.user_attrs.get(IDENTITY)
    if recorded is None:
        study.set_user_attr(IDENTITY, identity)
        choices = {p.flag for p in sweep.space if p.choices}
        for values in sweep.enqueue:
            study.enqueue_trial({flag: stored_choice(v) if flag in choices else v for flag, v in values.items()},
                                skip_if_exists=True)
    elif recorded != identity:
        raise ConfigError(f"the study {sweep.name!r} in {shown(url)} searches another space, metric or direction "
                          f"than {sweep.file}: give this sweep another name (name: in the file) or another storage, "
                          "or search the same space.")
    return study, database


def _die_with_the_sweep() -> None:
    # A trial's process ends when the thread that started it does, so a killed sweep leaves no orphan training.
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Workers:
    """``count`` threads that ask the study for trials and run each as a ``flowers fit`` process until it holds
    ``sweep.trials`` finished ones."""

    def __init__(self, sweep: Sweep, study: optuna.Study, database: RDBStorage, url: str) -> None:
        self.sweep, self.study, self.database, self.url = sweep, study, database, url
        self._study_id = database.get_study_id_from_name(sweep.name)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._processes: dict[int, subprocess.Popen] = {}
        self.refusal: str | None = None
        self.error: Exception | None = None

    def run(self, count: int) -> None:
        threads = [threading.Thread(target=self._work, name=f"sweep-worker-{k}", daemon=True) for k in range(count)]
        for thread in threads:
            thread.start()
        try:
            while any(thread.is_alive() for thread in threads):
                for thread in threads:
                    thread.join(timeout=0.5)
        except KeyboardInterrupt:
            self._stop.set()
            for process in list(self._processes.values()):
                process.kill()
            for thread in threads:
                thread.join()
            raise
        if self.error is not None:
            raise self.error
        if self.refusal is not None:
            raise ConfigError(self.refusal)

    def _say(self, text: str) -> None:
        print(f"sweep {self.sweep.name}: {text}", flush=True)

    def _work(self) -> None:
        try:
            self._trials()
        except Exception as error:  # the storage failed, say: every worker stops, and the command says why
            self.error = error
            self._stop.set()

    def _trials(self) -> None:
        while not self._stop.is_set():
            with self._lock:  # count and ask as one step, so this machine starts no trial beyond the target
                self._recover()
                started = self.study.get_trials(deepcopy=False, states=(*FINISHED, TrialState.RUNNING))
                if len(started) >= self.sweep.trials:
                    return
                trial = self.study.ask()
                values = {param.flag: param.suggest(trial) for param in self.sweep.space}
                folder = self.sweep.folder / f"trial_{trial.number:03d}"
                for key, value in (("host", HOST), ("pid", os.getpid()), ("pid_started", process_started(os.getpid())),
                                   ("run", str(folder))):
                    trial.set_user_attr(key, value)
            self._run(trial, values, folder)

    def _recover(self) -> None:
        """Fail the trials a dead sweep left running, and queue each again: this machine's at once, any
        machine's once its heartbeat is older than the grace period."""
        running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        fail_stale_trials(self.study)
        retry = RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)
        for trial in running:
            attrs = trial.user_attrs
            if attrs.get("host") != HOST or attrs.get("pid") == os.getpid():
                continue
            if process_started(attrs.get("pid", -1)) != attrs.get("pid_started"):
                try:
                    self.study.tell(trial.number, state=TrialState.FAIL)
                except (ValueError, RuntimeError):  # failed already, by its heartbeat or another sweep
                    continue
                retry(self.study, self.study.get_trials(deepcopy=False)[trial.number])
        now = self.study.get_trials(deepcopy=False)
        for trial in running:
            if now[trial.number].state == TrialState.FAIL:
                self._say(f"trial {trial.number} was interrupted (its sweep is gone): it runs again")

    def _run(self, trial: optuna.Trial, values: dict, folder: Path) -> None:
        trial_id = self.database.get_trial_id_from_study_id_trial_number(self._study_id, trial.number)
        reporter = {"class_path": "flowers.sweep.report.ReportToStudy",
                    "init_args": {"storage": self.url, "study_name": self.sweep.name, "trial_id": trial_id,
                                  "metric": self.sweep.metric, "pruner": self.sweep.pruner}}
        words = ["fit", *self.sweep.fit_words(values), *placement(self.sweep, trial.number),
                 f"--trainer.callbacks+={json.dumps(reporter)}"]
        folder.parent.mkdir(parents=True, exist_ok=True)
        log = folder.parent / f"{folder.name}.log"
        settings = " ".join(f"{flag}={value}" for flag, value in trial.params.items())
        self._say(f"trial {trial.number} starts: {settings}")
        with open(log, "w") as out:
            process = subprocess.Popen([sys.executable, "-m", "flowers", *words], stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, preexec_fn=_die_with_the_sweep)
            self._processes[trial.number] = process
            while True:
                self.database.record_heartbeat(trial_id)
                try:
                    process.wait(timeout=self.sweep.heartbeat_s)
                    break
                except subprocess.TimeoutExpired:
                    if self._stop.is_set():
                        process.kill()
            del self._processes[trial.number]
        self._tell(trial, process.returncode, log)

    def _tell(self, trial: optuna.Trial, returncode: int, log: Path) -> None:
        frozen = self.study.get_trials(deepcopy=False)[trial.number]
        reported = frozen.intermediate_values
        if frozen.state.is_finished():  # another sweep failed it, its heartbeat too late, and queued it again
            self._say(f"trial {trial.number} was failed by another sweep (this one's heartbeat came late): it runs "
                      "again")
            return
        if self._stop.is_set() or returncode < 0:  # killed: not the settings' fault, so run them again
            self.study.tell(trial, state=TrialState.FAIL)
            RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)(self.study, self.study.get_trials()[trial.number])
            self._say(f"trial {trial.number} was interrupted: it runs again")
            return
        if returncode == 0 and reported:
            if PRUNED_AT in frozen.user_attrs:
                self.study.tell(trial, state=TrialState.PRUNED)
                self._say(f"trial {trial.number} pruned after epoch {frozen.user_attrs[PRUNED_AT]}")
                return
            value = reported[max(reported)]
            self.study.tell(trial, value)  # Optuna records a NaN as a failed trial
            self._say(f"trial {trial.number}: {self.sweep.metric} {value:.4f}")
            return
        self.study.tell(trial, state=TrialState.FAIL)
        why = _last_line(log) if returncode else f"it logged no {self.sweep.metric}"
        self._say(f"trial {trial.number} failed (exit {returncode}): {why} (log: {log})")
        if returncode == 2 or not returncode:  # a setting fit refuses, or no metric: every trial would fail so
            self.refusal = f"trial {trial.number} failed: {why}. Its log: {log}"
            self._stop.set()


def placement(sweep: Sweep, number: int) -> list[str]:
    """The flags that put a trial's run in ``runs/sweeps/<name>/trial_NNN/``, its output in a log without a
    progress bar."""
    return [f"--trainer.logger.init_args.save_dir={sweep.folder.parent}",
            f"--trainer.logger.init_args.name={sweep.name}", f"--trainer.logger.init_args.version=trial_{number:03d}",
            "--trainer.enable_progress_bar=false"]


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:500] if lines else "(it printed nothing)"
