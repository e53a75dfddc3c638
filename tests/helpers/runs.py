"""Tiny in-process runs: the arguments that make any command take seconds, and where a run's files are."""

from __future__ import annotations

from pathlib import Path

import pytest

# Arguments that shrink any fit/validate/predict to a few seconds on CPU. The fused optimizer step: the
# tutorial's Adam over 14.6 M weights would take most of each tiny step otherwise.
TINY_RUN = [
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.max_epochs=1",
    "--trainer.enable_progress_bar=false",
    "--data.image_size=64",
    "--data.batch_size=4",
    "--data.num_workers=0",
    "--model.fused_optimizer=true",
]


def fit_in(root: Path, *args: str):
    """``flowers fit ARGS`` run in ``root`` (its runs/ lands there); the LightningCLI object it leaves."""
    from flowers.cli import cli_main

    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        return cli_main(["fit", *args])


def best_checkpoint(run_dir: Path) -> Path:
    return next((run_dir / "checkpoints").glob("best-*.ckpt"))


def last_checkpoint(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "last.ckpt"
