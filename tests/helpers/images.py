"""Image files and class-folder trees, drawn from a seeded generator so every run sees the same pixels."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image

# The real flower photos, read-only; the tests that need them skip where the folder is absent.
REAL_PHOTOS = Path(os.environ.get("FLOWERS_DATA_DIR")
                   or Path(__file__).resolve().parents[2].parent / "shared" / "data" / "flowers")


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
