"""mixup, cutmix and random erasing do to a batch what their papers say, and progressive resizing follows
its schedule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowers.data.batch_ops import cutmix, mix_batch, mixup, one_hot, random_erase
from flowers.data.resizing import size_at_epoch


def batch(n: int = 8, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    # Each image a constant equal to its index: a mixed pixel tells which images went into it.
    images = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 3, size, size).clone()
    return images, torch.arange(n) % 5


def test_mixup_blends_images_and_labels_by_the_same_ratio():
    torch.manual_seed(0)
    images, labels = batch()
    mixed, targets, lam = mixup(images, one_hot(labels, 5), alpha=0.4)
    assert torch.allclose(targets.sum(dim=1), torch.ones(len(images)))
    # A constant image i mixed with image j is lam * i + (1 - lam) * j everywhere; recover j and check the labels.
    partner = ((mixed[:, 0, 0, 0] - lam * images[:, 0, 0, 0]) / (1 - lam)).round().long()
    expected = lam * one_hot(labels, 5) + (1 - lam) * one_hot(labels[partner], 5)
    assert torch.allclose(targets, expected, atol=1e-6)
    assert sorted(partner.tolist()) == list(range(len(images)))  # a permutation of the batch


def test_mixup_ratio_follows_its_beta_distribution():
    torch.manual_seed(0)
    images, labels = batch(n=4, size=4)
    ratios = np.array([mixup(images, one_hot(labels, 5), alpha=0.4)[2] for _ in range(2000)])
    reference = np.random.default_rng(0).beta(0.4, 0.4, 20000)
    assert ks_distance(ratios, reference) < 0.05  # two-sample KS: 0.05 is beyond p = 0.001 for these sizes
    # ...and not some other one: Beta(1, 1) is the uniform distribution.
    assert ks_distance(ratios, np.random.default_rng(0).beta(1.0, 1.0, 20000)) > 0.1


def ks_distance(a: np.ndarray, b: np.ndarray) -> float:
    """The largest gap between the two samples' empirical distribution functions."""
    points = np.concatenate([a, b])
    cdf = lambda sample: np.searchsorted(np.sort(sample), points, side="right") / len(sample)  # noqa: E731
    return float(np.abs(cdf(a) - cdf(b)).max())


def test_cutmix_pastes_one_box_and_mixes_labels_by_its_area():
    torch.manual_seed(1)
    images, labels = batch(size=32)
    for _ in range(20):
        mixed, targets, lam = cutmix(images, one_hot(labels, 5), alpha=1.0)
        changed = (mixed != images).any(dim=1)  # N × H × W
        boxes = set()
        for i in range(len(images)):
            rows, cols = changed[i].any(dim=1).nonzero(), changed[i].any(dim=0).nonzero()
            if len(rows):  # an image whose partner is not itself: one filled axis-aligned box
                box = (int(rows.min()), int(rows.max()), int(cols.min()), int(cols.max()))
                assert changed[i, box[0]:box[1] + 1, box[2]:box[3] + 1].all()
                boxes.add(box)
        assert len(boxes) <= 1  # the same box in every image
        # Each image keeps at least lam of its own class (more when its partner has the same class).
        assert torch.allclose(targets.sum(dim=1), torch.ones(len(images)))
        assert (targets[torch.arange(len(images)), labels] >= lam - 1e-6).all()


def test_cutmix_area_is_what_the_labels_say():
    torch.manual_seed(2)
    n, size = 6, 40
    images = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 3, size, size).clone()
    eye = torch.eye(n)  # one class per image: the label mix is readable per partner
    for _ in range(20):
        mixed, targets, lam = cutmix(images, eye, alpha=1.0)
        pasted_share = (mixed[:, 0] != images[:, 0]).float().mean(dim=(1, 2))
        kept = targets[torch.arange(n), torch.arange(n)]
        partners_differ = pasted_share > 0
        assert torch.allclose(kept[partners_differ], 1 - pasted_share[partners_differ], atol=1e-6)
        assert abs(float(1 - lam) - float(pasted_share.max())) < 1e-6 or not partners_differ.any()


def test_mix_batch_is_off_at_zero_and_soft_when_on():
    images, labels = batch()
    same_images, same_labels = mix_batch(images, labels, num_classes=5)
    assert same_images is images and same_labels is labels
    torch.manual_seed(0)
    _, soft = mix_batch(images, labels, num_classes=5, mixup_alpha=0.2, cutmix_alpha=1.0)
    assert soft.shape == (len(images), 5) and torch.allclose(soft.sum(dim=1), torch.ones(len(images)))


def test_mix_batch_takes_both_mixes_when_both_are_on():
    torch.manual_seed(0)
    images, labels = batch(size=16)
    kinds = set()
    for _ in range(30):
        mixed, _ = mix_batch(images, labels, num_classes=5, mixup_alpha=0.4, cutmix_alpha=1.0)
        fractional = (mixed != mixed.round()).any()  # mixup blends whole images; cutmix copies pixels
        kinds.add("mixup" if fractional else "cutmix")
    assert kinds == {"mixup", "cutmix"}


def test_random_erasing_blanks_one_rectangle_in_about_prob_of_the_images():
    torch.manual_seed(0)
    n, size = 2000, 24
    images = torch.ones(n, 3, size, size)
    erased = random_erase(images, prob=0.25)
    blank = erased[:, 0] == 0
    hit = blank.any(dim=(1, 2))
    assert 0.21 < hit.float().mean() < 0.29
    for i in hit.nonzero()[:50, 0]:
        rows, cols = blank[i].any(dim=1).nonzero(), blank[i].any(dim=0).nonzero()
        assert blank[i, rows.min():rows.max() + 1, cols.min():cols.max() + 1].all()  # one filled rectangle
        assert (erased[i, :, blank[i]] == 0).all()  # all channels
    areas = blank[hit].float().mean(dim=(1, 2))
    # Area ~ U(0.02, 1/3) of the image, give or take the rounding of sides on a 24-pixel image and the clipping
    # of a long box.
    assert 0.01 <= areas.min() and areas.max() <= 1 / 3 + 0.05
    assert 0.14 < areas.mean() < 0.2
    assert random_erase(images, prob=0.0) is images


def test_random_erasing_keeps_the_memory_format():
    images = torch.ones(4, 3, 16, 16).contiguous(memory_format=torch.channels_last)
    assert random_erase(images, prob=1.0).is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize(("epoch", "size"), [(0, 96), (4, 96), (5, 96), (8, 112), (10, 128), (14, 144), (15, 160),
                                             (19, 160)])
def test_progressive_resizing_follows_its_ramp(epoch, size):
    # 20 epochs, ramp over epochs 5..15 from 96 to 160, in steps of 16.
    assert size_at_epoch(epoch, 20, start_size=96, final_size=160, ramp=(0.25, 0.75)) == size


def test_progressive_resizing_off_without_a_smaller_start_or_an_epoch_count():
    assert size_at_epoch(0, 20, start_size=160, final_size=160) == 160
    assert size_at_epoch(0, -1, start_size=96, final_size=160) == 160
    sizes = [size_at_epoch(e, 20, start_size=96, final_size=160) for e in range(20)]
    assert sizes == sorted(sizes) and sizes[0] == 96 and sizes[-1] == 160
