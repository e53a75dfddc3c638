"""Opening any image file as an 8-bit RGB PIL image, refusing what would hang or exhaust the process."""

from __future__ import annotations

import io
import os
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from PIL import Image, ImageOps

# What PIL raises for broken, truncated, foreign or oversized files (DecompressionBombError is none of the others).
DECODE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)
_OPENING = threading.Lock()  # held while the header is read, not while pixels are decoded


@contextmanager
def open_image(path: str) -> Iterator[Image.Image]:
    """``Image.open`` that refuses what would hang or exhaust the process instead of decoding it.

    PIL only *warns* between ``MAX_IMAGE_PIXELS`` (89 M pixels) and twice that, then decodes: a 1-bit PNG
    of a few kB can ask for hundreds of MB per worker. Both levels raise ``DecompressionBombError`` here.
    A FIFO or device named ``*.jpg`` would block ``open`` forever: only regular files are opened.
    """
    if not os.path.isfile(path):
        raise OSError(f"not a regular file: {path}")
    with _open_refusing_bombs(path) as image:
        yield image


def _open_refusing_bombs(source: str | io.BytesIO) -> Image.Image:
    # The warnings filter is one for the whole process: threads opening images at once (the image check, the
    # server's uploads) would restore each other's filters mid-open and let a bomb through as a mere warning.
    with _OPENING, warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            return Image.open(source)
        except Image.DecompressionBombWarning as warning:
            raise Image.DecompressionBombError(f"decompression bomb refused: {warning}") from None


def load_rgb(path: str) -> Image.Image:
    """Open any image as RGB: grayscale, 16-bit, palette, RGBA and CMYK are converted, EXIF rotation applied."""
    with open_image(path) as image:
        return _rgb(image)


def load_rgb_bytes(data: bytes) -> Image.Image:
    """``load_rgb`` for an image held in memory (an upload): the same refusals and the same RGB pixels."""
    with _open_refusing_bombs(io.BytesIO(data)) as image:
        return _rgb(image)


def _rgb(image: Image.Image) -> Image.Image:
    try:
        image = ImageOps.exif_transpose(image)
    except Exception:  # a malformed EXIF block must not cost the photo: use it unrotated
        pass
    image = _to_8bit(image)
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        # Composite transparent pixels on white instead of the black that .convert gives.
        image = image.convert("RGBA")
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(image, mask=image.getchannel("A"))
        return background
    return image.convert("RGB")


def _to_8bit(image: Image.Image) -> Image.Image:
    # 16-bit and float grayscale (PNG, TIFF): .convert("RGB") clips every value above 255 to white.
    if image.mode not in ("I", "F") and not image.mode.startswith("I;16"):
        return image
    pixels = np.asarray(image, dtype=np.float64)
    if image.mode == "F":
        scale = 1 / 255 if pixels.max(initial=0) <= 1 else 1  # floats are usually 0..1
    else:
        scale = 257 if image.mode.startswith("I;16") or pixels.max(initial=0) > 255 else 1
    return Image.fromarray(np.clip(pixels / scale, 0, 255).round().astype(np.uint8), "L")
