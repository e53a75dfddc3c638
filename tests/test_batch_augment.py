"""The batched uint8 augmentation matches the tutorial's PIL transforms in distribution and in value."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from flowers.data import synthetic
from flowers.data.batch_augment import crop_flip_normalise, draw_train_views, eval_batch, sample_crop_boxes
from flowers.data.cache import _decode, cache_side
from flowers.data.datasets import CachedBatch
from flowers.data.transforms import eval_transform
from tests.helpers.ops import RecordOps


def train_batch(squares: torch.Tensor, sizes: torch.Tensor, *, crop_size: int, generator=None, batched=None,
                channels_last: bool = False, **draw) -> torch.Tensor:
    # What fit does to a cached training batch, in one call: the loader's draw, then the device's cut.
    boxes, flip = draw_train_views(sizes, side=squares.shape[-1], generator=generator, **draw)
    return crop_flip_normalise(squares, boxes, flip, crop_size=crop_size, channels_last=channels_last,
                               batched=batched)


def _torchvision_boxes(height: int, width: int, n: int, scale, ratio=(3 / 4, 4 / 3)) -> np.ndarray:
    image = torch.empty(1, height, width)
    return np.array([T.RandomResizedCrop.get_params(image, list(scale), list(ratio)) for _ in range(n)], dtype=float)


@pytest.mark.parametrize(("height", "width", "scale"), [
    (240, 320, (0.08, 1.0)),   # a typical flower photo
    (500, 160, (0.08, 1.0)),   # tall: many tries fail, the centre-crop fallback matters
    (64, 64, (0.6, 1.0)),      # small, the quickstart's milder crop: rounding matters
])
def test_crop_boxes_match_torchvision_in_distribution(height, width, scale):
    torch.manual_seed(0)
    ours = sample_crop_boxes(torch.tensor([[height, width]] * 20000), scale=scale).numpy()
    theirs = _torchvision_boxes(height, width, 4000, scale)
    for boxes in (ours, theirs):
        assert (boxes[:, 0] >= 0).all() and (boxes[:, 1] >= 0).all()
        assert (boxes[:, 0] + boxes[:, 2] <= height).all() and (boxes[:, 1] + boxes[:, 3] <= width).all()

    def stats(boxes):
        area = boxes[:, 2] * boxes[:, 3] / (height * width)
        log_aspect = np.log(boxes[:, 3] / boxes[:, 2])
        centre_y = (boxes[:, 0] + boxes[:, 2] / 2) / height
        return {name: np.quantile(v, [0.1, 0.25, 0.5, 0.75, 0.9]) for name, v in
                {"area": area, "log_aspect": log_aspect, "centre_y": centre_y}.items()}

    a, b = stats(ours), stats(theirs)
    # 4,000 torchvision draws: a quantile's standard error is about 0.01 of the range.
    np.testing.assert_allclose(a["area"], b["area"], atol=0.03)
    np.testing.assert_allclose(a["log_aspect"], b["log_aspect"], atol=0.03 * math.log(16 / 9))
    np.testing.assert_allclose(a["centre_y"], b["centre_y"], atol=0.03)


def test_fallback_is_torchvisions_centre_crop():
    # scale above 1 never fits: every box is the fallback, which torchvision computes deterministically.
    ours = sample_crop_boxes(torch.tensor([[500, 160], [160, 500], [100, 100]]), scale=(2.0, 3.0))
    expected = [_torchvision_boxes(h, w, 1, (2.0, 3.0))[0] for h, w in ((500, 160), (160, 500), (100, 100))]
    np.testing.assert_array_equal(ours.numpy(), np.array(expected))


@pytest.mark.parametrize("batched", [False, True])
def test_flip_probability_and_output_format(batched):
    torch.manual_seed(0)
    n, side = 600, 16
    squares = torch.zeros(n, 3, side, side, dtype=torch.uint8)
    squares[..., side // 2:] = 255  # dark left, bright right
    out = train_batch(squares, torch.tensor([[side, side]] * n), crop_size=12, scale=(1.0, 1.0), ratio=(1.0, 1.0),
                      batched=batched)
    assert out.shape == (n, 3, 12, 12) and out.dtype == torch.float32
    # The tutorial's mean and std of 0.5 map 0 and 255 to -1 and 1 (to float rounding: one fused multiply-add).
    torch.testing.assert_close((out.min().item(), out.max().item()), (-1.0, 1.0))
    flipped = (out[..., :6].mean(dim=(1, 2, 3)) > out[..., 6:].mean(dim=(1, 2, 3))).float().mean()
    assert abs(flipped - 0.5) < 0.07  # 600 draws: 4 standard errors
    none = train_batch(squares, torch.tensor([[side, side]] * n), crop_size=12, scale=(1.0, 1.0), ratio=(1.0, 1.0),
                       hflip_prob=0.0, batched=batched)
    assert (none[..., :6] < none[..., 6:]).all()


def test_train_crops_show_the_boxes_region():
    # A whole-image box must give the squash of the whole photo: the box maps from original to square.
    torch.manual_seed(0)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 50, 3), dtype=np.uint8))
    square, size = _decode_pil(image, 40)
    out = train_batch(square[None], torch.tensor([size]), crop_size=40, scale=(1.0, 1.0), ratio=(50 / 30, 50 / 30),
                      hflip_prob=0.0)
    np.testing.assert_allclose(out[0].numpy(), eval_batch(square[None], crop_size=40)[0].numpy(), atol=1e-6)


def _decode_pil(image: Image.Image, side: int):
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".png") as handle:
        image.save(handle.name)
        array, size = _decode(handle.name, side)
    return torch.from_numpy(array.copy()), list(size)


@pytest.mark.parametrize(("size", "crop"), [((96, 96), 64), ((180, 120), 112), ((90, 150), 64)])
def test_eval_matches_eval_transform(size, crop):
    rng = np.random.default_rng(1)
    image = synthetic.draw_flower(2, rng, size=max(size)).resize(size, Image.Resampling.BICUBIC)
    square, _ = _decode_pil(image, cache_side(crop))
    ours = eval_batch(square[None], crop_size=crop)[0]
    reference = eval_transform(crop_size=crop)(image)
    assert ours.shape == reference.shape
    difference = (ours - reference).abs()
    # Two resizes instead of one: a few grey levels off on edges, nothing on average (range is 2).
    assert difference.mean() < 0.015 and difference.max() < 0.25, (difference.mean(), difference.max())


def test_channels_last_output_has_the_same_values():
    squares = torch.randint(0, 256, (6, 3, 40, 40), dtype=torch.uint8)
    sizes = torch.tensor([[60, 80]] * 6)
    generator = torch.Generator().manual_seed(3)
    plain = train_batch(squares, sizes, crop_size=32, generator=generator)
    generator.manual_seed(3)
    nhwc = train_batch(squares, sizes, crop_size=32, generator=generator, channels_last=True)
    assert nhwc.is_contiguous(memory_format=torch.channels_last) and not plain.is_contiguous(
        memory_format=torch.channels_last)
    torch.testing.assert_close(nhwc, plain, rtol=0, atol=1e-6)
    evaluated = eval_batch(squares, crop_size=32, channels_last=True)
    assert evaluated.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(evaluated, eval_batch(squares, crop_size=32), rtol=0, atol=1e-6)


def test_a_photo_cached_at_its_own_size_gets_pils_crop_for_the_same_box(monkeypatch):
    # The shared photos are squares cached as they are: then a box's crop must be the tutorial's, not just
    # alike in distribution (PIL's resized_crop, ToTensor, Normalize), up to a grey level of rounding.
    from torchvision.transforms import functional as TF

    from flowers.data import batch_augment

    rng = np.random.default_rng(4)
    image = synthetic.draw_flower(1, rng, size=227)
    square, size = _decode_pil(image, 227)
    boxes = [(10, 20, 80, 90), (0, 0, 227, 227), (50, 30, 150, 120), (100, 5, 127, 222)]
    for top, left, h, w in boxes:
        monkeypatch.setattr(batch_augment, "sample_crop_boxes",
                            lambda *args, box=(top, left, h, w), **kwargs: torch.tensor([box], dtype=torch.float64))
        ours = train_batch(square[None], torch.tensor([size]), crop_size=224, hflip_prob=0.0)[0]
        reference = TF.normalize(TF.to_tensor(TF.resized_crop(image, top, left, h, w, [224, 224], antialias=True)),
                            [0.5] * 3, [0.5] * 3)
        difference = (ours - reference).abs()  # one grey level is 2/255 after Normalize(0.5, 0.5)
        assert difference.max() <= 2 / 255 + 1e-6 and difference.mean() < 0.1 / 255, (top, left, h, w)


def test_batched_crop_gives_the_per_image_crops_pixels():
    # The GPU's one-call crop (roi_align) against the CPU's per-image resized_crop, for the same boxes of
    # the tutorial's distribution, on photo-like images: the same pictures up to edge and filter details.
    from flowers.data.batch_augment import _crop_batched, _crop_each

    rng = np.random.default_rng(5)
    squares = torch.stack([_decode_pil(synthetic.draw_flower(k % 5, rng, size=227), 227)[0] for k in range(12)])
    torch.manual_seed(0)
    boxes = sample_crop_boxes(torch.tensor([[227, 227]] * 12)).round().long()
    each, batched = _crop_each(squares, boxes, 224).float(), _crop_batched(squares, boxes, 224)
    assert batched.shape == each.shape == (12, 3, 224, 224)
    assert (batched - each).abs().mean() < 1.0  # grey levels of 255; they differ only near the boxes' edges
    # A box the crop's own size is copied exactly; a whole square shrunk is its area average.
    whole = torch.tensor([[0, 0, 224, 224]] * 12)
    torch.testing.assert_close(_crop_batched(squares[:, :, :224, :224], whole, 224), squares[:, :, :224, :224].float())
    halved = _crop_batched(squares[:, :, :224, :224], whole, 112)
    torch.testing.assert_close(halved, torch.nn.functional.avg_pool2d(squares[:, :, :224, :224].float(), 2))


def test_the_training_loader_draws_each_images_view_reproducibly():
    # The loader's collate draws the boxes and flips on the host, with torch's generator: in a worker
    # too (each seeded from the main process's generator), so the same seed gives the same views.
    from torch.utils.data import DataLoader

    from flowers.data.batch_augment import CachedTrainBatch, WithTrainViews

    items = [CachedBatch(torch.full((3, 40, 40), i, dtype=torch.uint8), i % 5, torch.tensor([30 + i, 60]))
             for i in range(16)]
    views = WithTrainViews(side=40, scale=(0.08, 1.0))

    def draw(workers: int):
        torch.manual_seed(7)
        return list(DataLoader(items, batch_size=8, num_workers=workers, collate_fn=views))

    for workers in (0, 2):
        first, again = draw(workers), draw(workers)
        assert all(isinstance(batch, CachedTrainBatch) for batch in first)
        for (squares, labels, boxes, flip), (_, _, boxes_again, flip_again) in zip(first, again, strict=True):
            assert squares.shape == (8, 3, 40, 40) and labels.shape == (8,)
            assert boxes.dtype == torch.int64 and flip.dtype == torch.bool
            assert torch.equal(boxes, boxes_again) and torch.equal(flip, flip_again)
            top, left, height, width = boxes.unbind(1)
            assert (top >= 0).all() and (left >= 0).all() and (height >= 1).all() and (width >= 1).all()
            assert (top + height <= 40).all() and (left + width <= 40).all()
        assert not torch.equal(first[0][2], first[1][2])  # each batch its own draw


def test_a_batchs_views_come_from_its_items_seeds_and_leave_the_global_generator_alone():
    # The training sampler gives every position of an epoch its own seed (flowers.data.sampling): the views
    # are then the same with any number of workers and on a resume inside the epoch, differ between ddp
    # ranks (other positions), and the training process's generator (dropout) never moves for them.
    from flowers.data.batch_augment import WithTrainViews

    def collate(first_seed: int, global_seed: int):
        torch.manual_seed(global_seed)
        items = [CachedBatch(torch.tensor(i), i % 5, torch.tensor([48, 64]), first_seed + i) for i in range(32)]
        _, _, boxes, flip = WithTrainViews(side=64)(items)
        return boxes, flip, torch.get_rng_state()

    boxes, flip, state = collate(first_seed=10, global_seed=0)
    again_boxes, again_flip, _ = collate(first_seed=10, global_seed=1)
    assert torch.equal(boxes, again_boxes) and torch.equal(flip, again_flip)
    torch.manual_seed(0)
    assert torch.equal(state, torch.get_rng_state())
    other_boxes, other_flip, _ = collate(first_seed=99, global_seed=0)
    assert not torch.equal(boxes, other_boxes) and not torch.equal(flip, other_flip)

    # Items read by index (no seed) draw from the global generator.
    torch.manual_seed(3)
    items = [CachedBatch(torch.tensor(i), i % 5, torch.tensor([48, 64])) for i in range(32)]
    _, _, boxes, flip = WithTrainViews(side=64)(items)
    torch.manual_seed(3)
    expected = draw_train_views(torch.tensor([[48, 64]] * 32), side=64)
    assert torch.equal(boxes, expected[0]) and torch.equal(flip, expected[1])


def test_a_gpu_batch_is_a_handful_of_operations_with_no_host_data():
    # On a GPU each operation is a kernel launch, and the tutorial's batch of 32 is bound by launches. The
    # views come from the loader; the device only gathers, crops, flips and normalises: no random draws
    # there, and no tensor built from host data (a blocking copy that waits for the GPU's queue).
    from flowers.data.batch_augment import WithTrainViews, crop_flip_normalise

    cache = torch.randint(0, 256, (50, 3, 64, 64), dtype=torch.uint8)  # the cache held on the device
    items = [CachedBatch(torch.tensor(i), i % 5, torch.tensor([48, 64])) for i in range(32)]
    indices, _, boxes, flip = WithTrainViews(side=64)(items)
    crop_flip_normalise(cache[indices], boxes, flip, crop_size=56, batched=True)  # first call builds constants
    with RecordOps() as record:
        images = crop_flip_normalise(cache[indices], boxes, flip, crop_size=56, channels_last=True, batched=True)
    ops = record.ops
    assert images.shape == (32, 3, 56, 56) and images.is_contiguous(memory_format=torch.channels_last)
    assert not {"rand", "uniform_", "lift_fresh", "_local_scalar_dense"} & set(ops), ops
    assert len(ops) <= 16, ops


def test_a_gpu_batch_is_cropped_flipped_and_normalised_into_its_dtype_and_layout_in_three_passes():
    # roi_align's float NCHW output once meant a flipped copy, a select, a relayout, the normalisation and
    # autocast's bf16 cast: five full-size passes after the crop. Now: the crop, one gather, one addcmul.
    from torch.utils._python_dispatch import TorchDispatchMode

    class FullSizeOps(TorchDispatchMode):
        def __init__(self, numel: int) -> None:
            super().__init__()
            self.numel, self.ops = numel, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if isinstance(out, torch.Tensor) and out.numel() == self.numel and not name.startswith("empty"):
                self.ops.append(name)
            return out

    squares = torch.randint(0, 256, (8, 3, 40, 40), dtype=torch.uint8)
    boxes, flip = draw_train_views(torch.tensor([[40, 40]] * 8), side=40, generator=torch.Generator().manual_seed(1))
    reference = crop_flip_normalise(squares, boxes, flip, crop_size=24, batched=True)
    with FullSizeOps(8 * 3 * 24 * 24) as record:
        images = crop_flip_normalise(squares, boxes, flip, crop_size=24, batched=True, channels_last=True,
                                     dtype=torch.bfloat16)
    assert [op for op in record.ops if op not in ("view", "expand", "_to_copy")][:3] == ["roi_align", "gather",
                                                                                         "addcmul"]
    assert len(record.ops) - record.ops.count("view") - record.ops.count("expand") == 3, record.ops
    assert images.dtype == torch.bfloat16 and images.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(images.float(), reference, rtol=0, atol=0.01)  # bf16 rounding of values up to 2.1


def test_only_a_bf16_run_on_a_gpu_gets_bf16_batches():
    from flowers.data import FlowerDataModule
    from flowers.data.pipelines import BatchContext

    class OnGpu:
        is_cuda = True

    bf16 = BatchContext(training=True, train_size=64, bf16=True)
    assert bf16.dtype(images_on=OnGpu()) == torch.bfloat16
    assert bf16.dtype(images_on=torch.zeros(1)) == torch.float32  # CPU: float32 even under bf16
    assert BatchContext(training=True, train_size=64).dtype(images_on=OnGpu()) == torch.float32

    # The DataModule reads the run's precision from its trainer.
    seen = []

    class Recording:
        def on_device(self, batch, context):
            seen.append(context.bf16)
            return batch

    module = FlowerDataModule()
    module.pipeline = Recording()
    for precision in ("bf16-mixed", "bf16-true", "32-true", "16-mixed"):
        module.trainer = type("Trainer", (), {"precision": precision, "training": False})()
        module.on_after_batch_transfer(None, 0)
    assert seen == [True, True, False, False]
