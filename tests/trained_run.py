"""One tiny 2-epoch run shared by the checkpoint-exploring tests (training is their slowest step)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowers.cli import cli_main
from tests.conftest import TINY_RUN

_RUNS: dict[Path, Path] = {}


def trained_run(tmp_path_factory, tiny_synthetic: Path) -> Path:
    """The absolute ``runs/flowers/version_0`` of a fit on the tiny synthetic set, trained once per session."""
    if tiny_synthetic not in _RUNS:
        root = tmp_path_factory.mktemp("trained")
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(root)
            cli = cli_main(["fit", *TINY_RUN, f"--data.data_dir={tiny_synthetic}", "--trainer.max_epochs=2"])
        _RUNS[tiny_synthetic] = (root / cli.trainer.log_dir).resolve()
    return _RUNS[tiny_synthetic]


def best_checkpoint(run_dir: Path) -> Path:
    return next((run_dir / "checkpoints").glob("best-*.ckpt"))
