"""Which checkpoint a command starts from, and which run folder it continues: a plan made from the settings and
the run folders on disk, before anything is built. The CLI carries it out; tests check it alone."""

from __future__ import annotations

from dataclasses import dataclass

from flowers import inference, restarts, runs
from flowers.errors import ConfigError

# Lightning's own names for checkpoints flowers cannot check before loading (a SLURM hpc_ckpt, a model registry's).
REFUSED_CKPT_NAMES = ("hpc", "registry")


@dataclass(frozen=True)
class Plan:
    ckpt_path: str | None  # the checkpoint file to load; None starts a new run
    restarted: bool = False  # a launcher restarted this job, which picks up its own run
    version: str | None = None  # the run folder (version_N) the logger continues: the checkpoint's own run's
    notes: tuple[str, ...] = ()  # what the command says about the plan

    @property
    def resumes(self) -> bool:
        return self.ckpt_path is not None


def plan(subcommand: str | None, ckpt_path: str | None, *, job: str | None = None, save_dir: str = runs.LOG_DIR,
         name: str = runs.NAME, folder_chosen: bool = False) -> Plan:
    """The plan for ``flowers <subcommand> --ckpt_path <ckpt_path>`` with runs under ``save_dir/name``.

    ``job``: the torchrun or SLURM job that started this process (``restarts.current_job``); a restarted fit goes
    on with its own run, never the newest of the folder. ``best``/``last`` name the newest run's checkpoints. A fit
    that resumes a run's own checkpoint continues that run's folder, unless ``folder_chosen`` (the command names the
    logger's version, or has no logger).
    Raises ConfigError for a checkpoint name flowers cannot check before loading.
    """
    notes, restarted = [], False
    if job is not None and subcommand == "fit" and ckpt_path in (None, "last"):
        own = restarts.own_last_checkpoint(job, save_dir, name)
        if own is not None:
            ckpt_path, restarted = str(own), True
            notes.append(f"{job} started again: resuming its own run from {own}")
    if ckpt_path in REFUSED_CKPT_NAMES:
        raise ConfigError(f"--ckpt_path {ckpt_path}: flowers loads only checkpoints it can check first. "
                          "Pass a checkpoint file, or best or last (the newest run's).")
    if ckpt_path in inference.ALIASES:
        ckpt_path = str(inference.resolve(ckpt_path, "--ckpt_path", save_dir=save_dir, name=name))
        notes.append(f"--ckpt_path: {ckpt_path}")
    version = None
    if subcommand == "fit" and ckpt_path is not None and not folder_chosen:
        version = runs.version_of(ckpt_path, save_dir, name)
        if version:
            notes.append(f"Resuming {save_dir}/{name}/{version} from {ckpt_path}")
    return Plan(ckpt_path=ckpt_path, restarted=restarted, version=version, notes=tuple(notes))
