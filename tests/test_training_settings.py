"""The training-batch settings (progressive resizing, auto-augment, mixup/cutmix, random erasing, ddp learning-rate
scaling) reach the batches the model trains on, the same on the PIL path and on the cached path."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torchvision.transforms import v2

from flowers.cli import cli_main, main
from flowers.data import FlowerDataModule
from flowers.data.batch_augment import crop_flip_normalise, draw_train_views
from flowers.data.transforms import train_transform
from tests.helpers.runs import TINY_RUN

PATHS = pytest.mark.parametrize("cache", [False, True], ids=["pil", "cached"])


class TrainBatches(L.Callback):
    """Records, per epoch, the side and the labels of each training batch as the model gets it."""

    def __init__(self) -> None:
        self.sides: dict[int, set[int]] = {}
        self.labels: list[torch.Tensor] = []
        self.val_labels: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        images, labels = batch
        self.sides.setdefault(trainer.current_epoch, set()).add(images.shape[-1])
        self.labels.append(labels)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.val_labels.append(batch[1])


def fit(data, *args: str) -> tuple[object, TrainBatches]:
    cli = cli_main(["fit", *TINY_RUN, f"--data.data_dir={data}", "--trainer.limit_train_batches=2",
                    "--trainer.limit_val_batches=1", f"--trainer.callbacks+={__name__}.TrainBatches", *args])
    return cli, next(c for c in cli.trainer.callbacks if isinstance(c, TrainBatches))


@PATHS
def test_progressive_resizing_trains_each_epoch_at_its_scheduled_side(in_tmp, tiny_synthetic, cache):
    _, seen = fit(tiny_synthetic, "--trainer.max_epochs=4", "--data.start_image_size=64", "--data.image_size=96",
                  "--data.eval_image_size=96", "--data.resize_ramp=[0.25, 0.75]", f"--data.cache={cache}")
    # 4 epochs, ramp from epoch 1 to epoch 3: 64, 64, 80, 96.
    assert seen.sides == {0: {64}, 1: {64}, 2: {80}, 3: {96}}


@pytest.mark.slow
def test_a_resumed_run_trains_at_the_side_its_epoch_is_scheduled_for(in_tmp, tiny_synthetic):
    schedule = ["--data.start_image_size=64", "--data.image_size=96", "--data.resize_ramp=[0.25, 0.75]",
                "--data.cache=true"]
    fit(tiny_synthetic, "--trainer.max_epochs=2", *schedule)
    _, resumed = fit(tiny_synthetic, "--trainer.max_epochs=4", "--ckpt_path=last", *schedule)
    assert resumed.sides == {2: {80}, 3: {96}}


@PATHS
def test_mixing_makes_soft_training_labels_and_leaves_validation_alone(in_tmp, tiny_synthetic, cache):
    cli, seen = fit(tiny_synthetic, "--data.mixup_alpha=0.4", "--data.cutmix_alpha=1.0",
                    "--data.random_erasing=0.5", "--data.auto_augment=trivial", f"--data.cache={cache}")
    for labels in seen.labels:
        assert labels.is_floating_point() and labels.shape == (4, 5)
        assert torch.allclose(labels.sum(dim=1), torch.ones(4))
    assert any((labels.max(dim=1).values < 1).any() for labels in seen.labels)  # some image holds two classes
    assert all(not labels.is_floating_point() for labels in seen.val_labels)


def test_auto_augment_runs_on_each_pil_image_after_the_crop():
    steps = [type(t).__name__ for t in train_transform(crop_size=64, auto_augment="trivial").transforms]
    assert steps == ["RandomResizedCrop", "RandomHorizontalFlip", "TrivialAugmentWide", "ToTensor", "Normalize"]
    steps = [type(t).__name__ for t in train_transform(crop_size=64, auto_augment="rand").transforms]
    assert "RandAugment" in steps


@pytest.mark.parametrize("batched", [False, True], ids=["per-image", "roi_align"])
def test_auto_augment_runs_on_each_cached_view_after_the_crop(batched):
    torch.manual_seed(0)
    squares = torch.randint(0, 256, (4, 3, 40, 40), dtype=torch.uint8)
    boxes, flip = draw_train_views(torch.full((4, 2), 40), side=40)
    plain = crop_flip_normalise(squares, boxes, flip, crop_size=32, batched=batched)
    seen = []

    def invert(view: torch.Tensor) -> torch.Tensor:  # detectable, and records what it was given
        seen.append(view)
        return 255 - view

    inverted = crop_flip_normalise(squares, boxes, flip, crop_size=32, batched=batched, augment=invert)
    assert len(seen) == 4 and all(v.dtype == torch.uint8 and v.shape == (3, 32, 32) for v in seen)
    # Normalised with mean = std = 0.5, the inverse of pixel p is -x: the augmentation saw each view.
    assert torch.allclose(inverted, -plain, atol=2 / 255 * 2 + 1e-6)


def test_the_datamodule_builds_torchvisions_auto_augment():
    assert isinstance(FlowerDataModule(auto_augment="trivial", cache=True).pipeline.augment, v2.TrivialAugmentWide)
    assert isinstance(FlowerDataModule(auto_augment="rand", cache=True).pipeline.augment, v2.RandAugment)
    assert FlowerDataModule(cache=True).pipeline.augment is None
    pil = FlowerDataModule(auto_augment="trivial").pipeline.train_transform.transforms
    assert any(isinstance(t, v2.TrivialAugmentWide) for t in pil)


@pytest.mark.parametrize("setting", ["--data.resize_ramp=[0.8, 0.2]", "--data.mixup_alpha=-1",
                                     "--data.random_erasing=1.5", "--data.start_image_size=32"])
def test_bad_settings_stop_with_one_paragraph(in_tmp, tiny_synthetic, setting, capsys):
    assert main(["fit", *TINY_RUN, f"--data.data_dir={tiny_synthetic}", setting]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and setting.split("=")[0].removeprefix("--") in err


def test_lr_scaling_is_off_on_one_process(in_tmp, tiny_synthetic):
    cli, _ = fit(tiny_synthetic, "--model.lr_scaling=linear")
    assert cli.model.lr_scale() == 1.0
    assert cli.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(2e-4)


@PATHS
def test_drop_last_gives_every_training_step_the_same_batch_size(tiny_synthetic, cache):
    def batch_sizes(drop_last: bool) -> list[int]:
        module = FlowerDataModule(str(tiny_synthetic), image_size=64, batch_size=batch, num_workers=0, cache=cache,
                                  drop_last=drop_last)
        module.setup("fit")
        return [len(labels) for _, labels, *_ in module.train_dataloader()]

    module = FlowerDataModule(str(tiny_synthetic))
    module.setup("fit")
    batch = next(k for k in range(3, 10) if len(module.train_set) % k)  # a size that leaves a smaller last batch
    assert batch_sizes(drop_last=False)[-1] < batch
    assert batch_sizes(drop_last=True) == [batch] * (len(module.train_set) // batch)


def test_drop_last_with_a_batch_larger_than_the_training_set_stops_before_training(in_tmp, tiny_synthetic, capsys):
    assert main(["fit", *TINY_RUN, f"--data.data_dir={tiny_synthetic}", "--data.drop_last=true",
                 "--data.batch_size=100000"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "data.drop_last=true" in err and "leaves no training batch" in err


def test_batches_of_cache_indices_are_pinned_for_the_gpu(tiny_synthetic, monkeypatch):
    # Indices, labels, boxes and flips cross to the GPU every step: from page-locked memory, asynchronously.
    monkeypatch.setattr(FlowerDataModule, "_on_cuda", lambda self: True)
    module = FlowerDataModule(str(tiny_synthetic), image_size=64, cache=True)
    module.pipeline.device_pixels = torch.zeros(1, dtype=torch.uint8)  # as after the upload to the GPU
    assert module.num_workers == 0
    module.train_set = module.val_set = torch.utils.data.TensorDataset(torch.arange(4))
    assert module.train_dataloader().pin_memory and module.val_dataloader().pin_memory
    assert not FlowerDataModule(str(tiny_synthetic), pin_memory=False)._loader(module.train_set, batch_size=2,
                                                                                shuffle=False).pin_memory
