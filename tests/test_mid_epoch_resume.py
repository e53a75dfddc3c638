"""Mid-epoch checkpoints: ``kill -9`` inside an epoch, ``fit --ckpt_path last``, and the run ends bit-identical to
one that was never stopped, having trained every batch once.

The children are real ``python -m flowers fit`` processes saving ``last.ckpt`` after every batch
(``--checkpoint.train_time_interval=0:00:00``). ``KillAt`` SIGKILLs its own process at a chosen step, either
between batches or halfway through writing the checkpoint; ``BatchLog`` appends a fingerprint of every
training batch as the model gets it, so the test can check that the resumed run trained exactly the batches
the killed one had not saved.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch

import flowers.checkpointing
from flowers import restarts
from flowers.analysis import read_scalars
from flowers.data import FlowerDataModule
from flowers.data.sampling import EpochSampler
from tests.test_ddp import child_env, finish, free_port, start

REAL_SAVE = torch.save
RUN = [
    "--trainer.accelerator=cpu",
    "--trainer.max_epochs=2",
    "--trainer.enable_progress_bar=false",
    "--trainer.deterministic=true",
    "--seed_everything=7",
    "--data.image_size=64",
    "--data.batch_size=8",
    "--data.eval_batch_size=32",
]


class BatchLog(L.Callback):
    """Appends ``global_step fingerprint`` of each training batch to ``<folder>/batches_rank<R>.txt``."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        images, labels = batch
        digest = hashlib.sha1(images.float().contiguous().numpy().tobytes() + labels.numpy().tobytes()).hexdigest()
        with open(self.folder / f"batches_rank{trainer.global_rank}.txt", "a") as log:
            log.write(f"{trainer.global_step} {digest[:16]}\n")


class KillAt(L.Callback):
    """SIGKILL this process on rank ``rank`` at ``step``: "between" batches (before batch ``step`` trains), or
    halfway through "writing" the checkpoint that batch ``step`` ends with."""

    def __init__(self, step: int, moment: str, rank: int = 0) -> None:
        self.step, self.moment, self.rank = step, moment, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step or trainer.global_rank != self.rank:
            return
        if self.moment == "between":
            os.kill(os.getpid(), signal.SIGKILL)
        flowers.checkpointing.torch.save = _die_halfway

class TroubleOnce(L.Callback):
    """On rank ``rank`` at ``step``, once per job (a marker file in ``folder`` remembers it): SIGKILL the process
    ("killed") or stop it answering its peers ("hung")."""

    def __init__(self, folder: str, step: int, trouble: str, rank: int = 1) -> None:
        self.marker = Path(folder) / "trouble-done"
        self.step, self.trouble, self.rank = step, trouble, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step or trainer.global_rank != self.rank or self.marker.exists():
            return
        self.marker.touch()
        if self.trouble == "hung":
            time.sleep(3600)
        os.kill(os.getpid(), signal.SIGKILL)


def _die_halfway(obj, file) -> None:
    buffer = io.BytesIO()
    REAL_SAVE(obj, buffer)
    file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    file.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def fit(folder: Path, data: Path, *args: str, timeout: float = 300) -> tuple[int, str]:
    """Exit status and output of a fit in ``folder``; any process it leaves (a ddp rank whose peer was killed)
    is killed with it, so none appends to the batch logs of the next run."""
    folder.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "flowers", "fit", *RUN, f"--data.data_dir={data}",
               f"--trainer.callbacks+={__name__}.BatchLog", f"--trainer.callbacks.folder={folder}", *args]
    process = subprocess.Popen(command, cwd=folder, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
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


def test_last_ckpt_is_written_inside_epochs_when_asked_and_at_every_epoch_end(in_tmp, tiny_synthetic, monkeypatch):
    import shutil

    from flowers.checkpointing import LAST_CHECKPOINT, MID_EPOCH_INTERVAL
    from flowers.cli import cli_main
    from tests.conftest import TINY_RUN

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
            status, output = fit(folder, tiny_synthetic, *SETUPS[setup][0], "--checkpoint.train_time_interval=null")
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
    status, output = fit(killed_dir, tiny_synthetic, *extra, *saving, f"--trainer.callbacks+={__name__}.KillAt",
                         f"--trainer.callbacks.step={step}", f"--trainer.callbacks.moment={moment}")
    assert status == -signal.SIGKILL, f"{where}: {output[-3000:]}"
    # The newest complete checkpoint is the one batch `step` began from: the write it died in left the old file.
    assert last_ckpt(killed_dir)["global_step"] == step, where

    status, output = fit(killed_dir, tiny_synthetic, *extra, *saving, "--ckpt_path=last")
    assert status == 0, f"{where}: {output[-3000:]}"
    for rank in range(processes):
        expected = batches(reference, rank)
        # The killed run trained up to batch `step` (and died in it or before it); the resumed run starts at it.
        assert batches(killed_dir, rank) == expected[: step + 1] + expected[step:], f"{where}, rank {rank}"
    assert_same_weights(last_ckpt(killed_dir)["state_dict"], last_ckpt(reference)["state_dict"])
    if processes > 1:
        assert batches(reference, 0) != batches(reference, 1)  # each rank its own shard


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
               f"--trainer.callbacks+={__name__}.BatchLog", f"--trainer.callbacks.folder={tmp_path}",
               f"--trainer.callbacks+={__name__}.TroubleOnce", f"--trainer.callbacks.folder={tmp_path}",
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
