"""The fast path's crops on the training device against the CPU's and PIL's: same photos, boxes and flips."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.transforms import functional as TF

from flowers.data.batch_augment import crop_flip_normalise, draw_train_views, eval_batch, sample_crop_boxes
from flowers.data.cache import cache_side, ensure_cache, fitting_side
from flowers.data.folders import find_classes, list_images
from flowers.data.images import load_rgb
from flowers.data.transforms import eval_transform, train_transform
from tests.helpers.gpu import DEVICE, IMAGE_SIZE

pytestmark = pytest.mark.gpu
LEVEL = 2 / 255  # one pixel level, in normalised units (the tutorial's std is 0.5)


@pytest.fixture(scope="module")
def views(photos, tmp_path_factory):
    """64 photos' cache squares, their sizes, and one training view each: the box on the square, the same box in
    the original's pixels, the flip."""
    samples = list_images(photos, find_classes(photos))
    paths = [s.path for s in samples[:: max(1, len(samples) // 64)][:64]]  # spread over the classes
    side = fitting_side(paths, cache_side(IMAGE_SIZE))
    work = tmp_path_factory.mktemp("cache")
    cache = ensure_cache(paths, root=work, side=side, fallback_dir=work / "fallback")
    squares, sizes = torch.from_numpy(np.array(cache.pixels)), torch.from_numpy(cache.sizes)
    # Drawn from generators in the same state: draw_train_views maps sample_crop_boxes' boxes onto the square.
    original_boxes = sample_crop_boxes(sizes, generator=torch.Generator().manual_seed(0))
    boxes, flip = draw_train_views(sizes, side=side, generator=torch.Generator().manual_seed(0))
    return {"paths": paths, "squares": squares, "sizes": sizes, "side": side, "boxes": boxes, "flip": flip,
            "original_boxes": original_boxes}


def pil_views(images, boxes, flip) -> torch.Tensor:
    """train_transform's own crop, flip and normalisation, with the given boxes instead of random ones."""
    crop, _, to_tensor, normalise = train_transform(crop_size=IMAGE_SIZE).transforms
    out = []
    for image, (top, left, height, width), flipped in zip(images, boxes.tolist(), flip.tolist(), strict=True):
        view = TF.resized_crop(image, int(top), int(left), int(height), int(width), crop.size, crop.interpolation,
                               antialias=crop.antialias)
        out.append(normalise(to_tensor(TF.hflip(view) if flipped else view)))
    return torch.stack(out)


def crop(views, *, device=DEVICE, batched=True, dtype=torch.float32) -> torch.Tensor:
    return crop_flip_normalise(views["squares"].to(device), views["boxes"].to(device), views["flip"].to(device),
                               crop_size=IMAGE_SIZE, batched=batched, dtype=dtype).float().cpu()


def test_the_square_boxes_are_the_original_boxes_mapped_onto_the_square(views):
    scaled = views["original_boxes"] * (views["side"] / views["sizes"].double().repeat(1, 2))
    assert ((views["boxes"].double() - scaled).abs() <= 0.5 + 1e-6).all()
    assert 0 < int(views["flip"].sum()) < len(views["flip"])  # both kinds of view are compared


def test_the_batched_crop_on_the_device_is_the_cpus(views):
    on_device, on_cpu = crop(views), crop(views, device=torch.device("cpu"))
    assert (on_device - on_cpu).abs().max() < 1e-3  # the same roi_align, up to float rounding


def test_the_batched_crop_is_close_to_the_per_image_crop_and_to_pils(views):
    batched, each = crop(views), crop(views, device=torch.device("cpu"), batched=False)
    pil_square = pil_views([TF.to_pil_image(square) for square in views["squares"]], views["boxes"], views["flip"])
    # Where a crop shrinks, roi_align averages samples and the others filter: they differ by a few levels on average.
    assert (batched - each).abs().mean() < 4 * LEVEL
    assert (each - pil_square).abs().mean() < LEVEL  # torchvision's uint8 crop is PIL's, to about a level
    assert (batched - pil_square).abs().mean() < 4 * LEVEL
    # Against the original photo the cache's squash adds a second resampling, and nothing else.
    pil_original = pil_views([load_rgb(path) for path in views["paths"]], views["original_boxes"], views["flip"])
    assert (pil_square - pil_original).abs().mean() < 12 * LEVEL
    assert (batched - pil_original).abs().mean() < 12 * LEVEL


def test_a_bf16_batch_is_the_fp32_batch_rounded(views):
    full, half = crop(views), crop(views, dtype=torch.bfloat16)
    assert ((half - full).abs() <= full.abs() * 2**-8 + 1e-6).all()  # bf16 keeps 8 significant bits


def test_evaluation_batches_on_the_device_are_the_cpus_and_close_to_pils(views):
    on_device = eval_batch(views["squares"].to(DEVICE), crop_size=IMAGE_SIZE).cpu()
    assert (on_device - eval_batch(views["squares"], crop_size=IMAGE_SIZE)).abs().max() < 1e-3
    transform = eval_transform(crop_size=IMAGE_SIZE)
    pil = torch.stack([transform(load_rgb(path)) for path in views["paths"]])
    assert (on_device - pil).abs().mean() < 8 * LEVEL
