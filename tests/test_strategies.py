"""strategy="dp" on CPU: registration, refusals, state_dict keys and the autocast-dtype fix for replicas.

The real scatter/gather needs CUDA; tests/gpu/test_modes.py runs it on a GPU machine (`make test-gpu`).
"""

import threading

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import flowers  # noqa: F401  (registers "dp")
from flowers import strategies
from flowers.cli import cli_main
from flowers.errors import ConfigError
from flowers.module import FlowerClassifier
from flowers.runs import last_checkpoint
from flowers.strategies import AutocastReplica, DataParallelStrategy
from tests.helpers.runs import TINY_RUN


def test_dp_is_registered_on_import():
    assert StrategyRegistry["dp"]["strategy"] is DataParallelStrategy
    trainer = L.Trainer(strategy="dp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, DataParallelStrategy)
    assert trainer.world_size == 1 and trainer.global_rank == 0
    assert not trainer._accelerator_connector.is_distributed  # no DistributedSampler: one process sees all


def test_dp_refuses_several_nodes():
    with pytest.raises(ConfigError, match="strategy=dp runs in one process on one machine.*strategy=ddp"):
        L.Trainer(strategy="dp", accelerator="cpu", devices=1, num_nodes=2, logger=False)


def test_dp_refuses_to_be_one_of_several_launched_processes(monkeypatch):
    for name, value in {"RANK": "1", "GROUP_RANK": "0", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                        "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                        "TORCHELASTIC_RUN_ID": "test"}.items():
        monkeypatch.setenv(name, value)  # what torchrun --nproc-per-node 2 sets
    trainer = L.Trainer(strategy="dp", accelerator="cpu", devices=1, logger=False)
    with pytest.raises(ConfigError, match="one of 2 started by torchrun or srun"):
        trainer.strategy.setup_environment()


def test_dp_refuses_a_module_without_the_named_network():
    strategy = DataParallelStrategy(module_name="backbone")
    strategy._lightning_module = FlowerClassifier()
    with pytest.raises(ConfigError, match="'backbone' submodule"):
        strategy._patch_forward()


def test_dp_on_cpu_fits_as_a_plain_forward_with_single_device_checkpoint_keys(in_tmp, tiny_synthetic):
    args = [*TINY_RUN, f"--data.data_dir={tiny_synthetic}", "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=1"]
    with pytest.warns(UserWarning, match="strategy=dp without CUDA runs the plain forward"):
        dp = cli_main(["fit", *args, "--trainer.strategy=dp"])
    assert isinstance(dp.trainer.strategy, DataParallelStrategy)
    single = cli_main(["fit", *args])
    dp_keys = torch.load(last_checkpoint(dp.trainer), weights_only=True)["state_dict"].keys()
    single_keys = torch.load(last_checkpoint(single.trainer), weights_only=True)["state_dict"]
    assert list(dp_keys) == list(single_keys)
    assert not any(key.startswith("module.") or ".module." in key for key in dp_keys)


def test_dp_on_gpus_refuses_a_compiled_network_before_any_work(in_tmp, tiny_synthetic, monkeypatch, capsys):
    from flowers.cli import main

    monkeypatch.setattr(DataParallelStrategy, "on_cuda", lambda self: True)  # what dp sees on a GPU machine
    code = main(["fit", *TINY_RUN, f"--data.data_dir={tiny_synthetic}", "--trainer.strategy=dp",
                 "--model.compile=true"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "model.compile=true cannot be combined with strategy=dp" in err
    assert not list(in_tmp.rglob("*.ckpt"))


def _in_a_parallel_apply_like_thread(module, images):
    """What torch's parallel_apply does per replica: autocast re-entered with the enabled flag only."""
    enabled = torch.is_autocast_enabled("cpu")
    out = {}

    def worker():
        with torch.autocast("cpu", enabled=enabled):  # default CPU dtype: bfloat16
            out["y"] = module(images)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    return out["y"]


def test_replicas_keep_the_callers_autocast_dtype():
    net = torch.nn.Linear(4, 3)
    images = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        # The bug being fixed: the thread falls back to autocast's default dtype.
        assert _in_a_parallel_apply_like_thread(net, images).dtype == torch.bfloat16
        replica = AutocastReplica(net, device_type="cpu")
        replica.capture_autocast()
        assert replica.dtype == torch.float16
        assert _in_a_parallel_apply_like_thread(replica, images).dtype == torch.float16
    replica.capture_autocast()  # outside autocast: replicas run in full precision
    assert replica.dtype is None
    assert _in_a_parallel_apply_like_thread(replica, images).dtype == torch.float32


def test_patched_forward_goes_through_data_parallel_and_keeps_keys(monkeypatch):
    model = FlowerClassifier()
    keys = list(model.state_dict())
    calls = []

    def fake_data_parallel(module, inputs, device_ids, output_device):
        calls.append((device_ids, output_device))
        return _in_a_parallel_apply_like_thread(module, *inputs)

    monkeypatch.setattr(strategies, "data_parallel", fake_data_parallel)
    strategy = DataParallelStrategy(parallel_devices=[torch.device("cpu")] * 2, device_ids=[0, 0])
    strategy._lightning_module = model
    strategy._patch_forward()
    assert "forward" in model.net.__dict__
    images = torch.randn(2, 3, 64, 64)
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(images)
    assert logits.shape == (2, 5) and logits.dtype == torch.float16
    assert calls == [([0, 0], 0)]
    assert list(model.state_dict()) == keys
    strategy._patched.__dict__.pop("forward")  # what teardown does
    assert model(images).dtype == torch.float32 and len(calls) == 1
