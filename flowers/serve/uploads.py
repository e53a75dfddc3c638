"""Turning an upload's bytes into the small square the model sees, refusing what is no image or costs too much.

Runs in the HTTP process, with PIL and numpy only: ``open_upload`` reads the header and says what decoding will
cost, ``square_of`` decodes (the caller holds that many bytes of the server's decode budget meanwhile), and
``give_back_memory`` returns the freed pages to the system afterwards.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import numpy as np
from PIL import Image

from flowers.data.images import DECODE_ERRORS, decode_cost, open_image_bytes, reduce_for, rgb_square

MIB = 2**20
# glibc serves allocations from this size on with their own mmap, returned whole to the system once freed; above its
# default, glibc raises the limit to the largest block freed so far (PIL's 16 MiB blocks), and a thread's freed
# image stays in that thread's heap for good.
MMAP_THRESHOLD = 1 * MIB
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h


class BadImage(ValueError):
    """An upload that is no image the server can classify; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def open_upload(data: bytes, image_size: int, budget_bytes: int | None = None) -> tuple[Image.Image, int]:
    """The upload opened (its header read, no pixel decoded; a JPEG set to decode reduced) and the bytes decoding
    it will take. Raises BadImage: 400 empty, 413 over PIL's pixel limit or ``budget_bytes``, 422 no image."""
    if not data:
        raise BadImage(400, "the body is empty: send the image's bytes, or a multipart form with a field 'file'")
    try:
        image = reduce_for(open_image_bytes(data), image_size)
        cost = decode_cost(image, image_size)
    except Image.DecompressionBombError as error:
        raise BadImage(413, f"the image has too many pixels to decode ({_one_line(error)})") from None
    except Image.UnidentifiedImageError:
        raise BadImage(422, "the body is not an image in a format the server reads (JPEG, PNG, WebP, GIF, "
                            "BMP, TIFF, ...)") from None
    except DECODE_ERRORS as error:
        raise BadImage(422, f"the image could not be decoded ({type(error).__name__}: {_one_line(error)})") \
            from None
    if budget_bytes is not None and cost > budget_bytes:
        width, height = image.size
        raise BadImage(413, f"decoding this {width} x {height} {image.format} image ({image.mode}) would take about "
                            f"{_mib(cost)} MiB, over the {_mib(budget_bytes)} MiB the server allows all decodes at "
                            "once (--decode_budget_mb)")
    return image, cost


def square_of(image: Image.Image, image_size: int) -> np.ndarray:
    """An opened upload's pixels as an ``image_size`` square of uint8 RGB, as ``predict`` reads a file (a large
    JPEG decoded reduced, see ``reduce_for``). Raises BadImage (422) for a broken image."""
    try:
        with image:
            square = rgb_square(image, image_size)
    except DECODE_ERRORS as error:
        raise BadImage(422, f"the image could not be decoded ({type(error).__name__}: {_one_line(error)})") \
            from None
    return np.asarray(square, dtype=np.uint8)


def decode_upload(data: bytes, image_size: int) -> np.ndarray:
    """``open_upload`` then ``square_of``, with no budget: the square the server hands to the model."""
    image, _ = open_upload(data, image_size)
    return square_of(image, image_size)


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None  # glibc, not musl
    except OSError:
        return None


_LIBC = _libc()
_PR_SET_NAME = 15  # prctl's option number, from linux/prctl.h


def return_large_frees() -> None:
    """From now on in this process (and the processes it forks), allocations of ``MMAP_THRESHOLD`` and more
    go back to the system as soon as they are freed (glibc only; elsewhere nothing changes)."""
    if _LIBC is not None:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def give_back_memory() -> None:
    """Return the free pages in the middle of the heaps to the system (glibc's ``malloc_trim``)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def name_process(name: str) -> None:
    """The name ``ps`` and ``top`` show for this process (Linux, glibc; at most 15 bytes are kept)."""
    if _LIBC is not None and hasattr(_LIBC, "prctl"):
        _LIBC.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def _mib(size: int) -> str:
    return f"{size / MIB:,.0f}"


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:300]
