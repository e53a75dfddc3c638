"""Same seed and deterministic=true: two runs give identical metrics and weights; split and seed are recorded."""

from __future__ import annotations

import torch
import yaml

from flowers.cli import cli_main
from tests.helpers.runs import TINY_RUN

ARGS = [*TINY_RUN, "--trainer.deterministic=true", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
        "--seed_everything=7"]


def test_two_runs_with_one_seed_are_identical_and_log_the_seed(in_tmp, tiny_synthetic):
    runs = [cli_main(["fit", *ARGS, f"--data.data_dir={tiny_synthetic}"]) for _ in range(2)]
    metrics = [{k: float(v) for k, v in run.trainer.logged_metrics.items()} for run in runs]
    assert metrics[0] == metrics[1] and "train/loss_epoch" in metrics[0]
    for key, tensor in runs[0].model.state_dict().items():
        assert torch.equal(tensor, runs[1].model.state_dict()[key]), key
    splits = [[s.path for s in run.datamodule.val_set.samples] for run in runs]
    assert splits[0] == splits[1]
    for run in runs:  # the seed is in config.yaml and in the logger's hparams
        folder = in_tmp / run.trainer.log_dir
        assert yaml.safe_load((folder / "config.yaml").read_text())["seed_everything"] == 7
        assert yaml.safe_load((folder / "hparams.yaml").read_text())["seed_everything"] == 7
