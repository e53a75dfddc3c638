"""What a sweep leaves for its user in ``runs/sweeps/<name>/``: trials.csv, best.yaml and the plots."""

from __future__ import annotations

import csv
import io
import warnings
from pathlib import Path

import optuna
from optuna.trial import TrialState

from flowers.files import atomic_write_text
from flowers.sweep.check import fit_config
from flowers.sweep.spec import PRUNED_AT, Sweep, as_flag


def trials_csv(sweep: Sweep, study: optuna.Study) -> Path:
    """One row per trial: its number, state, metric, each setting, duration, the epoch it was pruned at, run."""
    flags = [param.flag for param in sweep.space]
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["trial", "state", sweep.metric, *flags, "duration_s", PRUNED_AT, "retry_of", "host", "run"])
    for trial in study.get_trials(deepcopy=False):
        duration = trial.duration.total_seconds() if trial.duration is not None else ""
        reported = trial.intermediate_values
        value = trial.value if trial.value is not None else reported[max(reported)] if reported else ""
        writer.writerow([trial.number, trial.state.name, value, *(trial.params.get(flag, "") for flag in flags),
                         f"{duration:.1f}" if duration != "" else "", trial.user_attrs.get(PRUNED_AT, ""),
                         trial.system_attrs.get("failed_trial", ""), trial.user_attrs.get("host", ""),
                         trial.user_attrs.get("run", "")])
    path = sweep.folder / "trials.csv"
    atomic_write_text(path, text.getvalue())
    return path


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    return study.best_trial if study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) else None


def best_yaml(sweep: Sweep, trial: optuna.trial.FrozenTrial) -> Path:
    """``best.yaml``: the whole fit config of the best trial, which ``flowers fit --config`` runs as it ran."""
    values = {param.flag: param.value_of(trial.params[param.flag]) for param in sweep.space}
    header = (f"# The best trial of the sweep {sweep.name} ({sweep.file}): trial {trial.number}, {sweep.metric} "
              f"{trial.value:.4f}.\n# Its run: {trial.user_attrs.get('run', '?')}. Train it again with\n"
              f"#   flowers fit --config {sweep.folder / 'best.yaml'}\n")
    path = sweep.folder / "best.yaml"
    atomic_write_text(path, header + fit_config(sweep, values))
    return path


def plots(sweep: Sweep, study: optuna.Study) -> dict[str, str]:
    """The plots as PNG beside trials.csv: ``{name: path}``, or ``{name: why it was not drawn}``."""
    import matplotlib

    matplotlib.use("Agg")  # files only: a terminal-only machine draws them too
    import matplotlib.pyplot as plt
    from optuna.importance import PedAnovaImportanceEvaluator
    from optuna.visualization import matplotlib as draw

    drawers = {"optimization_history": lambda: draw.plot_optimization_history(study),
               # PED-ANOVA needs numpy alone; Optuna's default (fANOVA) needs scikit-learn
               "param_importances": lambda: draw.plot_param_importances(study, evaluator=PedAnovaImportanceEvaluator()),
               "parallel_coordinate": lambda: draw.plot_parallel_coordinate(study)}
    drawn = {}
    for name, drawer in drawers.items():
        path = sweep.folder / f"{name}.png"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
                axes = drawer()
            figure = (axes.flat[0] if hasattr(axes, "flat") else axes).get_figure()
            figure.savefig(path, dpi=110, bbox_inches="tight")
            plt.close(figure)
            drawn[name] = str(path)
        except Exception as error:  # too few finished trials, one setting only: say so, the other plots still come
            drawn[name] = f"not drawn ({' '.join(str(error).split())[:200] or type(error).__name__})"
            plt.close("all")
    return drawn


def summary(sweep: Sweep, study: optuna.Study, storage_shown: str) -> str:
    """Writes trials.csv, best.yaml and the plots; the lines that say where they are and which trial won."""
    states = [trial.state for trial in study.get_trials(deepcopy=False)]
    counts = ", ".join(f"{states.count(s)} {s.name.lower()}" for s in TrialState if states.count(s))
    lines = [f"sweep {sweep.name}: {len(states)} trials ({counts})", f"  {trials_csv(sweep, study)}"]
    best = best_trial(study)
    if best is not None:
        path = best_yaml(sweep, best)
        settings = " ".join(f"--{p.flag}={as_flag(p.value_of(best.params[p.flag]))}" for p in sweep.space)
        lines[1:1] = [f"best: trial {best.number}, {sweep.metric} {best.value:.4f}: {settings}",
                      f"  {path}   flowers fit --config {path}"]
    lines += [f"  {name}: {where}" for name, where in plots(sweep, study).items()]
    lines.append(f"Watch a study live: optuna-dashboard {storage_shown}")
    return "\n".join(lines)
