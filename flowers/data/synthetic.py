"""An embedded, procedurally drawn 5-class "flowers" set, so the quickstart needs no download.

The classes differ by shape (petal count, petal outline, centre, side view for tulips) while
every class draws its colours from the same wide distributions, so a model has to look at
shapes: the mean colour of an image says little about its class.
"""

from __future__ import annotations

import colorsys
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from flowers.files import build_once

log = logging.getLogger(__name__)

CLASS_NAMES: tuple[str, ...] = ("daisy", "dandelion", "rose", "sunflower", "tulip")
# Bump whenever the drawing changes, so sets drawn by older code are redrawn instead of reused.
FORMAT_VERSION = 2
MARKER = ".synthetic.json"
SUPERSAMPLE = 2  # draw at 2x and average down: PIL's ImageDraw does not anti-alias.
MIN_SIZE = 16

HSV = tuple[float, float, float]


# ---------------------------------------------------------------------------------------------
# Colours (hue, saturation, value in 0..1; a value above 1 is clipped)


def _rgb(hsv: HSV) -> tuple[int, int, int]:
    h, s, v = hsv
    r, g, b = colorsys.hsv_to_rgb(h % 1.0, min(max(s, 0.0), 1.0), min(max(v, 0.0), 1.0))
    return round(r * 255), round(g * 255), round(b * 255)


def _rgb_many(h: np.ndarray, s: np.ndarray, v: np.ndarray) -> list[tuple[int, int, int]]:
    # colorsys.hsv_to_rgb, vectorised: one call per flower instead of one per petal.
    h, s, v = np.mod(h, 1.0), np.clip(s, 0, 1), np.clip(v, 0, 1)
    sector = np.floor(h * 6)
    frac = h * 6 - sector
    p, q, t = v * (1 - s), v * (1 - s * frac), v * (1 - s * (1 - frac))
    sector = sector.astype(np.int64) % 6
    r = np.choose(sector, [v, q, p, p, t, v])
    g = np.choose(sector, [t, v, v, q, p, p])
    b = np.choose(sector, [p, p, t, v, v, q])
    return [tuple(c) for c in np.rint(np.stack([r, g, b], axis=-1) * 255).astype(np.int64).tolist()]


def _random_hsv(rng: np.random.Generator, s: tuple[float, float], v: tuple[float, float]) -> HSV:
    # Hue is uniform for every class: colour must not give the class away.
    return rng.random(), rng.uniform(*s), rng.uniform(*v)


# Each class leans to a hue, as real flowers do (sunflowers are mostly yellow), but only in part of
# its images and never for the background: the colour helps, the shape decides.
CLASS_HUES = {"daisy": 0.75, "dandelion": 0.15, "rose": 0.97, "sunflower": 0.1, "tulip": 0.88}
CLASS_HUE_SHARE = 0.8


def _petal_hsv(rng: np.random.Generator, class_hue: float | None = None) -> HSV:
    hue, s, v = _random_hsv(rng, s=(0.3, 1.0), v=(0.45, 1.0))
    if class_hue is not None and rng.random() < CLASS_HUE_SHARE:
        hue = class_hue + rng.normal(0, 0.05)
    return hue, s, v


def _shade(hsv: HSV, factor: float) -> HSV:
    return hsv[0], hsv[1], hsv[2] * factor


def _jittered(hsv: HSV, rng: np.random.Generator, n: int, dv: float = 0.08) -> list[tuple[int, int, int]]:
    # Neighbouring petals differ slightly, so their edges stay visible where they overlap.
    h = hsv[0] + rng.normal(0, 0.01, n)
    v = hsv[2] * (1 + rng.uniform(-dv, dv, n))
    return _rgb_many(h, np.full(n, hsv[1]), v)


# ---------------------------------------------------------------------------------------------
# Geometry: shapes are built in flower units (radius 1, y down) and mapped to canvas pixels.

_ANGLES = np.linspace(0, 2 * np.pi, 20, endpoint=False)
_UNIT_CIRCLE = np.stack([np.cos(_ANGLES), np.sin(_ANGLES)], axis=1)


@dataclass(frozen=True)
class _Frame:
    cx: float
    cy: float
    radius: float
    angle: float

    def __call__(self, pts: np.ndarray) -> list:
        """(N, 2) points -> a flat [x0, y0, x1, ...] list for ImageDraw; (K, N, 2) -> K such lists."""
        c, s = math.cos(self.angle), math.sin(self.angle)
        out = pts @ (np.array([[c, s], [-s, c]]) * self.radius) + (self.cx, self.cy)
        return out.reshape(*pts.shape[:-2], -1).tolist()

    def point(self, x: float, y: float) -> tuple[float, float]:
        c, s = math.cos(self.angle), math.sin(self.angle)
        return self.cx + self.radius * (c * x - s * y), self.cy + self.radius * (s * x + c * y)

    def circle(self, x: float, y: float, r: float) -> tuple[float, float, float, float]:
        px, py = self.point(x, y)
        r *= self.radius
        return px - r, py - r, px + r, py + r

    def px(self, length: float) -> int:
        return max(1, round(length * self.radius))


def _spin(pts: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """Rotate the k-th of K shapes, (K, N, 2), by theta[k] about the flower's centre."""
    c, s = np.cos(theta)[:, None], np.sin(theta)[:, None]
    x, y = pts[..., 0], pts[..., 1]
    return np.stack([c * x - s * y, s * x + c * y], axis=-1)


def _ellipse(cx: float, cy: float, a: float, b: float, tilt: float = 0.0) -> np.ndarray:
    x, y = a * _UNIT_CIRCLE[:, 0], b * _UNIT_CIRCLE[:, 1]
    c, s = math.cos(tilt), math.sin(tilt)
    return np.stack([cx + c * x - s * y, cy + s * x + c * y], axis=1)


_LENS_T = np.linspace(0, 1, 10)
_LENS_Y = np.sin(np.pi * _LENS_T)
_UNIT_LENS = np.stack([np.r_[_LENS_T, _LENS_T[::-1]], np.r_[_LENS_Y, -_LENS_Y[::-1]]], axis=1)


def _lens(length: float, width: float) -> np.ndarray:
    # A leaf: two arcs meeting in points at (0, 0) and (length, 0).
    return _UNIT_LENS * (length, width / 2)


def _polar(r: np.ndarray | float, theta: np.ndarray | float) -> np.ndarray:
    return np.stack([r * np.cos(theta), r * np.sin(theta)], axis=-1)


# ---------------------------------------------------------------------------------------------
# The five classes


def _daisy(draw: ImageDraw.ImageDraw, f: _Frame, rng: np.random.Generator) -> None:
    n = int(rng.integers(10, 17))
    colour, centre_r = _petal_hsv(rng, CLASS_HUES["daisy"]), rng.uniform(0.12, 0.2)
    half_width = rng.uniform(0.07, 0.11)
    theta = rng.uniform(0, 2 * np.pi) + 2 * np.pi * np.arange(n) / n + rng.normal(0, 0.04, n)
    # Long thin ellipses from inside the centre out to a slightly uneven tip.
    a = (rng.uniform(0.85, 1.0, n)[:, None] - centre_r * 0.5) / 2
    x = centre_r * 0.5 + a * (1 + _UNIT_CIRCLE[:, 0])
    y = np.broadcast_to(half_width * _UNIT_CIRCLE[:, 1], x.shape)
    petals = f(_spin(np.stack([x, y], axis=-1), theta))
    outline, width = _rgb(_shade(colour, 0.6)), f.px(0.02)
    for petal, fill in zip(petals, _jittered(colour, rng, n), strict=True):
        draw.polygon(petal, fill=fill, outline=outline, width=width)
    draw.ellipse(f.circle(0, 0, centre_r), fill=_rgb(_petal_hsv(rng)))


def _dandelion(draw: ImageDraw.ImageDraw, f: _Frame, rng: np.random.Generator) -> None:
    n = int(rng.integers(30, 61))
    colour, inner = _petal_hsv(rng, CLASS_HUES["dandelion"]), rng.uniform(0.03, 0.1)
    theta = rng.uniform(0, 2 * np.pi) + 2 * np.pi * np.arange(n) / n + rng.normal(0, 0.05, n)
    tips = rng.uniform(0.55, 1.0, n)  # uneven ray lengths: the spiky silhouette is the cue
    rays = f(np.stack([_polar(np.full(n, inner), theta), _polar(tips, theta)], axis=1))
    width = max(2, f.px(0.03))
    for ray, fill in zip(rays, _jittered(colour, rng, n, dv=0.15), strict=True):
        draw.line(ray, fill=fill, width=width)
    if rng.random() < 0.5:
        draw.ellipse(f.circle(0, 0, rng.uniform(0.04, 0.08)), fill=_rgb(_petal_hsv(rng)))


def _rose(draw: ImageDraw.ImageDraw, f: _Frame, rng: np.random.Generator) -> None:
    colour, layers = _petal_hsv(rng, CLASS_HUES["rose"]), int(rng.integers(3, 6))
    spin = rng.uniform(0.3, 0.8) * rng.choice([-1, 1])
    radius, theta0 = 1.0, rng.uniform(0, 2 * np.pi)
    outline, width = _rgb(_shade(colour, 0.55)), f.px(0.025)
    for j in range(layers):
        m, petal_r = int(rng.integers(5, 8)), radius * 0.45
        # Alternating shades per ring give the concentric look of nested petals.
        ring = _shade(colour, 1.0 - 0.25 * (j % 2))
        centres = _polar(radius - petal_r, theta0 + 2 * np.pi * np.arange(m) / m)
        for (x, y), fill in zip(centres.tolist(), _jittered(ring, rng, m), strict=True):
            draw.ellipse(f.circle(x, y, petal_r), fill=fill, outline=outline, width=width)
        radius *= rng.uniform(0.62, 0.72)
        theta0 += spin
    for r in np.geomspace(radius * 1.2, radius * 0.4, 3):  # a tight swirl in the middle
        start = math.degrees(theta0 + r * 9)
        draw.arc(f.circle(0, 0, r), start, start + 260, fill=outline, width=f.px(0.03))


def _sunflower(draw: ImageDraw.ImageDraw, f: _Frame, rng: np.random.Generator) -> None:
    n = int(rng.integers(14, 25))
    colour, centre_r = _petal_hsv(rng, CLASS_HUES["sunflower"]), rng.uniform(0.4, 0.55)
    # Broad triangles that overlap at the base: pointed, but never as thin as a dandelion's rays.
    half, start = np.pi / n * rng.uniform(1.0, 1.3), rng.uniform(0, 2 * np.pi)
    outline = _rgb(_shade(colour, 0.5))
    for row, shade in ((1, 0.7), (0, 1.0)):  # a darker back row, offset half a petal
        theta = start + 2 * np.pi * (np.arange(n) + 0.5 * row) / n
        tips = rng.uniform(0.85, 1.0, n) * (0.93 if row else 1.0)
        base = np.full(n, centre_r * 0.95)
        corners = [_polar(base, theta - half), _polar(tips, theta), _polar(base, theta + half)]
        fills = _jittered(_shade(colour, shade), rng, n)
        for tri, fill in zip(f(np.stack(corners, axis=1)), fills, strict=True):
            draw.polygon(tri, fill=fill, outline=outline)
    centre = _random_hsv(rng, s=(0.3, 1.0), v=(0.25, 0.95))
    draw.ellipse(f.circle(0, 0, centre_r), fill=_rgb(centre))
    # Seeds in a phyllotaxis spiral, lighter or darker than the disc so the texture always shows.
    dots, count = _rgb(_shade(centre, 0.45 if centre[2] > 0.55 else 2.2)), int(90 * centre_r)
    i = np.arange(count)
    seeds = f(_polar(centre_r * 0.9 * np.sqrt((i + 0.5) / count), i * 2.39996))
    r = centre_r * 0.08 * f.radius
    for x, y in zip(seeds[0::2], seeds[1::2], strict=True):
        draw.ellipse((x - r, y - r, x + r, y + r), fill=dots)


def _tulip(draw: ImageDraw.ImageDraw, f: _Frame, rng: np.random.Generator) -> None:
    colour = _petal_hsv(rng, CLASS_HUES["tulip"])
    green = (rng.uniform(0.22, 0.42), rng.uniform(0.4, 0.9), rng.uniform(0.3, 0.8))
    sway, side = rng.uniform(-0.15, 0.15), rng.choice([-1, 1])
    draw.line([f.point(0, 0.0), f.point(sway, 1.0)], fill=_rgb(green), width=f.px(0.07))
    rise = rng.uniform(0.5, 1.0)  # the leaf points up and out from the foot of the stem
    leaf = _lens(rng.uniform(0.6, 0.8), rng.uniform(0.16, 0.24))[None]
    leaf = _spin(leaf, np.array([math.atan2(-math.sin(rise), side * math.cos(rise))]))[0] + (sway * 0.8, 0.9)
    draw.polygon(f(leaf), fill=_rgb(_shade(green, rng.uniform(0.85, 1.15))), outline=_rgb(_shade(green, 0.6)))
    # The cup: two splayed side petals behind, a rounded base, a middle petal in front.
    outline, width = _rgb(_shade(colour, 0.55)), f.px(0.025)
    splay = rng.uniform(0.15, 0.35)
    for sign in (-1, 1):
        petal = _ellipse(sign * 0.2, -0.4, 0.24, 0.45, tilt=sign * splay)
        draw.polygon(f(petal), fill=_rgb(_shade(colour, 0.75)), outline=outline, width=width)
    base = _ellipse(0, -0.2, 0.38, 0.28)
    draw.polygon(f(base), fill=_rgb(_shade(colour, 0.85)), outline=outline, width=width)
    middle = _ellipse(0, -0.42, rng.uniform(0.2, 0.26), 0.45)
    draw.polygon(f(middle), fill=_rgb(_shade(colour, rng.uniform(0.95, 1.1))), outline=outline, width=width)


_DRAWERS: tuple[Callable[[ImageDraw.ImageDraw, _Frame, np.random.Generator], None], ...] = (
    _daisy,
    _dandelion,
    _rose,
    _sunflower,
    _tulip,
)


# ---------------------------------------------------------------------------------------------
# The scene around the flower


def _background(rng: np.random.Generator, n: int) -> Image.Image:
    c0, c1 = (np.array(_rgb(_random_hsv(rng, s=(0.05, 0.9), v=(0.2, 0.95))), np.float32) for _ in range(2))
    angle = rng.uniform(0, 2 * np.pi)
    # A linear gradient survives bilinear upsampling, so draw it small and scale it up: much faster.
    grid = np.linspace(-0.5, 0.5, 8, dtype=np.float32)
    t = grid[None, :] * math.cos(angle) + grid[:, None] * math.sin(angle)
    t = t / (abs(math.cos(angle)) + abs(math.sin(angle))) + 0.5
    small = Image.fromarray((c0 + (c1 - c0) * t[..., None]).round().astype(np.uint8), "RGB")
    return small.resize((n, n), Image.Resampling.BILINEAR)


def _clutter(draw: ImageDraw.ImageDraw, rng: np.random.Generator, n: int) -> None:
    # Lines, blobs and leaves in random colours: distractors a model must learn to ignore.
    for _ in range(int(rng.integers(1, 5))):
        colour = _rgb(_random_hsv(rng, s=(0.1, 0.9), v=(0.2, 0.95)))
        kind = rng.integers(3)
        if kind == 0:
            ends = (rng.uniform(0, n, 4)).tolist()
            draw.line(ends, fill=colour, width=max(1, round(n * rng.uniform(0.01, 0.04))))
        elif kind == 1:
            x, y = rng.uniform(0, n, 2)
            rx, ry = n * rng.uniform(0.03, 0.12, 2)
            draw.ellipse((x - rx, y - ry, x + rx, y + ry), fill=colour)
        else:
            leaf_colour = (rng.uniform(0.15, 0.45), rng.uniform(0.3, 0.9), rng.uniform(0.25, 0.8))
            if rng.random() < 0.5:
                colour = _rgb(leaf_colour)
            f = _Frame(*rng.uniform(0, n, 2), n * rng.uniform(0.15, 0.35), rng.uniform(0, 2 * np.pi))
            draw.polygon(f(_lens(1.0, rng.uniform(0.25, 0.45))), fill=colour)


def _frame(rng: np.random.Generator, n: int, scale: tuple[float, float], upright: bool) -> _Frame:
    radius = rng.uniform(*scale) * n / 2
    margin = min(radius * 0.85, n / 2)  # mostly inside: at most ~15 % of the radius may leave the image
    cx, cy = rng.uniform(margin, n - margin, 2)
    # A tulip is seen from the side, so it only leans; the others are seen from above, any way round.
    angle = rng.uniform(-0.4, 0.4) if upright else rng.uniform(0, 2 * np.pi)
    return _Frame(cx, cy, radius, angle)


def draw_flower(label: int, rng: np.random.Generator, *, size: int = 96) -> Image.Image:
    if not 0 <= label < len(CLASS_NAMES):
        raise ValueError(f"label must be in 0..{len(CLASS_NAMES) - 1}, got {label}.")
    n = size * SUPERSAMPLE
    image = _background(rng, n)
    draw = ImageDraw.Draw(image)
    _clutter(draw, rng, n)
    upright = CLASS_NAMES[label] == "tulip"
    if rng.random() < 0.2:  # sometimes a smaller second flower of the same kind behind the first
        _DRAWERS[label](draw, _frame(rng, n, (0.25, 0.45), upright), rng)
    _DRAWERS[label](draw, _frame(rng, n, (0.55, 0.95), upright), rng)
    image = image.reduce(SUPERSAMPLE)  # a box filter: enough to smooth the jagged edges, and fast
    noise = rng.standard_normal((size, size, 3), dtype=np.float32) * rng.uniform(2, 8)
    pixels = np.asarray(image, np.float32) + noise
    return Image.fromarray(np.clip(pixels, 0, 255).round().astype(np.uint8), "RGB")


# ---------------------------------------------------------------------------------------------
# Writing the set to disk


def _image_rng(seed: int, label: int, index: int) -> np.random.Generator:
    # One generator per image: any image can be redrawn alone, in any order, identically.
    return np.random.default_rng([seed, label, index])


def _params(per_class: int, size: int, seed: int) -> dict:
    if per_class < 1:
        raise ValueError(f"per_class must be at least 1, got {per_class}.")
    if size < MIN_SIZE:
        raise ValueError(f"size must be at least {MIN_SIZE} pixels, got {size}.")
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}.")
    return {
        "format_version": FORMAT_VERSION,
        "per_class": int(per_class),
        "size": int(size),
        "seed": int(seed),
        "classes": list(CLASS_NAMES),
    }


def _read_marker(root: Path) -> dict | None:
    try:
        return json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _check_replaceable(root: Path) -> None:
    # Only a folder this module drew (it has the marker) or an empty one may be replaced.
    if not root.exists() and not root.is_symlink():
        return
    if root.is_dir() and not root.is_symlink() and ((root / MARKER).is_file() or not any(root.iterdir())):
        return
    raise FileExistsError(
        f"Refusing to draw the synthetic flower set into {str(root)!r}: it already exists and is not a "
        f"synthetic set drawn by this project (it has no {MARKER}), so it may be your own data and will "
        "not be deleted. Move or remove it yourself, choose another --data.synthetic_dir, or pass "
        "--data.data_dir to train on that folder."
    )


def _draw_tree(folder: Path, per_class: int, size: int, seed: int) -> None:
    for label, name in enumerate(CLASS_NAMES):
        (folder / name).mkdir(parents=True)
        for index in range(per_class):
            image = draw_flower(label, _image_rng(seed, label, index), size=size)
            # Noisy pixels barely compress: the fastest level saves time for ~10 % more bytes.
            image.save(folder / name / f"{index:05d}.png", compress_level=1)


def _draw_set(folder: Path, *, root: Path, params: dict) -> None:
    _check_replaceable(root)  # fail before spending time drawing
    count = params["per_class"] * len(CLASS_NAMES)
    log.info("Drawing the synthetic flower set (%d images of %d px) into %s", count, params["size"], root)
    started = time.perf_counter()
    _draw_tree(folder, params["per_class"], params["size"], params["seed"])
    # The marker goes in last: a folder that has it is complete.
    (folder / MARKER).write_text(json.dumps(params, indent=2) + "\n")
    _check_replaceable(root)  # anything put there while we drew is not ours to replace
    log.info("Drew the synthetic flower set in %.1f s", time.perf_counter() - started)


def _ensure(root: Path, params: dict, *, reuse: bool) -> Path:
    return build_once(
        root, lambda folder: _draw_set(folder, root=root, params=params),
        is_complete=lambda folder: reuse and _read_marker(folder) == params, waiting_for="drawing the synthetic set",
    )


def generate(root: str | os.PathLike, *, per_class: int = 300, size: int = 96, seed: int = 0) -> Path:
    """Draw the set into ``root``, replacing a synthetic set there (never a folder without the marker)."""
    return _ensure(Path(root), _params(per_class, size, seed), reuse=False)


def ensure_synthetic(root: str | os.PathLike, *, per_class: int = 300, size: int = 96, seed: int = 0) -> Path:
    """``root``, drawn first unless it holds the set these parameters draw."""
    return _ensure(Path(root), _params(per_class, size, seed), reuse=True)
