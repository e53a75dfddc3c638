"""``flowers sweep``: a hyperparameter search with Optuna over fit's own settings, each trial a ``flowers fit``.

    flowers sweep --config configs/sweeps/speedrun.yaml --data.data_dir path/to/flower_photos --workers 2

The sweep file (flowers/sweep/spec.py shows its entries) names the fit configs, the settings to search and the
metric. What the sweep leaves in ``runs/sweeps/<name>/``: a folder per trial, trials.csv, best.yaml and plots.
"""

from __future__ import annotations

import sys
import warnings

from flowers.errors import ArgumentParser, ConfigError


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="flowers sweep", allow_abbrev=False,
                       description="Search fit's settings with Optuna: each trial is a `flowers fit` run. Options "
                                   "this command does not know are fit flags that every trial takes "
                                   "(--data.data_dir path/to/flower_photos). docs/sweeps.md explains the file.")
    p.add_argument("--config", required=True, help="the sweep file (configs/sweeps/ has examples)")
    p.add_argument("--workers", type=int, default=1,
                   help="trials run at once on this machine, each a process; several machines share a study by "
                        "running the same command with one --storage")
    p.add_argument("--storage", help="the study's database, e.g. postgresql://user@host/db (default: the sweep "
                                     "file's storage, else study.db, SQLite, in runs/sweeps/<name>/)")
    return p


def fit_flags(words: list[str]) -> list[str]:
    """``--name value`` and ``--name=value`` words as ``--name=value`` flags."""
    flags, words = [], list(words)
    while words:
        word = words.pop(0)
        if not word.startswith("--") or word == "--":
            raise ConfigError(f"{word!r} is neither an option of flowers sweep nor a fit flag (--name=value)")
        if "=" not in word:
            if not words or words[0].startswith("--"):
                raise ConfigError(f"the fit flag {word} has no value: write {word}=VALUE")
            word = f"{word}={words.pop(0)}"
        flags.append(word)
    return flags


def main(argv: list[str] | None = None) -> int:
    args, rest = parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        return _sweep(args, rest)
    except ConfigError as error:
        print(f"flowers sweep: error: {error}", file=sys.stderr)
        return 2


def _sweep(args, rest: list[str]) -> int:
    if args.workers < 1:
        raise ConfigError(f"--workers is at least 1, not {args.workers}")
    try:
        import optuna
    except ImportError:
        raise ConfigError("flowers sweep runs on Optuna, which is not installed: pip install "
                          "'flowers[sweep]'") from None
    # Here, not above: `flowers sweep --help` loads neither Optuna nor torch.
    from flowers.sweep import results, spec, study
    from flowers.sweep.check import check
    from flowers.sweep.choices import make_pruner, make_sampler

    # The heartbeat is Optuna's, driven here around ask and tell rather than inside Study.optimize: a trial is a
    # process this command waits on, not a function it calls.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", "Heartbeat of storage is supposed to be used with Study.optimize")
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # this command says what happens, in its own lines

    sweep = spec.read(args.config, extra_args=fit_flags(rest))
    check(sweep)  # before anything is created: a setting fit refuses must not cost a trial
    sampler, pruner = make_sampler(sweep.sampler), make_pruner(sweep.pruner)
    url = study.storage_url(sweep, args.storage)
    if url.startswith("sqlite:///") and not args.storage and not sweep.storage:
        sweep.folder.mkdir(parents=True, exist_ok=True)
    opened, database = study.open_study(sweep, url, sampler, pruner)
    sweep.folder.mkdir(parents=True, exist_ok=True)
    print(f"sweep {sweep.name}: {sweep.trials} trials of {', '.join(p.flag for p in sweep.space)}, "
          f"{args.workers} at a time, study in {study.shown(url)}", flush=True)
    try:
        study.Workers(sweep, opened, database, url).run(args.workers)
    except KeyboardInterrupt:
        results.trials_csv(sweep, opened)
        print(f"sweep {sweep.name}: interrupted; the same command continues it", file=sys.stderr)
        return 130
    print(results.summary(sweep, opened, study.shown(url)), flush=True)
    return 0
