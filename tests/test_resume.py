"""Resuming: ``fit --ckpt_path last`` continues a run exactly, after a clean stop, a ``kill -9`` at any moment, or a
restart by torchrun or SLURM, and the run ends as one that was never stopped, having trained every batch once.

The kill tests run real ``python -m flowers fit`` children that load test callbacks from tests/helpers/callbacks.py:
``Pause`` waits at a chosen moment to be killed, ``KillAt`` SIGKILLs its own process at a chosen step (between batches
or halfway through writing the checkpoint), ``BatchLog`` records a fingerprint of every training batch the model gets.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch

from flowers import restarts
from flowers.analysis import read_scalars
from flowers.checkpointing import LAST_CHECKPOINT, MID_EPOCH_INTERVAL
from flowers.cli import cli_main
from flowers.data import FlowerDataModule
from flowers.data.sampling import EpochSampler
from tests.helpers.processes import child_env, finish, free_port, kill, start, timed_out
from tests.helpers.runs import TINY_RUN

CALLBACKS = "tests.helpers.callbacks"
LAST = Path("runs/flowers/version_0/checkpoints/last.ckpt")


# -- a clean stop, then --ckpt_path last ------------------------------------------------------------------------
SCHEDULED = (
    "model:\n"
    "  optimizer:\n    class_path: torch.optim.Adam\n    init_args: {lr: 0.001}\n"
    "  scheduler:\n    class_path: torch.optim.lr_scheduler.StepLR\n    init_args: {step_size: 1, gamma: 0.5}\n"
)


def fit(folder: Path, monkeypatch, data: Path, *args: str):
    monkeypatch.chdir(folder)
    (folder / "exp.yaml").write_text(SCHEDULED)
    # The tutorial's unfused Adam: a resume may switch to the fused step (test_a_resume_runs_as_its_command_says).
    return cli_main(["fit", *TINY_RUN, "--config=exp.yaml", f"--data.data_dir={data}", "--trainer.deterministic=true",
                     "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=2",
                     "--model.fused_optimizer=false", *args])


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


# -- when last.ckpt is written ----------------------------------------------------------------------------------
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


def test_last_ckpt_is_written_inside_epochs_when_asked_and_at_every_epoch_end(in_tmp, tiny_synthetic, monkeypatch):
    saves = []
    real = L.Trainer.save_checkpoint

    def save(trainer, path, *args, **kwargs):
        real(trainer, path, *args, **kwargs)
        saves.append((Path(path).name, trainer.global_step))
        if saves[-1] == ("last.ckpt", 2):
            shutil.copy(path, in_tmp / "mid-epoch.ckpt")

    monkeypatch.setattr(L.Trainer, "save_checkpoint", save)
    args = ["fit", *TINY_RUN, f"--data.data_dir={tiny_synthetic}", "--trainer.limit_train_batches=3",
            "--trainer.limit_val_batches=1", "--trainer.deterministic=true", "--seed_everything=3"]
    unbroken = cli_main([*args, "--checkpoint.train_time_interval=0:00:00"])
    # After every batch; after the epoch's last one, only the epoch's own save.
    assert [step for name, step in saves if name == "last.ckpt"] == [1, 2, 3], saves

    # Resumed from the save after batch 2, the epoch's logged loss and accuracy still cover all 3 batches.
    resumed = cli_main([*args, "--ckpt_path=mid-epoch.ckpt"])
    for name in ("train/acc", "train/loss_epoch"):
        assert torch.equal(resumed.trainer.callback_metrics[name], unbroken.trainer.callback_metrics[name]), name

    saves.clear()
    cli_main([*args, "--trainer.max_epochs=2", "--ckpt_path=last", "--checkpoint.train_time_interval=null"])
    assert [step for name, step in saves if name == "last.ckpt"] == [6]  # off: at the epoch's end only
    assert LAST_CHECKPOINT["train_time_interval"] == MID_EPOCH_INTERVAL == timedelta(minutes=1)


# -- the batch order and augmentations a resume continues -------------------------------------------------------
def test_the_epoch_sampler_shares_one_order_among_the_ranks_and_resumes_inside_it():
    data = list(range(21))
    ranks = [EpochSampler(data, batch_size=2, num_replicas=2, rank=r, seed=5) for r in range(2)]
    for sampler in ranks:
        sampler.set_epoch(3)
    shards = [list(sampler) for sampler in ranks]
    assert len(shards[0]) == len(shards[1]) == 11  # padded, as DistributedSampler pads
    assert {i for shard in shards for i, _ in shard} == set(data)
    seeds = [seed for shard in shards for _, seed in shard]
    assert len(set(seeds)) == len(seeds)  # every position its own seed, on every rank
    assert shards == [list(sampler) for sampler in ranks]  # a function of (seed, epoch): the same again
    ranks[0].set_epoch(4)
    assert list(ranks[0]) != shards[0]

    # Saved after 3 of 6 batches of epoch 3, a fresh sampler (another process) goes on from batch 4.
    state = ranks[1].state_dict(batches_done=3, batches_per_epoch=6)
    assert state == {"seed": 5, "epoch": 3, "batches": 3}
    resumed = EpochSampler(data, batch_size=2, num_replicas=2, rank=1, seed=99)
    resumed.load_state_dict(state)
    assert list(resumed) == shards[1][6:]
    assert list(resumed) == shards[1]  # the skip is for the resumed epoch's first pass only
    # Saved at an epoch's end: the next epoch, from its start.
    assert ranks[1].state_dict(batches_done=6, batches_per_epoch=6) == {"seed": 5, "epoch": 4, "batches": 0}


def test_class_balanced_epochs_draw_each_class_alike_in_one_resumable_order(tiny_synthetic):
    labels = [0] * 90 + [1] * 10  # one class nine times as common as the other
    weights = [1 / labels.count(label) for label in labels]
    ranks = [EpochSampler(labels, batch_size=5, num_replicas=2, rank=r, seed=5, weights=weights) for r in range(2)]
    drawn = []
    for epoch in range(20):
        for sampler in ranks:
            sampler.set_epoch(epoch)
        shards = [list(sampler) for sampler in ranks]
        assert [len(shard) for shard in shards] == [50, 50]  # still an epoch of len(dataset) positions
        drawn += [labels[i] for shard in shards for i, _ in shard]
    assert 0.4 < drawn.count(1) / len(drawn) < 0.6  # not 0.1
    state = ranks[0].state_dict(batches_done=4, batches_per_epoch=10)
    resumed = EpochSampler(labels, batch_size=5, num_replicas=2, rank=0, seed=0, weights=weights)
    resumed.load_state_dict(state)
    assert list(resumed) == shards[0][20:]

    module = FlowerDataModule(str(tiny_synthetic), image_size=64, class_balanced=True)
    module.setup("fit")
    weights = module._balancing_weights()
    per_class = {}
    for label, weight in zip(module.train_set.labels, weights, strict=True):
        per_class[label] = per_class.get(label, 0) + weight
    assert sorted(per_class) == list(range(module.num_classes))
    assert all(abs(total - 1) < 1e-9 for total in per_class.values())  # every class weighs the same in all
    assert module.train_dataloader().sampler.weights is not None


def test_an_items_augmentation_comes_from_its_own_seed_and_leaves_the_global_generator_alone(tiny_synthetic):
    from flowers.data.datasets import LabelledImages
    from flowers.data.folders import list_images

    module = FlowerDataModule(str(tiny_synthetic), image_size=64)
    module.setup("fit")
    images = LabelledImages(list_images(tiny_synthetic, module.class_names), module.train_set.transform)
    torch.manual_seed(0)
    first = images[(3, 1234)][0]
    state = torch.get_rng_state()
    torch.manual_seed(1)
    assert torch.equal(images[(3, 1234)][0], first)
    assert not torch.equal(images[(3, 4321)][0], first)
    torch.manual_seed(0)
    images[(3, 1234)]
    assert torch.equal(torch.get_rng_state(), state)


# -- kill -9 at an epoch's end, in validation, in a write -------------------------------------------------------
def wait_for(path: Path, process, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            pytest.fail(f"the child ended (status {process.returncode}) before the marker:\n{process.stdout.read()}")
        if time.monotonic() > deadline:
            kill(process)
            pytest.fail("the child never reached the marker")
        time.sleep(0.2)


@pytest.mark.parametrize("moment", ["train", "validation", "write"])
def test_kill_9_leaves_a_loadable_last_ckpt_and_the_run_resumes(moment, in_tmp, tiny_synthetic):
    marker = in_tmp / "marker"
    args = [*TINY_RUN, f"--data.data_dir={tiny_synthetic}", "--trainer.limit_train_batches=3",
            "--trainer.limit_val_batches=1"]
    child = start([sys.executable, "-m", "flowers", "fit", *args, "--trainer.max_epochs=3",
                   "--trainer.callbacks+=tests.helpers.callbacks.Pause", f"--trainer.callbacks.marker={marker}",
                   f"--trainer.callbacks.moment={moment}"], in_tmp)
    wait_for(marker, child)
    kill(child)
    assert child.returncode != 0

    # Epoch 0's checkpoint, whole: the killed epoch left no partial file in its place.
    saved = torch.load((in_tmp / LAST), map_location="cpu", weights_only=True)
    assert (saved["epoch"], saved["global_step"]) == (0, 3)
    if moment == "write":
        # The half-written temporary file sits beside it, hidden, and is never mistaken for a checkpoint.
        assert [p.name for p in (in_tmp / LAST).parent.glob(".last.ckpt.*.tmp")]

    # Finish the killed epoch 1 (max_epochs=2 keeps the test short; the child would have run 3).
    resumed = cli_main(["fit", *args, "--trainer.max_epochs=2", "--ckpt_path=last"])
    assert resumed.trainer.current_epoch == 2 and resumed.trainer.global_step == 6
    final = torch.load((in_tmp / LAST), map_location="cpu", weights_only=True)
    assert (final["epoch"], final["global_step"]) == (1, 6)


# -- kill -9 inside an epoch: every batch trained once ----------------------------------------------------------
RUN = [
    "--trainer.accelerator=cpu",
    "--trainer.max_epochs=2",
    "--trainer.enable_progress_bar=false",
    "--trainer.deterministic=true",
    "--seed_everything=7",
    "--data.image_size=64",
    "--data.batch_size=8",
    "--data.eval_batch_size=32",
    "--model.fused_optimizer=true",
]


def fit_child(folder: Path, data: Path, *args: str, timeout: float = 300) -> tuple[int, str]:
    """Exit status and output of a fit in ``folder``; any process it leaves (a ddp rank whose peer was killed)
    is killed with it, so none appends to the batch logs of the next run."""
    folder.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "flowers", "fit", *RUN, f"--data.data_dir={data}",
               f"--trainer.callbacks+={CALLBACKS}.BatchLog", f"--trainer.callbacks.folder={folder}", *args]
    process = subprocess.Popen(command, cwd=folder, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        output = timed_out(process, timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return process.returncode, output


def last_ckpt(folder: Path) -> dict:
    return torch.load(folder / "runs/flowers/version_0/checkpoints/last.ckpt", map_location="cpu", weights_only=True)


def batches(folder: Path, rank: int = 0) -> list[tuple[int, str]]:
    lines = (folder / f"batches_rank{rank}.txt").read_text().split()
    return [(int(step), digest) for step, digest in zip(lines[::2], lines[1::2], strict=True)]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


SETUPS = {  # name: (extra fit arguments, processes, the setup whose unbroken run it must equal)
    "pil": (["--data.num_workers=0"], 1, "pil"),
    "pil-workers": (["--data.num_workers=2"], 1, "pil"),  # workers change nothing: each item has its own seed
    "cache": (["--data.cache=true", "--data.num_workers=0"], 1, "cache"),
    "ddp": (["--data.num_workers=0", "--trainer.strategy=ddp", "--trainer.devices=2"], 2, "ddp"),
    "ddp-workers": (["--data.num_workers=1", "--trainer.strategy=ddp", "--trainer.devices=2"], 2, "ddp"),
}


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory, tiny_synthetic):
    """The run never stopped, per setup, without mid-epoch saves (which must not change what it computes)."""
    folders = {}

    def run(setup: str) -> Path:
        if setup not in folders:
            folder = tmp_path_factory.mktemp(f"unbroken-{setup}")
            status, output = fit_child(folder, tiny_synthetic, *SETUPS[setup][0],
                                       "--checkpoint.train_time_interval=null")
            assert status == 0, output[-3000:]
            folders[setup] = folder
        return folders[setup]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("setup, moment", [("pil-workers", "writing"), ("cache", "between"), ("ddp", "between"),
                                           ("ddp-workers", "writing")])
def test_a_kill_inside_an_epoch_resumes_at_the_next_batch_and_ends_bit_identical(tmp_path, tiny_synthetic, unbroken,
                                                                                  setup, moment):
    extra, processes, reference_setup = SETUPS[setup]
    reference = unbroken(reference_setup)
    steps_per_epoch = len(batches(reference)) // 2
    # A step of either epoch, drawn anew each run: mid-epoch, never an epoch's first or last batch.
    step = random.choice([s for s in range(1, 2 * steps_per_epoch) if 0 < s % steps_per_epoch < steps_per_epoch - 1])
    where = f"killed {moment} at step {step}"

    killed_dir = tmp_path / "killed"
    saving = ["--checkpoint.train_time_interval=0:00:00"]
    status, output = fit_child(killed_dir, tiny_synthetic, *extra, *saving, f"--trainer.callbacks+={CALLBACKS}.KillAt",
                         f"--trainer.callbacks.step={step}", f"--trainer.callbacks.moment={moment}")
    assert status == -signal.SIGKILL, f"{where}: {output[-3000:]}"
    # The newest complete checkpoint is the one batch `step` began from: the write it died in left the old file.
    assert last_ckpt(killed_dir)["global_step"] == step, where

    status, output = fit_child(killed_dir, tiny_synthetic, *extra, *saving, "--ckpt_path=last")
    assert status == 0, f"{where}: {output[-3000:]}"
    for rank in range(processes):
        expected = batches(reference, rank)
        # The killed run trained up to batch `step` (and died in it or before it); the resumed run starts at it.
        assert batches(killed_dir, rank) == expected[: step + 1] + expected[step:], f"{where}, rank {rank}"
    assert_same_weights(last_ckpt(killed_dir)["state_dict"], last_ckpt(reference)["state_dict"])
    if processes > 1:
        assert batches(reference, 0) != batches(reference, 1)  # each rank its own shard


# -- restarts by torchrun or SLURM ------------------------------------------------------------------------------
def test_a_restart_resumes_its_own_jobs_run_and_never_the_newest(in_tmp, tiny_synthetic, monkeypatch):
    args = ["fit", *TINY_RUN, f"--data.data_dir={tiny_synthetic}", "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=1"]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    cli_main(args)  # job a: version_0, which records its job
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    cli_main(args)  # another job, newer: version_1
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    resumed = cli_main([*args, "--trainer.max_epochs=2", "--ckpt_path=last"])
    assert Path(resumed.trainer.log_dir).name == "version_0" and resumed.trainer.global_step == 4
    (record,) = [json.loads(line) for line in (in_tmp / "runs/flowers/version_0" / restarts.RESTARTS_FILE)
                 .read_text().splitlines()]
    assert record["attempt"] == 1 and record["global_step"] == 2
    assert record["previous_attempt"] == [{"rank": 0, "reason": restarts.NO_RECORD}]

    # A job restarted before it saved anything starts over, in a folder of its own.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-c")
    fresh = cli_main(args)
    assert Path(fresh.trainer.log_dir).name == "version_2" and fresh.trainer.global_step == 2


def test_the_job_comes_from_the_launchers_variables(monkeypatch):
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    assert restarts.current_job() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default: shared by every job, so not an id
    assert restarts.current_job() is None
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    assert restarts.current_job() == "slurm:123"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert restarts.current_job() == "torchrun:abc"


def test_a_restart_records_why_each_rank_of_the_attempt_before_ended(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-r")
    for rank in (0, 1):  # each rank notes its run folder when fit starts
        restarts.start("torchrun:job-r", tmp_path, global_rank=rank, world_size=2, restarted=False,
                       resumed_from=None, global_step=0)
    monkeypatch.setenv("RANK", "1")
    restarts.record_exit("DataError: a photo went missing")  # rank 1 ended with an error; rank 0 left no word
    for step in (7, 9):  # two restarts; in the second attempt no rank left a word
        restarts.start("torchrun:job-r", tmp_path, global_rank=0, world_size=2, restarted=True,
                       resumed_from="last.ckpt", global_step=step)
    first, second = [json.loads(line) for line in (tmp_path / restarts.RESTARTS_FILE).read_text().splitlines()]
    assert (first["attempt"], first["global_step"], second["attempt"], second["global_step"]) == (1, 7, 2, 9)
    assert first["previous_attempt"] == [{"rank": 0, "reason": restarts.NO_RECORD},
                                         {"rank": 1, "reason": "DataError: a photo went missing"}]
    assert second["previous_attempt"] == [{"rank": 0, "reason": restarts.NO_RECORD},
                                          {"rank": 1, "reason": restarts.NO_RECORD}]
    assert json.loads((tmp_path / restarts.JOB_FILE).read_text()) == {"job": "torchrun:job-r"}


@pytest.mark.slow
@pytest.mark.parametrize("trouble", ["killed", "hung"])
def test_a_torchrun_job_that_loses_a_rank_restarts_itself_and_ends_as_if_never_stopped(tmp_path, tiny_synthetic,
                                                                                        unbroken, trouble):
    # Two torchrun agents ("machines") on 127.0.0.1 sharing the run folder, as nodes share a filesystem. The
    # rendezvous store is this test's, as on a cluster one outlives the job: hosted by an agent, it goes when that
    # agent ends, and the other agent, still polling it, would end with a connection error after the fit succeeded.
    reference = unbroken("ddp")
    steps_per_epoch = len(batches(reference)) // 2
    step = random.choice([s for s in range(1, 2 * steps_per_epoch) if 0 < s % steps_per_epoch < steps_per_epoch - 1])
    where = f"rank 1 {trouble} at step {step}"
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-conf=is_host=false",
               "--rdzv-id=heal", "--max-restarts=1",
               "--monitor-interval=0.5", "-m", "flowers", "fit", *RUN, f"--data.data_dir={tiny_synthetic}",
               "--data.num_workers=0", "--trainer.strategy=ddp", "--trainer.num_nodes=2", "--trainer.devices=1",
               "--checkpoint.train_time_interval=0:00:00", "--ddp_timeout=10",
               f"--trainer.callbacks+={CALLBACKS}.BatchLog", f"--trainer.callbacks.folder={tmp_path}",
               f"--trainer.callbacks+={CALLBACKS}.TroubleOnce", f"--trainer.callbacks.folder={tmp_path}",
               f"--trainer.callbacks.step={step}", f"--trainer.callbacks.trouble={trouble}"]
    # A fresh store for the workers of each round: in the shared one, a restarted worker reads its peer's address of
    # the round before and cannot connect (the setting docs/reliability.md asks for).
    agents = [start(command, tmp_path, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}) for _ in range(2)]
    finish(agents, timeout=400)  # both agents end with success
    del store

    for rank in range(2):  # every batch up to the trouble, then from the checkpoint before it: none skipped
        expected = batches(reference, rank)
        assert batches(tmp_path, rank) == expected[: step + 1] + expected[step:], f"{where}, rank {rank}"
    assert_same_weights(last_ckpt(tmp_path)["state_dict"], last_ckpt(reference)["state_dict"])

    run = tmp_path / "runs/flowers/version_0"
    (record,) = [json.loads(line) for line in (run / restarts.RESTARTS_FILE).read_text().splitlines()]
    assert (record["attempt"], record["global_step"]) == (1, step), where
    reasons = {entry["rank"]: entry["reason"] for entry in record["previous_attempt"]}
    assert "lost contact" in reasons[0], reasons  # the peer that waited for rank 1 gave up
    if trouble == "killed":  # a hung rank stopped by torchrun may still get to record an error of its own
        assert reasons[1] == restarts.NO_RECORD, reasons
    # The resumed attempt logs into the same run, on the steps the unbroken run logged.
    resumed, whole = read_scalars(run), read_scalars(reference / "runs/flowers/version_0")
    for tag in ("train/loss_epoch", "val/acc", "val/loss"):
        assert [s for s, _ in resumed[tag]] == [s for s, _ in whole[tag]], tag
        assert [v for _, v in resumed[tag]] == pytest.approx([v for _, v in whole[tag]], abs=1e-6), tag
