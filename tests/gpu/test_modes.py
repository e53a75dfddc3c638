"""Every training mode the machine allows, each a short `flowers fit` in a process of its own, several at a time.

On CUDA: one GPU in fp32, bf16 and auto, each also on the fast path (configs/fast.yaml, the cache on the GPU, mirror
evaluation, CUDA graphs); dp in fp32, fp16 and bf16, two replicas on GPU 0, and the fast path under dp; dp with
compile, which must be refused in one line; ddp where 2 GPUs are visible. With FLOWERS_GPU_SMOKE=1 on the CPU: the
fast settings, ddp with 2 processes, dp.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers.gpu import DEVICE

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
GPUS = torch.cuda.device_count()
BF16 = GPUS > 0 and torch.cuda.is_bf16_supported()
FAST = ["--config", f"{CONFIGS}/fast.yaml", "--model.eval_hflip=true"]
GPU_FAST = [*FAST, "--data.cache_on_device=true"]
GRAPHS = ["--model.compile=true", "--model.compile_mode=reduce-overhead", "--data.drop_last=true"]
DP_GPU0 = ["--trainer.accelerator=gpu", "--trainer.devices=1",
           "--trainer.strategy=flowers.strategies.DataParallelStrategy",
           "--trainer.strategy.init_args.device_ids=[0, 0]"]
GPU, DP = ["--config", f"{CONFIGS}/gpu.yaml"], ["--config", f"{CONFIGS}/dp.yaml"]
AUTO = ["--trainer.accelerator=auto", "--trainer.devices=auto", "--trainer.strategy=auto"]
# name: (flowers fit settings, the dtype the network's last layer computes in, or "refused WORD"). The compiling
# modes come first: they take longest.
if DEVICE.type == "cuda":
    MODES = {
        "gpu": ([*GPU, "--trainer.precision=32-true"], "float32"),
        "gpu-fast": ([*GPU, "--trainer.precision=32-true", *GPU_FAST, *GRAPHS], "float32"),
        "auto-fast": ([*AUTO, *GPU_FAST, *GRAPHS], "bfloat16" if BF16 else "float32"),
        "gpu-bf16-fast": ([*GPU, *GPU_FAST, *GRAPHS], "bfloat16"),
        "gpu-bf16": (GPU, "bfloat16"),
        "auto": (AUTO, "float32"),
        "dp": (DP, "float32"),
        "dp-16": ([*DP, "--trainer.precision=16-mixed"], "float16"),
        "dp-bf16": ([*DP, "--trainer.precision=bf16-mixed"], "bfloat16"),
        "dp-repeat-gpu0": (DP_GPU0, "float32"),  # scatter, replicate, parallel_apply and gather all run on one GPU
        "dp-fast-cache-gpu0": ([*DP, *GPU_FAST], "float32"),
        "dp-repeat-gpu0-fast": ([*DP_GPU0, *GPU_FAST], "float32"),
        "dp-compile-refused": ([*DP, *GPU_FAST, *GRAPHS], "refused compile"),
        "ddp": (["--config", f"{CONFIGS}/ddp.yaml"], "float32"),
        "ddp-bf16": (["--config", f"{CONFIGS}/ddp.yaml", "--trainer.precision=bf16-mixed"], "bfloat16"),
        "ddp-fast": (["--config", f"{CONFIGS}/ddp.yaml", *GPU_FAST, *GRAPHS], "float32"),
    }
    SIZE, BATCH, EPOCHS, PARALLEL, PER_CLASS = 224, 32, 2, 6, 200
else:
    MODES = {"cpu-fast": (["--config", f"{CONFIGS}/cpu.yaml", *FAST], None),
             "ddp-cpu": (["--config", f"{CONFIGS}/ddp_cpu.yaml", *FAST], None),
             "dp-cpu": (["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.strategy=dp"], None)}
    SIZE, BATCH, EPOCHS, PARALLEL, PER_CLASS = 64, 4, 1, 2, 12
UNAVAILABLE = {name: "needs 2 GPUs" for name in MODES if name.startswith("ddp-") or name == "ddp"} if GPUS == 1 else {}
UNAVAILABLE.update({name: "needs bf16" for name in MODES if "bf16" in name and not BF16 and DEVICE.type == "cuda"})


def run_mode(name: str, settings: list[str], folder: Path) -> dict:
    folder.mkdir(parents=True)
    smaller = ["--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1", "--data.num_workers=0"]
    command = [sys.executable, "-m", "flowers", "fit", *settings, f"--trainer.max_epochs={EPOCHS}",
               f"--data.image_size={SIZE}", f"--data.batch_size={BATCH}", "--trainer.enable_progress_bar=false",
               f"--data.synthetic_dir={folder.parent / 'synthetic'}", f"--data.synthetic_per_class={PER_CLASS}",
               "--trainer.callbacks+=tests.gpu.callbacks.ModeRecord", f"--trainer.callbacks.out_dir={folder}",
               *(smaller if DEVICE.type != "cuda" else [])]
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])  # tests.gpu.callbacks, from any folder
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": path})
    record = folder / "mode.json"
    return {"code": done.returncode, "log": done.stdout + done.stderr,
            "record": json.loads(record.read_text()) if record.is_file() else None}


@pytest.fixture(scope="module")
def modes(tmp_path_factory):
    """Every mode started at once, PARALLEL at a time; a test waits for its own."""
    from flowers.data import synthetic

    folder = tmp_path_factory.mktemp("modes")
    synthetic.ensure_synthetic(folder / "synthetic", per_class=PER_CLASS)  # drawn once, before the modes share it
    with ThreadPoolExecutor(PARALLEL) as pool:
        yield {name: pool.submit(run_mode, name, settings, folder / name)
               for name, (settings, _) in MODES.items() if name not in UNAVAILABLE}


@pytest.mark.parametrize("name", list(MODES))
def test_each_mode_trains_or_is_refused_as_expected(modes, name):
    if name in UNAVAILABLE:
        pytest.skip(f"{name}: {UNAVAILABLE[name]}")
    expected = MODES[name][1]
    run = modes[name].result()
    if expected and expected.startswith("refused"):
        errors = [line for line in run["log"].splitlines() if line.startswith("flowers: error:")]
        assert run["code"] != 0 and "Traceback" not in run["log"], run["log"][-3000:]
        assert errors and expected.split()[1] in errors[-1], run["log"][-3000:]
        return
    assert run["code"] == 0 and run["record"] is not None, run["log"][-3000:]
    record, first = run["record"], modes[next(iter(modes))].result()["record"]
    assert not any(key.startswith("module.") or ".module." in key or "_orig_mod" in key for key in record["keys"])
    assert first is None or record["keys"] == first["keys"]  # every mode saves the same checkpoint
    if expected:
        assert record["dtypes"] == [f"torch.{expected}"], record
