"""``fit --ckpt_path last`` continues a run exactly: 2 epochs + resume to 4 == 4 epochs, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowers.cli import cli_main
from tests.conftest import TINY_RUN

SCHEDULED = (
    "model:\n"
    "  optimizer:\n    class_path: torch.optim.Adam\n    init_args: {lr: 0.001}\n"
    "  scheduler:\n    class_path: torch.optim.lr_scheduler.StepLR\n    init_args: {step_size: 1, gamma: 0.5}\n"
)


def fit(folder: Path, monkeypatch, data: Path, *args: str):
    monkeypatch.chdir(folder)
    (folder / "exp.yaml").write_text(SCHEDULED)
    return cli_main(["fit", *TINY_RUN, "--config=exp.yaml", f"--data.data_dir={data}", "--trainer.deterministic=true",
                     "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=2", *args])


def loop_state(cli) -> dict:
    trainer = cli.trainer
    return {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "logger_step": trainer.fit_loop.epoch_loop._batches_that_stepped,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "best_score": float(trainer.checkpoint_callback.best_model_score),
        "best_name": Path(trainer.checkpoint_callback.best_model_path).name,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_synthetic):
    monkeypatch = pytest.MonkeyPatch()
    straight_dir, resumed_dir = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("resumed")
    try:
        straight = fit(straight_dir, monkeypatch, tiny_synthetic, "--trainer.max_epochs=4")
        first = fit(resumed_dir, monkeypatch, tiny_synthetic, "--trainer.max_epochs=2")
        config_before = (resumed_dir / first.trainer.log_dir / "config.yaml").read_bytes()
        first.saved_last = torch.load(resumed_dir / first.trainer.log_dir / "checkpoints" / "last.ckpt",
                                      weights_only=True)
        resumed = fit(resumed_dir, monkeypatch, tiny_synthetic, "--trainer.max_epochs=4", "--ckpt_path=last")
    finally:
        monkeypatch.undo()
    return straight, first, resumed, config_before, resumed_dir, straight_dir


def test_resumed_weights_equal_an_uninterrupted_run_bit_for_bit(runs):
    straight, _, resumed, _, _, _ = runs
    expected = straight.model.state_dict()
    got = resumed.model.state_dict()
    assert list(got) == list(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key
    # Adam's moments and step counts too, or the next epoch would differ.
    for a, b in zip(straight.trainer.optimizers[0].state.values(), resumed.trainer.optimizers[0].state.values(),
                    strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_restores_epoch_step_scheduler_logger_step_and_best_tracking(runs):
    straight, first, resumed, _, _, _ = runs
    assert loop_state(first)["epoch"] == 2 and loop_state(first)["global_step"] == 6
    # last.ckpt is the second epoch's, improved or not (Lightning alone would keep the best epoch's).
    assert (first.saved_last["epoch"], first.saved_last["global_step"]) == (1, 6)
    assert loop_state(resumed) == loop_state(straight)
    assert loop_state(resumed)["lr"] == pytest.approx(0.001 * 0.5**4)
    metrics = {k: float(v) for k, v in resumed.trainer.callback_metrics.items()}
    assert metrics == {k: float(v) for k, v in straight.trainer.callback_metrics.items()}


def test_resume_continues_the_same_run_folder_and_keeps_its_config(runs):
    straight, first, resumed, config_before, root, straight_root = runs
    run_dir = root / first.trainer.log_dir
    assert resumed.trainer.log_dir == first.trainer.log_dir  # version_0 again, not a new version_1
    assert sorted(p.name for p in (root / "runs" / "flowers").iterdir()) == ["version_0"]
    assert (run_dir / "config.yaml").read_bytes() == config_before
    resume_config = (run_dir / "config-resume-1.yaml").read_text()
    assert "ckpt_path:" in resume_config and "max_epochs: 4" in resume_config
    checkpoints = run_dir / "checkpoints"
    # One best checkpoint over all four epochs: the resumed run knew the first run's best.
    assert len(list(checkpoints.glob("best-*.ckpt"))) == 1
    saved = torch.load(checkpoints / "last.ckpt", weights_only=True, map_location="cpu")
    reference = torch.load(straight_root / straight.trainer.checkpoint_callback.dirpath / "last.ckpt",
                           weights_only=True)
    assert (saved["epoch"], saved["global_step"]) == (reference["epoch"], reference["global_step"])
    assert (saved["epoch"], saved["global_step"]) == (3, 12)


def test_explicit_checkpoint_path_resumes_too(runs, tiny_synthetic, monkeypatch):
    _, first, _, _, root, _ = runs
    last = root / first.trainer.log_dir / "checkpoints" / "last.ckpt"
    more = fit(root, monkeypatch, tiny_synthetic, "--trainer.max_epochs=5", f"--ckpt_path={last}")
    assert more.trainer.current_epoch == 5 and more.trainer.global_step == 15
    assert (root / first.trainer.log_dir / "config-resume-2.yaml").is_file()


def test_a_resume_runs_as_its_command_says_but_keeps_the_checkpoints_model(runs, tiny_synthetic, monkeypatch):
    # channels_last, compile and fused_optimizer are how the model runs: they follow the resuming command
    # (Lightning alone would take every model.* value from the checkpoint); the optimizer stays the saved one.
    straight, _, _, _, _, straight_root = runs
    last = straight_root / straight.trainer.checkpoint_callback.dirpath / "last.ckpt"  # 4 epochs, 12 steps
    saved = torch.load(last, weights_only=True)["optimizer_states"][0]
    assert not saved["param_groups"][0]["fused"]  # the first run's Adam was not fused
    more = fit(straight_root, monkeypatch, tiny_synthetic, "--trainer.max_epochs=5", f"--ckpt_path={last}",
               "--model.fused_optimizer=true", "--model.channels_last=true", "--model.dropout=0.1")
    assert more.model.fused_optimizer and more.model.channels_last
    assert more.model.hparams.dropout == 0.5  # what the model is comes from the checkpoint
    optimizer = more.trainer.optimizers[0]
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.param_groups[0]["lr"] == pytest.approx(0.001 * 0.5**5)
    assert optimizer.param_groups[0]["fused"] is True
    assert all(float(state["step"]) == 15 for state in optimizer.state.values())  # 12 saved steps + 3 more


def test_last_checkpoint_follows_epochs_that_do_not_validate(in_tmp, tiny_synthetic):
    # check_val_every_n_epoch=3: Lightning alone saves only after validating, so a kill in epoch 3 would
    # have found no last.ckpt at all.
    cli = cli_main(["fit", *TINY_RUN, f"--data.data_dir={tiny_synthetic}", "--trainer.max_epochs=4",
                    "--trainer.check_val_every_n_epoch=3", "--trainer.limit_train_batches=2",
                    "--trainer.limit_val_batches=1"])
    checkpoints = in_tmp / cli.trainer.checkpoint_callback.dirpath
    saved = torch.load(checkpoints / "last.ckpt", weights_only=True, map_location="cpu")
    assert (saved["epoch"], saved["global_step"]) == (3, 8)
    assert [p.name.split("-val_acc")[0] for p in checkpoints.glob("best-*.ckpt")] == ["best-epoch=02"]


def test_last_checkpoint_follows_every_epoch_without_validation_data(in_tmp, tiny_synthetic):
    cli = cli_main(["fit", *TINY_RUN, f"--data.data_dir={tiny_synthetic}", "--trainer.max_epochs=2",
                    "--trainer.check_val_every_n_epoch=2", "--trainer.limit_train_batches=2",
                    "--trainer.limit_val_batches=0"])
    saved = torch.load(in_tmp / cli.trainer.checkpoint_callback.dirpath / "last.ckpt", weights_only=True)
    assert (saved["epoch"], saved["global_step"]) == (1, 4)
