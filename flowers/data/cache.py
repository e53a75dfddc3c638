"""A decoded uint8 copy of the training images, so an epoch reads memory instead of decoding JPEGs.

Format: ``pixels.npy``, an ``N × 3 × S × S`` uint8 array (memory-mapped when read), every image
squash-resized to ``S × S`` with ``S ≈ 1.14 × image_size`` (256 for 224; never more than the largest
short side among the photos, so small photos are not upsampled twice), plus ``sizes.npy``, each
original ``(height, width)``. Squashing loses no part of the photo and keeps one fixed shape, so batches
collate without padding; the augmentation draws its crop boxes in the original's coordinates and maps
them onto the square (flowers.data.batch_augment), so crop areas and aspect ratios stay the tutorial's, and
the eval squash to ``image_size²`` is a plain resize of the square. 224 px: 196 KB an image,
630 MB for the 3,216 flower photos.

Location: ``<data root>/.cache/<key>`` (hidden, so it is never mistaken for a class folder), or
``<fallback>/<key>`` when the data folder is read-only. ``key`` hashes the file list, every file's size
and mtime and ``S``: adding, removing or touching a photo makes a new key, so the cache is rebuilt.
One process builds under a lock (ddp ranks and concurrent runs wait, then reuse it); it is written to
a temporary folder and renamed into place, so nobody reads a half-written cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from flowers.data.images import load_rgb
from flowers.errors import DataError
from flowers.files import build_once, is_writable

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CACHE_FOLDER = ".cache"
MANIFEST = "manifest.json"  # written last: its presence marks a complete cache


def cache_side(image_size: int) -> int:
    # The usual resize-256-crop-224 margin, so a crop of the whole square is still downsampled.
    return round(image_size * 8 / 7)


def fitting_side(paths: Sequence[str], wanted: int) -> int:
    """``wanted``, or the largest short side among the images when that is smaller.

    Upsampling into the cache adds nothing but a second resampling: photos stored at 227 px, cached at
    256 for 224-px crops, came out blurrier than the PIL path's crops of the originals. Only headers are read.
    """
    largest = 0
    for path in paths:
        try:
            with Image.open(path) as image:
                largest = max(largest, min(image.size))
        except OSError:
            continue  # unreadable: the decoder reports it when the cache is built
    return min(wanted, largest) if largest else wanted


def cache_key(paths: Sequence[str], side: int) -> str:
    digest = hashlib.sha256(json.dumps([FORMAT_VERSION, side]).encode())
    for path in paths:
        stat = os.stat(path)
        digest.update(f"{os.path.abspath(path)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:20]


class ImageCache:
    """The cache of ``paths`` at side ``side``: ``pixels[i]`` is image ``i`` as 3 × S × S uint8."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.paths = json.loads((folder / MANIFEST).read_text())["paths"]
        self.sizes = np.load(folder / "sizes.npy")
        self._pixels = None  # opened lazily, so a DataLoader worker maps the file instead of unpickling a copy

    @property
    def pixels(self) -> np.ndarray:
        if self._pixels is None:
            self._pixels = np.load(self.folder / "pixels.npy", mmap_mode="r")
        return self._pixels

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pixels": None}

    def __len__(self) -> int:
        return len(self.paths)


def upload_in_chunks(pixels: np.ndarray, device: torch.device, *, chunk_bytes: int = 64 << 20) -> torch.Tensor:
    """The memory-mapped ``pixels`` copied to ``device`` a slice at a time: the processes of a machine share
    the file's page cache instead of each holding a private copy of the whole set in host memory."""
    out = torch.empty(pixels.shape, dtype=torch.uint8, device=device)
    per_chunk = max(1, chunk_bytes // max(1, pixels[0].nbytes)) if len(pixels) else 1
    for start in range(0, len(pixels), per_chunk):
        # np.array copies the read-only slice into a writable buffer, which torch.from_numpy wants.
        out[start:start + per_chunk].copy_(torch.from_numpy(np.array(pixels[start:start + per_chunk])))
    return out


def ensure_cache(paths: Sequence[str], *, root: Path, side: int, fallback_dir: Path) -> ImageCache:
    key = cache_key(paths, side)
    base = _cache_base(root, Path(fallback_dir), key=key, needed=len(paths) * 3 * side * side)
    target = base / key

    def build(folder: Path) -> None:
        log.info("Building the image cache of %d images at %d px in %s", len(paths), side, target)
        _build(paths, folder, side)
        _remove_stale(base, keep=key)

    build_once(target, build, is_complete=_is_complete, waiting_for="building the image cache")
    return ImageCache(target)


def _cache_base(root: Path, fallback: Path, *, key: str, needed: int) -> Path:
    """Where the cache is or goes: beside the data, else in ``fallback``; a folder that can be written and,
    for a cache still to build, has room for it. Checked before the build rather than failing minutes into it,
    having taken the room that other writers (checkpoints) need."""
    candidates = [root / CACHE_FOLDER, fallback]
    for base in candidates:
        if _is_complete(base / key):
            return base
    writable = [base for base in candidates if is_writable(base)]
    if not writable:
        raise DataError(f"Cannot write the image cache under {root} nor under {fallback}; set --data.cache_dir.")
    for base in writable:
        if needed <= shutil.disk_usage(base).free * 0.95:
            return base
    room = ", ".join(f"{base}: {shutil.disk_usage(base).free / 2**30:.1f} GiB" for base in writable)
    raise DataError(
        f"The image cache needs {needed / 2**30:.1f} GiB, more than is free where it can go ({room}). Free "
        "space, point --data.cache_dir at a disk with room, or train without it: --data.cache=false."
    )


def _is_complete(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


def _decode(path: str, side: int) -> tuple[np.ndarray, tuple[int, int]]:
    image = load_rgb(path)
    # BILINEAR as eval_transform's Resize uses on PIL images (PIL's resize is antialiased).
    square = image.resize((side, side), Image.Resampling.BILINEAR)
    return np.asarray(square).transpose(2, 0, 1), (image.height, image.width)


BUILD_CHUNK = 256  # images decoded ahead of the write: the build's memory does not grow with the folder


def _build(paths: Sequence[str], folder: Path, side: int) -> None:
    sizes = np.zeros((len(paths), 2), dtype=np.int64)
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)), "fortran_order": False,
              "shape": (len(paths), 3, side, side)}
    # Written through a file, not a writable memory map, whose pages would count against this process's
    # memory until it is closed: the whole set, for a large folder.
    with open(folder / "pixels.npy", "wb") as file, ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        np.lib.format.write_array_header_1_0(file, header)
        for start in range(0, len(paths), BUILD_CHUNK):
            # Threads, not processes: PIL releases the GIL while it decodes and resizes.
            for i, (array, size) in enumerate(pool.map(lambda p: _decode(p, side), paths[start:start + BUILD_CHUNK]),
                                              start=start):
                file.write(np.ascontiguousarray(array).tobytes())
                sizes[i] = size
    np.save(folder / "sizes.npy", sizes)
    (folder / MANIFEST).write_text(json.dumps({"version": FORMAT_VERSION, "side": side, "paths": list(paths)}))


def _remove_stale(base: Path, *, keep: str) -> None:
    # Each change of the photos makes a new key; the old caches would pile up at 600 MB each.
    for entry in base.iterdir():
        if entry.is_dir() and entry.name != keep and not entry.name.startswith("."):
            if _is_complete(entry):
                shutil.rmtree(entry, ignore_errors=True)
