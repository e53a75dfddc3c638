"""Opening any image file as an 8-bit RGB PIL image, refusing what would hang or exhaust the process.

``load_rgb`` and ``load_rgb_bytes`` give the whole image, for training and ``predict``. The server needs only a small
square, and decodes for it with bounded memory: ``open_image_bytes`` reads the header, ``reduce_for`` lets a JPEG
decode at a fraction of its size, ``decode_cost`` says from the header how many bytes the decode will take, and
``rgb_square`` decodes, converts and squashes with no copy at full size that it can avoid.
"""

from __future__ import annotations

import io
import os
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from PIL import Image

# What PIL raises for broken, truncated, foreign or oversized files (DecompressionBombError is none of the others).
DECODE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)
_OPENING = threading.Lock()  # held while the header is read, not while pixels are decoded
ORIENTATION = 0x0112  # the EXIF tag
_TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
              5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
              8: Image.Transpose.ROTATE_90}
# Bytes per pixel of PIL's own storage of a mode; every mode not listed takes 4 (RGB is stored as RGBX).
_STORED = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16B": 2, "I;16L": 2, "I;16N": 2, "BGR;15": 2, "BGR;16": 2,
           "BGR;24": 3}
# Formats PIL decodes row by row straight into the image; the others (TIFF strips, WebP, ...) may hold a second copy.
_ROW_BY_ROW = {"JPEG", "PNG", "GIF", "BMP", "PPM", "ICO"}
# 16- and 32-bit grayscale to 8 bits: value / 257 (or / 1 for 32-bit images that fit in 8 bits), rounded, clipped.
_LUTS = {scale: [min(255, round(v / scale)) for v in range(65536)] for scale in (1, 257)}
_STRIP_PIXELS = 1 << 18  # 16-bit and float images are converted a strip of this many pixels at a time
DRAFT_GAP = 2  # a JPEG decodes reduced to no less than this many times the model's side
_DECODER_BYTES = 4 << 20  # a decoder's own row buffers, inflate window and the like, with room to spare


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


def open_image_bytes(data: bytes) -> Image.Image:
    """An image held in memory, opened as ``open_image`` opens a file: its header read, no pixel decoded yet."""
    return _open_refusing_bombs(io.BytesIO(data))


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
        return _rgb(image).convert("RGB")  # a copy even when RGB already: the opened image is closed on return


def load_rgb_bytes(data: bytes) -> Image.Image:
    """``load_rgb`` for an image held in memory (an upload): the same refusals and the same RGB pixels."""
    with open_image_bytes(data) as image:
        return _rgb(image).convert("RGB")


def _rgb(image: Image.Image) -> Image.Image:
    """The image oriented, at 8 bits, on white: RGB, or L where it is gray (the caller converts that to RGB)."""
    image.load()
    image = _oriented(image, _orientation(image))
    image = _to_8bit(image)
    if _transparent(image):
        return _on_white(image)
    return image if image.mode in ("RGB", "L") else image.convert("RGB")


def reduce_for(image: Image.Image, side: int) -> Image.Image:
    """Let a JPEG decode at 1/2, 1/4 or 1/8 of its size (libjpeg's DCT scaling), keeping both sides at least twice
    ``side``: a 48-megapixel photo squashed to 224 px then decodes to 1000 x 750 pixels instead of 8000 x 6000.
    Other formats decode whole. Call it before anything decodes the pixels."""
    if image.format == "JPEG":
        # Twice the side, as PIL's thumbnail does: the resize that follows still averages over 2+ pixels, which
        # keeps the answers closer to a whole decode's than a draft just above the side.
        image.draft(None, (DRAFT_GAP * side, DRAFT_GAP * side))
    return image


def decode_cost(image: Image.Image, side: int) -> int:
    """The bytes ``rgb_square(image, side)`` will take at its peak, from the opened image's header alone (an
    estimate from above): its pixels as PIL stores them, plus the copies that converting and shrinking them need."""
    width, height = image.size
    stored = _STORED.get(image.mode, 4)
    per_pixel = stored + _working_bytes(image)
    if _orientation_in_header(image) in _TRANSPOSE:
        per_pixel += stored  # the rotated copy
    if image.format not in _ROW_BY_ROW:
        per_pixel += stored  # the decoder's own buffer
    # PIL resizes rows first, into an image as tall as the original: a 1-pixel-wide image 80 M pixels tall
    # would grow to side x 80 M pixels on the way.
    cost = width * height * per_pixel + side * max(width, height) * 4 + _DECODER_BYTES
    if image.format == "JPEG" and image.info.get("progressive"):
        scale = image.decoderconfig[0] if image.decoderconfig else 1  # what reduce_for's draft chose
        cost += _coefficient_bytes(image, width * scale, height * scale)
    return cost


def _coefficient_bytes(image: Image.Image, width: int, height: int) -> int:
    """A progressive JPEG keeps every DCT coefficient of its full-size image while it decodes: 2 bytes each, per
    component at its own sampling (a 4:2:0 photo: 3 bytes per pixel; 4:4:4: 6)."""
    layers = getattr(image, "layer", None) or [(0, 1, 1, 0)] * len(image.getbands())
    most_h, most_v = max(layer[1] for layer in layers), max(layer[2] for layer in layers)
    return sum(width * height * 2 * h * v // (most_h * most_v) for _, h, v, _ in layers)


def _working_bytes(image: Image.Image) -> int:
    """Bytes per pixel that ``rgb_square`` adds at full size before it shrinks the image."""
    mode = image.mode
    if mode in ("L", "RGB"):
        return 0  # shrunk as it is
    if mode in ("1", "I", "F") or mode.startswith("I;16"):
        return 1  # an 8-bit grayscale copy
    if mode == "RGBA":
        return 5  # a white background and the alpha channel
    if mode == "LA" or (mode == "P" and "transparency" in image.info):
        return 9  # an RGBA copy, a white background and the alpha channel
    return 4  # an RGB copy (palette, CMYK, YCbCr, ...)


def rgb_square(image: Image.Image, side: int) -> Image.Image:
    """The opened ``image`` decoded and squashed to ``side`` x ``side`` RGB: the pixels ``load_rgb`` gives, resized
    as the evaluation transform resizes them (bilinear, antialiased), with fewer copies at full size on the way.

    Grayscale is shrunk before it becomes RGB (the same pixels: every channel is resized alike), and an image
    already RGB is not copied. Raises what PIL raises for a broken image (``DECODE_ERRORS``).
    """
    budgeted = _orientation_in_header(image)
    image.load()
    orientation = _orientation(image)
    if orientation == budgeted:
        image = _oriented(image, orientation)
    image = _to_8bit(image)
    if _transparent(image):
        image = _on_white(image)
    elif image.mode not in ("RGB", "L"):
        image = image.convert("L" if image.mode == "1" else "RGB")
    square = image.resize((side, side), Image.Resampling.BILINEAR)
    if orientation != budgeted:
        square = _oriented(square, orientation)  # an orientation found only in the decoded file: not budgeted
    return square.convert("RGB")


def _orientation_in_header(image: Image.Image) -> int:
    # A PNG's eXIf chunk may follow its pixels, and PIL decodes them all to find it: read only what is at hand.
    if image.format == "PNG" and "exif" not in image.info:
        return 1
    return _orientation(image)


def _orientation(image: Image.Image) -> int:
    try:
        return int(image.getexif().get(ORIENTATION, 1))
    except Exception:  # a malformed EXIF block must not cost the photo: use it unrotated
        return 1


def _oriented(image: Image.Image, orientation: int) -> Image.Image:
    method = _TRANSPOSE.get(orientation)
    return image if method is None else image.transpose(method)


def _transparent(image: Image.Image) -> bool:
    return image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info)


def _on_white(image: Image.Image) -> Image.Image:
    # Composite transparent pixels on white instead of the black that .convert gives.
    if image.mode != "RGBA":
        image = image.convert("RGBA")
    background = Image.new("RGB", image.size, (255, 255, 255))
    background.paste(image, mask=image.getchannel("A"))
    return background


def _to_8bit(image: Image.Image) -> Image.Image:
    # 16-bit and float grayscale (PNG, TIFF): .convert("RGB") clips every value above 255 to white.
    mode = image.mode
    if mode not in ("I", "F") and not mode.startswith("I;16"):
        return image
    high = image.getextrema()[1]
    if mode == "F":
        return _float_to_8bit(image, 1 / 255 if high <= 1 else 1)  # floats are usually 0..1
    lut = _LUTS[257 if mode.startswith("I;16") or high > 255 else 1]
    if mode == "I":
        return image.point(lut, "L")  # PIL's own pass: no copy but the 8-bit result
    # 16-bit has no such pass: look the values up a strip at a time, never the whole image at 32 or 64 bits.
    table = np.array(lut, dtype=np.uint8)
    width, height = image.size
    rows = max(1, _STRIP_PIXELS // max(width, 1))
    out = Image.new("L", image.size)
    for top in range(0, height, rows):
        strip = np.asarray(image.crop((0, top, width, min(height, top + rows))))
        out.paste(Image.fromarray(table[strip], "L"), (0, top))
    return out


def _float_to_8bit(image: Image.Image, scale: float) -> Image.Image:
    width, height = image.size
    rows = max(1, _STRIP_PIXELS // max(width, 1))
    out = Image.new("L", image.size)
    for top in range(0, height, rows):
        pixels = np.asarray(image.crop((0, top, width, min(height, top + rows))), dtype=np.float64)
        out.paste(Image.fromarray(np.clip(pixels / scale, 0, 255).round().astype(np.uint8), "L"), (0, top))
    return out
