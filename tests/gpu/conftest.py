"""The GPU checks (``make test-gpu``): selected only by ``-m gpu``; without CUDA they skip and say why, unless
FLOWERS_GPU_SMOKE=1 runs their CPU equivalents (``benchmarks/gpu/run_all.sh --smoke``)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers.gpu import DEVICE, SMOKE

HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: the default expression leaves these out
def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if HERE in Path(item.fspath).parents]
    expression = config.getoption("markexpr")
    if expression and "gpu" not in expression:  # the default `-m 'not slow'`: leave them to `make test-gpu`
        config.hook.pytest_deselected(items=mine)
        items[:] = [item for item in items if item not in mine]
        return
    for item in mine:
        if DEVICE.type != "cuda" and not SMOKE:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; FLOWERS_GPU_SMOKE=1 runs the CPU equivalents"))


@pytest.fixture(scope="session")
def photos(tmp_path_factory) -> Path:
    """FLOWERS_DATA_DIR's photos, else a few pictures of assorted sizes and aspect ratios (so a crop box's mapping
    from an original onto its cache square meets non-square images)."""
    if os.environ.get("FLOWERS_DATA_DIR"):
        return Path(os.environ["FLOWERS_DATA_DIR"])
    folder, rng = tmp_path_factory.mktemp("photos"), np.random.default_rng(0)
    for name in ("daisy", "dandelion", "rose", "sunflower", "tulip"):
        (folder / name).mkdir()
        for i in range(8):
            width, height = (int(v) for v in rng.integers(64, 120, size=2))
            coarse = rng.integers(0, 256, size=(4, 5, 3), dtype=np.uint8)  # smooth, like out-of-focus photos
            Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC).save(folder / name / f"{i}.jpg")
    return folder
