"""Soak: 16 short fits over random valid combinations of the CPU-capable files in configs/.

Each combination is a recipe (or none), optionally cpu.yaml and fast.yaml, a precision, a seed and
deterministic on or off, shrunk to a few batches of 64-px tiny data. None may fail, and each must leave
a ``last.ckpt`` that loads into a FlowerClassifier, in a run folder of its own. The fits run in-process
(16 interpreter start-ups would cost more than the fits), except the ddp ones, which need processes.
"""

from __future__ import annotations

import random
import shutil
import sys
from pathlib import Path

import pytest
import torch

from flowers.cli import cli_main
from flowers.module import FlowerClassifier
from tests.helpers.processes import finish, start

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = [None, "tutorial.yaml", "quickstart.yaml", "best.yaml"]  # gpu/dp/ddp/multinode/slurm need GPUs or clusters
RUNS, DDP_RUNS = 16, 2
SHRINK = ["--trainer.accelerator=cpu", "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
          "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false", "--data.image_size=64",
          "--data.batch_size=4", "--data.eval_batch_size=8", "--data.num_workers=0", "--model.fused_optimizer=true"]


def combinations(rng: random.Random) -> list[list[str]]:
    runs = []
    for i in range(RUNS):
        files = [name for name in (rng.choice(RECIPES), rng.choice([None, "cpu.yaml"]),
                                   rng.choice([None, "fast.yaml"])) if name]
        if i < DDP_RUNS:
            files.append("ddp_cpu.yaml")
        args = [arg for name in files for arg in ("--config", str(CONFIGS / name))]
        args += [f"--trainer.precision={rng.choice(['32-true', 'bf16-mixed'])}",
                 f"--seed_everything={rng.randrange(1000)}",
                 f"--trainer.deterministic={rng.choice(['true', 'false'])}"]
        if "ddp_cpu.yaml" not in files:
            args.append("--trainer.devices=1")
        runs.append(args)
    return runs


@pytest.mark.slow
def test_short_fits_over_random_config_combinations(tmp_path, tiny_synthetic, monkeypatch):
    for i, combination in enumerate(combinations(random.Random(7))):
        folder = tmp_path / f"run{i:02d}"
        folder.mkdir()
        args = ["fit", *combination, *SHRINK, f"--data.data_dir={tiny_synthetic}"]
        shown = [Path(a).name if a.endswith(".yaml") else a for a in combination if a != "--config"]
        print(f"soak {i:02d}: {' '.join(shown)}", flush=True)
        if "ddp" in " ".join(combination):
            finish([start([sys.executable, "-m", "flowers", *args], folder)], timeout=240)
        else:
            monkeypatch.chdir(folder)
            cli_main(args)
        runs = list((folder / "runs" / "flowers").iterdir())
        assert [r.name for r in runs] == ["version_0"], runs  # its own run folder, nothing else
        last = runs[0] / "checkpoints" / "last.ckpt"
        model = FlowerClassifier.load_from_checkpoint(last, map_location="cpu")
        assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 2
        assert all(torch.isfinite(p).all() for p in model.parameters())
        shutil.rmtree(folder)  # 16 runs' checkpoints would hold GBs of disk until the test run ends
