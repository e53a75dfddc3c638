"""What the GPU checks (tests/gpu) share: the device they run on and the size they train at."""

from __future__ import annotations

import os

import pytest
import torch

SMOKE = os.environ.get("FLOWERS_GPU_SMOKE") == "1"  # run the CPU equivalents where there is no GPU
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The tutorial's size on a GPU; the smoke run's CPU equivalents are smaller.
IMAGE_SIZE = 224 if DEVICE.type == "cuda" else 64


def cuda_only() -> None:
    """In a test whose check means nothing on the CPU: skip it there, saying why."""
    if DEVICE.type != "cuda":
        pytest.skip("checks CUDA itself: no CPU equivalent")
