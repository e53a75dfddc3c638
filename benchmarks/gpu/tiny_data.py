"""``python benchmarks/gpu/tiny_data.py DIR``: a tiny folder of class folders for the smoke run of the GPU checks.

Smooth random pictures (a few random colours blended across the frame) of assorted sizes and aspect
ratios, so the crop boxes' mapping from an original onto its cache square is exercised with non-square
images. Only numpy and PIL: drawing them costs no torch start-up.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ("daisy", "dandelion", "rose", "sunflower", "tulip")


def draw(folder: Path, *, per_class: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    for name in CLASSES:
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            width, height = (int(v) for v in rng.integers(64, 120, size=2))
            coarse = rng.integers(0, 256, size=(4, 5, 3), dtype=np.uint8)
            # Bicubic enlargement of a 5 x 4 grid: smooth gradients, like out-of-focus photos.
            picture = Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC)
            picture.save(folder / name / f"{i:03d}.jpg")
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/gpu/tiny_data.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--per-class", type=int, default=8)
    args = parser.parse_args(argv)
    draw(args.folder, per_class=args.per_class)
    print(args.folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
