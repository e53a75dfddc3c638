"""ddp on CPU (gloo) through real ``python -m flowers`` subprocesses: one machine, exact evaluation, two nodes.

Every child runs with OMP_NUM_THREADS=1, 64-px images and a few batches; each is bounded by a timeout
that kills its whole process group, so a hung collective fails the test instead of the suite. The
children load ``tests.ddp_probe.Probe``, which writes what every rank saw to ``probe/*_rankR.json``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from flowers.cli import cli_main
from flowers.data import FlowerDataModule
from flowers.runs import last_checkpoint
from tests.conftest import make_tree

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--trainer.accelerator=cpu",
    "--trainer.strategy=ddp",
    "--trainer.enable_progress_bar=false",
    "--data.image_size=64",
    "--data.batch_size=4",
    "--data.num_workers=0",
]
# Variables through which Lightning would detect a cluster around the test run itself.
CLUSTER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE",
                     "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED")


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARIABLES and not k.startswith("SLURM_")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def start(command: list[str], cwd: Path, variables: dict[str, str] | None = None) -> subprocess.Popen:
    # A new session, so a timeout can kill the launcher's own children (the other ranks) too.
    return subprocess.Popen(command, cwd=cwd, env={**child_env(), **(variables or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def finish(processes: list[subprocess.Popen], timeout: float) -> list[str]:
    """Wait for all; on a timeout or any failure kill every one and fail with their output."""
    outputs = []
    try:
        for process in processes:
            out, _ = process.communicate(timeout=timeout)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for process in processes:
            kill(process)
        pytest.fail(f"a child ran past {timeout} s and was killed")
    failed = [(p.returncode, out[-4000:]) for p, out in zip(processes, outputs, strict=True) if p.returncode != 0]
    if failed:
        for process in processes:
            kill(process)
        pytest.fail(f"exit status {failed[0][0]}:\n{failed[0][1]}")
    return outputs


def flowers(args: list[str], cwd: Path, timeout: float = 240) -> str:
    return finish([start([sys.executable, "-m", "flowers", *args], cwd)], timeout)[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def probes(folder: Path, stage: str) -> dict[int, dict]:
    records = [json.loads(path.read_text()) for path in folder.glob(f"{stage}_rank*.json")]
    return {record["global_rank"]: record for record in records}


def state_dict(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


@pytest.mark.slow
def test_ddp_two_cpu_processes_write_once_reshuffle_and_sync(tmp_path, tiny_synthetic):
    # A previous run's folder: every rank must still agree on the next version, 1.
    (tmp_path / "runs" / "flowers" / "version_0").mkdir(parents=True)
    probe = tmp_path / "probe"
    flowers(["fit", *TINY, "--trainer.devices=2", "--trainer.max_epochs=2", "--trainer.limit_train_batches=2",
             f"--data.data_dir={tiny_synthetic}", "--trainer.callbacks+=tests.ddp_probe.Probe",
             f"--trainer.callbacks.out_dir={probe}"], tmp_path)

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
    assert hparams["world_size"] == 2 and hparams["global_batch_size"] == 8

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
    flowers(["fit", *TINY, "--trainer.devices=2", "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
             "--trainer.limit_val_batches=1", "--data.cache=true", "--data.eval_image_size=80",
             f"--data.data_dir={tiny_synthetic}", "--trainer.callbacks+=tests.ddp_probe.Probe",
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
    run = ["fit", *TINY, "--trainer.devices=2", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
           "--trainer.deterministic=true", "--data.cache=true", f"--data.data_dir={tiny_synthetic}"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for folder in (straight, resumed):
        folder.mkdir()
    flowers([*run, "--trainer.max_epochs=3"], straight)
    flowers([*run, "--trainer.max_epochs=1"], resumed)
    flowers([*run, "--trainer.max_epochs=3", "--ckpt_path=last"], resumed)
    last = Path("runs/flowers/version_0/checkpoints/last.ckpt")
    expected, got = state_dict(straight / last), state_dict(resumed / last)
    assert list(got) == list(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key


@pytest.mark.slow
def test_lr_scaling_multiplies_the_learning_rate_by_the_process_count(tmp_path, tiny_synthetic):
    # Adam at 0.001 with a constant rate: the optimizer each rank stepped with says what the scaling did.
    flowers(["fit", *TINY, "--trainer.devices=2", "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
             "--trainer.limit_val_batches=1", f"--data.data_dir={tiny_synthetic}", "--model.lr_scaling=linear",
             "--model.optimizer=torch.optim.Adam", "--model.optimizer.lr=0.001"], tmp_path)
    run = tmp_path / "runs" / "flowers" / "version_0"
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.002)
    hparams = yaml.safe_load((run / "hparams.yaml").read_text())
    assert hparams["lr_scale"] == 2.0 and hparams["global_batch_size"] == 8


@pytest.mark.slow
def test_the_speedrun_recipe_under_ddp_scales_its_learning_rate_as_documented(tmp_path, tiny_synthetic):
    # docs/gpu.md: the global batch is devices x batch_size, and speedrun.yaml's AdamW rate grows with its root.
    flowers(["fit", "--config", str(ROOT / "configs" / "speedrun.yaml"), *TINY, "--trainer.devices=2",
             "--trainer.max_epochs=2", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
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
    fitted = cli_main(["fit", *TINY, "--trainer.strategy=auto", "--trainer.devices=1", "--trainer.max_epochs=1",
                       *data])
    checkpoint = last_checkpoint(fitted.trainer)
    single = cli_main(["validate", *TINY, "--trainer.strategy=auto", "--trainer.devices=1", *data,
                       f"--ckpt_path={checkpoint}"])
    expected = {k: float(v) for k, v in single.trainer.callback_metrics.items()}

    for world in (2, 3):
        probe = tmp_path / f"probe{world}"
        flowers(["validate", *TINY, f"--trainer.devices={world}", *data, f"--ckpt_path={checkpoint}",
                 "--trainer.callbacks+=tests.ddp_probe.Probe", f"--trainer.callbacks.out_dir={probe}"], tmp_path)
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
    return ["fit", *TINY, "--trainer.max_epochs=1", "--trainer.limit_train_batches=3",
            "--trainer.limit_val_batches=1", f"--data.data_dir={data}", "--trainer.callbacks+=tests.ddp_probe.Probe"]


@pytest.fixture(scope="module")
def one_node_weights(tmp_path_factory, tiny_synthetic) -> dict[str, torch.Tensor]:
    """The reference: one machine, two ddp processes, the same data and seed."""
    folder = tmp_path_factory.mktemp("one_node")
    flowers([*tiny_fit(tiny_synthetic), f"--trainer.callbacks.out_dir={folder / 'probe'}", "--trainer.devices=2"],
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
