"""Shared fixtures: tiny image trees and the CLI arguments that make a run take seconds."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

# The real flower photos, read-only; the tests that need them skip where the folder is absent.
REAL_PHOTOS = Path(os.environ.get("FLOWERS_DATA_DIR")
                   or Path(__file__).resolve().parents[1].parent / "shared" / "data" / "flowers")

# Arguments that shrink any fit/validate/predict to a few seconds on CPU.
TINY_RUN = [
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.max_epochs=1",
    "--trainer.enable_progress_bar=false",
    "--data.image_size=64",
    "--data.batch_size=4",
    "--data.num_workers=0",
]


class RecordOps(TorchDispatchMode):
    """While active, names every tensor operation run (on a GPU, each would be a kernel launch)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def write_images(folder: Path, count: int, *, size: int = 72, seed: int = 0, ext: str = ".jpg") -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, count, len(folder.name)])
    paths = []
    for i in range(count):
        pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        path = folder / f"img{i:03d}{ext}"
        Image.fromarray(pixels).save(path)
        paths.append(path)
    return paths


def make_tree(root: Path, counts: dict[str, int], **kwargs) -> Path:
    for name, count in counts.items():
        write_images(root / name, count, **kwargs)
    return root


@pytest.fixture(scope="session")
def tiny_synthetic(tmp_path_factory) -> Path:
    """A small synthetic flower set in the single-folder layout, drawn once per test session."""
    from flowers.data import synthetic

    return synthetic.ensure_synthetic(tmp_path_factory.mktemp("synthetic") / "flowers", per_class=12, size=72)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Run in a fresh folder so runs/ and data/ land in tmp, not in the checkout."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def real_photos() -> Path:
    if not REAL_PHOTOS.is_dir():
        pytest.skip(f"real photos not found at {REAL_PHOTOS} (set FLOWERS_DATA_DIR)")
    return REAL_PHOTOS


def pytest_configure(config):
    # Keep torch from oversubscribing the 2 CI cores when tests spawn worker processes.
    os.environ.setdefault("OMP_NUM_THREADS", "2")
