"""python -m flowers export: state_dict for the tutorial's class, TorchScript and ONNX that match PyTorch."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from flowers.analysis import load
from flowers.export import main
from tests.helpers.runs import best_checkpoint
from tests.helpers.tutorial_alexnet import AlexNet as TutorialAlexNet


@pytest.fixture
def ckpt(trained_run) -> Path:
    return best_checkpoint(trained_run)


def _reference(ckpt: Path, images: torch.Tensor) -> torch.Tensor:
    model, _, _ = load(ckpt)
    with torch.inference_mode():
        return model.net(images)


def _class_indices(folder: Path) -> dict:
    return json.loads((folder / "class_indices.json").read_text())


def test_state_dict_loads_strictly_into_the_tutorial_alexnet(ckpt, tmp_path):
    assert main(["--ckpt_path", str(ckpt), "--format", "state_dict", "--output", str(tmp_path)]) == 0
    state = torch.load(tmp_path / "AlexNet.pth", weights_only=True)
    assert next(iter(state)) == "features.0.weight" and not any(k.startswith("net.") for k in state)
    tutorial = TutorialAlexNet(num_classes=5)
    tutorial.load_state_dict(state, strict=True)
    images = torch.randn(2, 3, 224, 224)  # the tutorial's net has no adaptive pool: feed it its own size
    with torch.inference_mode():
        torch.testing.assert_close(tutorial.eval()(images), _reference(ckpt, images))
    assert _class_indices(tmp_path)["0"] == "daisy"


def test_torchscript_matches_pytorch(ckpt, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # torch's TorchScript deprecation is expected and caught
        assert main(["--ckpt_path", str(ckpt), "--format", "torchscript", "--output", str(tmp_path)]) == 0
    scripted = torch.jit.load(str(tmp_path / "AlexNet.torchscript.pt"))
    images = torch.randn(3, 3, 64, 64)
    with torch.inference_mode():
        torch.testing.assert_close(scripted(images), _reference(ckpt, images))


def test_onnx_matches_pytorch_with_any_batch_size(ckpt, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    assert main(["--ckpt_path", str(ckpt), "--format", "onnx", "--output", str(tmp_path)]) == 0
    session = ort.InferenceSession(str(tmp_path / "AlexNet.onnx"), providers=["CPUExecutionProvider"])
    for batch in (1, 5):
        images = torch.randn(batch, 3, 64, 64)  # the run's image size, read from its config.yaml
        (logits,) = session.run(["logits"], {"images": images.numpy()})
        np.testing.assert_allclose(logits, _reference(ckpt, images).numpy(), rtol=1e-4, atol=1e-5)
    assert list(_class_indices(tmp_path).values()) == ["daisy", "dandelion", "rose", "sunflower", "tulip"]


def test_the_module_entry_dispatches_export_and_reports_a_missing_checkpoint(tmp_path):
    done = subprocess.run([sys.executable, "-m", "flowers", "export", "--ckpt_path", str(tmp_path / "no.ckpt")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "does not exist" in done.stderr and "Traceback" not in done.stderr


