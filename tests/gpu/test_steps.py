"""Fast-path training steps on the GPU: no host sync anywhere in a step, and deterministic runs repeat exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowers.cli import cli_main
from tests.gpu.callbacks import HostSyncCheck
from tests.helpers.gpu import DEVICE, IMAGE_SIZE, cuda_only

pytestmark = pytest.mark.gpu
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def fit(photos: Path, folder: Path, *extra: str):
    """A short `flowers fit` of configs/tutorial.yaml + configs/fast.yaml, the cache on the GPU where there is one."""
    return cli_main(["fit", "--config", str(CONFIGS / "tutorial.yaml"), "--config", str(CONFIGS / "fast.yaml"),
                     "--data.data_dir", str(photos), f"--data.image_size={IMAGE_SIZE}", "--trainer.max_epochs=1",
                     f"--trainer.accelerator={'gpu' if DEVICE.type == 'cuda' else 'cpu'}", "--trainer.devices=1",
                     "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={folder}",
                     *(["--data.cache_on_device=true"] if DEVICE.type == "cuda" else []), *extra])


def test_a_fast_path_step_never_makes_the_host_wait_for_the_gpu(photos, tmp_path):
    # Data fetch, transfer, crop, forward, backward and optimizer step, under set_sync_debug_mode("error").
    cuda_only()
    cli = fit(photos, tmp_path, "--trainer.limit_train_batches=32", "--trainer.limit_val_batches=0",
              "--trainer.callbacks+=tests.gpu.callbacks.HostSyncCheck")
    check = next(c for c in cli.trainer.callbacks if isinstance(c, HostSyncCheck))
    assert check.checked == 30  # every step after the 2 of warm-up ran under the check


@pytest.mark.parametrize("size", [IMAGE_SIZE, 192 if DEVICE.type == "cuda" else 96],
                         ids=["pool-identity", "pool-not-identity"])
def test_deterministic_training_repeats_to_the_bit(photos, tmp_path, size):
    # At 224 px the network's adaptive pool is the identity; at 192 it is not, and its CUDA backward must not race.
    runs = [fit(photos, tmp_path / str(i), "--trainer.deterministic=true", "--seed_everything=7",
                "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=1", f"--data.image_size={size}")
            for i in range(2)]
    first, again = (run.model.state_dict() for run in runs)
    assert all(torch.equal(first[key], again[key]) for key in first)
