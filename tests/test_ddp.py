"""ddp on CPU (gloo) through real ``python -m flowers`` processes: one machine, exact evaluation, two nodes, and a
dead or hung rank.

Every child runs with OMP_NUM_THREADS=1, 64-px images and a few batches; each is bounded by a timeout that kills its
whole process group, so a hung collective fails the test instead of the suite. The children load test callbacks from
tests/helpers/callbacks.py: ``Probe`` writes what every rank saw to ``probe/*_rankR.json``; ``Fault`` makes rank 1
die (``os._exit``) or hang (sleep without joining the gradient all-reduce) at a chosen batch and writes the moment to
a marker file.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from flowers.cli import cli_main
from flowers.data import FlowerDataModule
from flowers.runs import last_checkpoint
from tests.helpers.images import make_tree
from tests.helpers.processes import DDP_RUN, ROOT, finish, free_port, kill, probes, run_flowers, start, state_dict


@pytest.mark.slow
def test_ddp_two_cpu_processes_write_once_reshuffle_sync_and_scale_the_rate(tmp_path, tiny_synthetic):
    # A previous run's folder: every rank must still agree on the next version, 1.
    (tmp_path / "runs" / "flowers" / "version_0").mkdir(parents=True)
    probe = tmp_path / "probe"
    # Adam at 0.001 with a constant rate and linear scaling: the rate each rank stepped with says what it did.
    run_flowers(["fit", *DDP_RUN, "--trainer.devices=2", "--trainer.max_epochs=2", "--trainer.limit_train_batches=2",
             f"--data.data_dir={tiny_synthetic}", "--trainer.callbacks+=tests.helpers.callbacks.Probe",
             f"--trainer.callbacks.out_dir={probe}", "--model.lr_scaling=linear", "--model.optimizer=torch.optim.Adam",
             "--model.optimizer.lr=0.001"], tmp_path)

    ranks = probes(probe, "fit")
    assert sorted(ranks) == [0, 1] and {r["world_size"] for r in ranks.values()} == {2}
    assert {r["logger_version"] for r in ranks.values()} == {1}
    assert sorted(p.name for p in (tmp_path / "runs" / "flowers").iterdir()) == ["version_0", "version_1"]
    run = tmp_path / "runs" / "flowers" / "version_1"
    files = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())
    assert [f for f in files if f.startswith("checkpoints/")] == sorted([
        "checkpoints/class_indices.json", "checkpoints/last.ckpt", *(f for f in files if "best-epoch" in f)])
    assert sum("best-epoch" in f for f in files) == 1
    assert sum(f.startswith("events.out.tfevents") for f in files) == 1  # rank 0's writer only
    assert "config.yaml" in files
    hparams = yaml.safe_load((run / "hparams.yaml").read_text())
    assert hparams["world_size"] == 2 and hparams["global_batch_size"] == 8 and hparams["lr_scale"] == 2.0
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.002)

    for record in ranks.values():
        # Lightning's DistributedSampler, and set_epoch every epoch: a new order each epoch.
        assert record["sampler_epochs"] == [0, 1]
        assert record["train_orders"][0] != record["train_orders"][1]
    for epoch in (0, 1):
        # Disjoint shards, but for the one repeat that pads the odd training set (55 images) to 2 x 28.
        assert len(set(ranks[0]["train_orders"][epoch]) & set(ranks[1]["train_orders"][epoch])) <= 1
    # Every rank split the files exactly as a single process does (the split never depends on the rank).
    single = FlowerDataModule(str(tiny_synthetic))
    single.setup("fit")
    expected = {name: [str(s.path) for s in dataset.samples]
                for name, dataset in (("train", single.train_set), ("val", single.val_set))}
    assert ranks[0]["split"] == ranks[1]["split"] == expected
    # Logged metrics are the same on every rank: synchronised, not rank-local.
    for key in ("train/loss_epoch", "train/acc", "val/loss", "val/acc", "val/acc_macro"):
        assert ranks[0]["metrics"][key] == pytest.approx(ranks[1]["metrics"][key], abs=1e-6), key


@pytest.mark.slow
def test_ddp_with_the_cache_trains_on_the_loaders_random_views(tmp_path, tiny_synthetic):
    # Lightning rebuilds each rank's training loader around a DistributedSampler. The rebuilt loader must
    # keep the collate that draws each image's crop and flip: without it a cached batch would reach the
    # model as evaluation squares, un-augmented, and nothing would fail.
    probe = tmp_path / "probe"
    run_flowers(["fit", *DDP_RUN, "--trainer.devices=2", "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
             "--trainer.limit_val_batches=1", "--data.cache=true", "--data.eval_image_size=80",
             f"--data.data_dir={tiny_synthetic}", "--trainer.callbacks+=tests.helpers.callbacks.Probe",
             f"--trainer.callbacks.out_dir={probe}"], tmp_path)
    ranks = probes(probe, "fit")
    assert sorted(ranks) == [0, 1]
    for record in ranks.values():
        assert record["train_collate"] == "WithTrainViews"
        assert record["train_image_sides"] == [64]  # the training crops, not the 80-px evaluation squares
        assert len(record["train_views"]) == 2
    assert ranks[0]["train_orders"][0] != ranks[1]["train_orders"][0]  # each rank its own shard
    # The views are drawn in each rank's training process (no loader workers), from generators that
    # seed_everything put in the same state: each rank must still draw its own crops and flips (the
    # images are all 72 px, so equal draws would give equal boxes).
    views = [ranks[rank]["train_views"] for rank in (0, 1)]
    for (boxes0, _), (boxes1, _) in zip(*views, strict=True):
        assert boxes0 != boxes1
    assert [flips for _, flips in views[0]] != [flips for _, flips in views[1]]


@pytest.mark.slow
def test_a_resumed_ddp_run_with_the_cache_continues_exactly(tmp_path, tiny_synthetic):
    # Each rank draws its views from a generator seeded by one draw from its global generator, which
    # must stay in step on all ranks: the checkpoint holds rank 0's RNG state only, and gives it to all.
    run = ["fit", *DDP_RUN, "--trainer.devices=2", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
           "--trainer.deterministic=true", "--data.cache=true", f"--data.data_dir={tiny_synthetic}"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for folder in (straight, resumed):
        folder.mkdir()
    run_flowers([*run, "--trainer.max_epochs=3"], straight)
    run_flowers([*run, "--trainer.max_epochs=1"], resumed)
    run_flowers([*run, "--trainer.max_epochs=3", "--ckpt_path=last"], resumed)
    last = Path("runs/flowers/version_0/checkpoints/last.ckpt")
    expected, got = state_dict(straight / last), state_dict(resumed / last)
    assert list(got) == list(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key


@pytest.mark.slow
def test_the_speedrun_recipe_under_ddp_scales_its_learning_rate_as_documented(tmp_path, tiny_synthetic):
    # docs/gpu.md: the global batch is devices x batch_size, and speedrun.yaml's AdamW rate grows with its root.
    run_flowers(["fit", "--config", str(ROOT / "configs" / "speedrun.yaml"), *DDP_RUN, "--trainer.devices=2",
             "--budget=null", "--trainer.max_epochs=2", "--trainer.limit_train_batches=2",
             "--trainer.limit_val_batches=1",
             "--data.start_image_size=64", "--data.image_size=80", "--data.eval_image_size=96",
             f"--data.data_dir={tiny_synthetic}"], tmp_path)
    run = tmp_path / "runs" / "flowers" / "version_0"
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["optimizer_states"][0]["param_groups"][0]["initial_lr"] == pytest.approx(6e-4 * 2 ** 0.5)
    assert "current_model_state" in checkpoint  # the moving average was kept under ddp too
    hparams = yaml.safe_load((run / "hparams.yaml").read_text())
    assert hparams["lr_scale"] == pytest.approx(2 ** 0.5) and hparams["global_batch_size"] == 8


@pytest.fixture
def eleven_val_images(tmp_path) -> Path:
    root = tmp_path / "odd"
    make_tree(root / "train", dict.fromkeys(("a", "b", "c", "d", "e"), 4), size=64)
    make_tree(root / "val", {"a": 3, "b": 2, "c": 2, "d": 2, "e": 2}, size=64, seed=1)  # 11: odd, not 3k
    return root


@pytest.mark.slow
def test_distributed_validation_equals_single_process(tmp_path, eleven_val_images, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = [f"--data.data_dir={eleven_val_images}", "--data.eval_batch_size=2"]
    fitted = cli_main(["fit", *DDP_RUN, "--trainer.strategy=auto", "--trainer.devices=1", "--trainer.max_epochs=1",
                       *data])
    checkpoint = last_checkpoint(fitted.trainer)
    single = cli_main(["validate", *DDP_RUN, "--trainer.strategy=auto", "--trainer.devices=1", *data,
                       f"--ckpt_path={checkpoint}"])
    expected = {k: float(v) for k, v in single.trainer.callback_metrics.items()}

    for world in (2, 3):
        probe = tmp_path / f"probe{world}"
        run_flowers(["validate", *DDP_RUN, f"--trainer.devices={world}", *data, f"--ckpt_path={checkpoint}",
                     "--trainer.callbacks+=tests.helpers.callbacks.Probe", f"--trainer.callbacks.out_dir={probe}"],
                    tmp_path)
        ranks = probes(probe, "validate")
        assert sorted(ranks) == list(range(world))
        shards = [ranks[r]["eval_shard"] for r in range(world)]
        assert sorted(i for shard in shards for i in shard) == list(range(11))  # each image once, no padding
        assert {r["eval_sampler"] for r in ranks.values()} == {"UnrepeatedDistributedSampler"}
        for record in ranks.values():
            metrics = record["metrics"]
            for key in ("val/acc", "val/acc_macro"):
                assert metrics[key] == pytest.approx(expected[key], abs=1e-6), (world, key)
            # A batch-weighted mean over ranks with uneven batches, not a mean of per-rank means.
            assert metrics["val/loss"] == pytest.approx(expected["val/loss"], rel=1e-5, abs=1e-6), world


def torchrun(node_rank: int, port: int, args: list[str], cwd: Path) -> subprocess.Popen:
    return start([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                  f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}",
                  "-m", "flowers", *args], cwd)


def plain_variables(node_rank: int, port: int, args: list[str], cwd: Path) -> subprocess.Popen:
    # Lightning's LightningEnvironment: it launches this machine's processes itself (here one).
    variables = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "NODE_RANK": str(node_rank)}
    return start([sys.executable, "-m", "flowers", *args], cwd, variables)


def tiny_fit(data: Path) -> list[str]:
    return ["fit", *DDP_RUN, "--trainer.max_epochs=1", "--trainer.limit_train_batches=3",
            "--trainer.limit_val_batches=1", f"--data.data_dir={data}",
            "--trainer.callbacks+=tests.helpers.callbacks.Probe"]


@pytest.fixture(scope="module")
def one_node_weights(tmp_path_factory, tiny_synthetic) -> dict[str, torch.Tensor]:
    """The reference: one machine, two ddp processes, the same data and seed."""
    folder = tmp_path_factory.mktemp("one_node")
    run_flowers([*tiny_fit(tiny_synthetic), f"--trainer.callbacks.out_dir={folder / 'probe'}", "--trainer.devices=2"],
            folder)
    return state_dict(folder / "runs" / "flowers" / "version_0" / "checkpoints" / "last.ckpt")


@pytest.mark.slow
@pytest.mark.parametrize("launch", [torchrun, plain_variables], ids=["torchrun", "env"])
def test_two_nodes_on_localhost_train_like_one_node_with_two_processes(launch, tmp_path, tiny_synthetic,
                                                                        one_node_weights):
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir()
    node1.mkdir()
    probe = tmp_path / "probe"
    args = [*tiny_fit(tiny_synthetic), f"--trainer.callbacks.out_dir={probe}", "--trainer.num_nodes=2",
            "--trainer.devices=1"]
    port = free_port()
    finish([launch(0, port, args, node0), launch(1, port, args, node1)], timeout=300)

    ranks = probes(probe, "fit")
    assert sorted(ranks) == [0, 1] and {r["world_size"] for r in ranks.values()} == {2}
    # Each "node" has its own folder: only global rank 0 writes checkpoints, config and class mapping.
    assert not [p for p in node1.rglob("*") if p.is_file()], "node 1 wrote files"
    checkpoints = node0 / "runs" / "flowers" / "version_0" / "checkpoints"
    assert (checkpoints / "last.ckpt").is_file() and (checkpoints / "class_indices.json").is_file()
    two_nodes = state_dict(checkpoints / "last.ckpt")
    assert list(two_nodes) == list(one_node_weights)
    for key, expected in one_node_weights.items():
        torch.testing.assert_close(two_nodes[key], expected, rtol=0, atol=1e-6, msg=key)


# -- a dead or hung rank ----------------------------------------------------------------------------------------
# A dead peer's socket closes, so rank 0 fails at once ("Connection reset by peer"), before Lightning's launcher (which
# polls its children every 5 s) kills it. A hung peer keeps its socket open: only the gloo timeout, --ddp_timeout, ends
# rank 0 ("Timed out waiting 15000ms for recv operation").
TIMEOUT_S = 15  # --ddp_timeout of the hang case: long enough for a slow start-up, short for a test


def fault_fit(data: Path, marker: Path, action: str) -> list[str]:
    return ["fit", *DDP_RUN, "--trainer.max_epochs=2", "--trainer.limit_train_batches=3",
            "--trainer.limit_val_batches=1", f"--data.data_dir={data}", f"--ddp_timeout={TIMEOUT_S}",
            "--trainer.callbacks+=tests.helpers.callbacks.Fault", f"--trainer.callbacks.marker={marker}",
            f"--trainer.callbacks.action={action}", "--trainer.callbacks.epoch=1"]


def wait_for(process: subprocess.Popen, timeout: float) -> str:
    """Its output; fails (the finally of the caller kills) on a timeout: a rank 0 that never gives up."""
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"rank 0 still running after {timeout} s: it hangs")
    return out


def assert_peer_error(out: str) -> None:
    assert "flowers: error: rank 0 lost contact with another ddp process" in out, out[-3000:]
    assert "--ddp_timeout" in out and "--ckpt_path last" in out
    assert "Traceback" not in out, out[-3000:]


def assert_epoch_0_checkpoint(run_dir: Path) -> None:
    # The failure came mid-epoch 1: last.ckpt is epoch 0's, complete and loadable.
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["epoch"] == 0 and "state_dict" in checkpoint


@pytest.mark.slow
def test_dead_rank_under_lightning_launcher_ends_the_run(tmp_path, tiny_synthetic):
    marker = tmp_path / "fault"
    process = start([sys.executable, "-m", "flowers", *fault_fit(tiny_synthetic, marker, "exit"),
                     "--trainer.devices=2"], tmp_path)
    try:
        out = wait_for(process, timeout=180)
        assert marker.is_file()  # rank 1 died where the test put the fault
        assert process.returncode == 2, out[-3000:]  # our os._exit(2), not the launcher's SIGKILL (-9)
        assert_peer_error(out)
        assert_epoch_0_checkpoint(tmp_path / "runs" / "flowers" / "version_0")
    finally:
        kill(process)


@pytest.mark.slow
@pytest.mark.parametrize("action", ["exit", "hang"])
def test_two_nodes_rank_0_gives_up_on_a_dead_or_hung_peer(action, tmp_path, tiny_synthetic):
    # No launcher between the nodes: only gloo's error or its timeout can end rank 0.
    marker = tmp_path / "fault"
    args = [*fault_fit(tiny_synthetic, marker, action), "--trainer.num_nodes=2", "--trainer.devices=1"]
    port, processes = free_port(), []
    try:
        for node in (0, 1):
            (tmp_path / f"node{node}").mkdir()
            variables = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                         "NODE_RANK": str(node)}
            processes.append(start([sys.executable, "-m", "flowers", *args], tmp_path / f"node{node}", variables))
        out = wait_for(processes[0], timeout=180)
        assert marker.is_file() and processes[0].returncode == 2, out[-3000:]
        if action == "exit":  # the closed socket ended it, not the timeout
            assert "Connection reset by peer" in out or "Connection closed by peer" in out
        else:  # only the timeout --ddp_timeout set can end it
            assert f"Timed out waiting {TIMEOUT_S * 1000}ms" in out, out[-3000:]
        assert_peer_error(out)
        assert_epoch_0_checkpoint(tmp_path / "node0" / "runs" / "flowers" / "version_0")
    finally:
        for process in processes:
            kill(process)  # the hung rank 1 would sleep on for minutes
