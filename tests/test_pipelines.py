"""The training pipelines behind FlowerDataModule: the PIL one and the cached one give the model the same batches,
and another pipeline plugs in through the same small interface."""

from __future__ import annotations

import dataclasses
import inspect

import lightning as L
import pytest
import torch
from torch.utils.data import Dataset, default_collate

from flowers.data import FlowerDataModule
from flowers.data.datasets import CachedImages, LabelledImages
from flowers.data.folders import Sample
from flowers.data.pipelines import BatchContext, TrainImages, TrainingPipeline, settings_from
from flowers.data.pipelines.cached import CachedPipeline, CachedSettings
from flowers.data.pipelines.pil import PilPipeline, PilSettings
from flowers.module import FlowerClassifier


class FakeTrainer:
    """What on_after_batch_transfer reads of a trainer, and the model it trains."""

    def __init__(self, *, training: bool, current_epoch: int = 0, max_epochs: int = 4,
                 channels_last: bool = False) -> None:
        self.training, self.current_epoch, self.max_epochs, self.precision = training, current_epoch, max_epochs, "32"
        self.lightning_module = FlowerClassifier(channels_last=channels_last)


def _batches(module: FlowerDataModule, *, training: bool, channels_last: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    module.trainer = None  # the loaders of a single process
    module.setup("fit")
    loader = module.train_dataloader() if training else module.val_dataloader()
    batch = next(iter(loader))
    module.trainer = FakeTrainer(training=training, channels_last=channels_last)
    return module.on_after_batch_transfer(batch, 0)


def _pair(tiny_synthetic, **settings) -> tuple[FlowerDataModule, FlowerDataModule]:
    # The whole photo as the crop (the 72-px photos are square), so both pipelines show the model the same view.
    common = {"image_size": 64, "batch_size": 6, "num_workers": 0, "crop_scale": (1.0, 1.0), **settings}
    return FlowerDataModule(str(tiny_synthetic), **common), FlowerDataModule(str(tiny_synthetic), cache=True, **common)


@pytest.mark.parametrize("start_image_size", [None, 48])
def test_both_pipelines_give_the_model_the_same_training_batch(tiny_synthetic, start_image_size):
    pil, cached = _pair(tiny_synthetic, start_image_size=start_image_size)
    assert isinstance(pil.pipeline, PilPipeline) and isinstance(cached.pipeline, CachedPipeline)
    (pil_images, pil_labels), (cached_images, cached_labels) = (_batches(m, training=True) for m in (pil, cached))
    side = start_image_size or 64  # the first epoch of progressive resizing trains smaller
    for images in (pil_images, cached_images):
        assert images.shape == (6, 3, side, side) and images.dtype == torch.float32
        assert images.is_contiguous() and images.abs().max() <= 1 + 1e-6  # pixels in [-1, 1]: mean = std = 0.5
    assert pil_labels.dtype == cached_labels.dtype == torch.int64
    assert torch.equal(pil_labels, cached_labels)  # the sampler's order does not depend on the pipeline
    assert isinstance(cached.train_set, CachedImages) and isinstance(pil.train_set, LabelledImages)
    assert cached.train_set.labels == pil.train_set.labels
    # The same photo, up to resampling (PIL's path resizes twice while progressive resizing shrinks it), and
    # each pipeline draws its own flips; a mirrored view is several times further off.
    unflipped = (pil_images - cached_images).abs().mean(dim=(1, 2, 3))
    flipped = (pil_images - cached_images.flip(-1)).abs().mean(dim=(1, 2, 3))
    assert (torch.minimum(unflipped, flipped) < 0.03).all(), (unflipped, flipped)


def test_both_pipelines_give_the_model_the_same_validation_batch(tiny_synthetic):
    pil, cached = _pair(tiny_synthetic, eval_image_size=80)
    (pil_images, pil_labels), (cached_images, cached_labels) = (_batches(m, training=False) for m in (pil, cached))
    assert pil_images.shape == cached_images.shape == (5, 3, 80, 80)  # a photo of each class
    assert pil_images.dtype == cached_images.dtype == torch.float32 and cached_images.is_contiguous()
    assert torch.equal(pil_labels, cached_labels)
    assert (pil_images - cached_images).abs().mean() < 1e-3


def test_the_cached_pipeline_builds_its_batches_in_the_models_layout(tiny_synthetic):
    module = FlowerDataModule(str(tiny_synthetic), image_size=64, batch_size=4, num_workers=0, cache=True)
    for training in (True, False):
        images, _ = _batches(module, training=training, channels_last=True)
        assert images.is_contiguous(memory_format=torch.channels_last)
        images, _ = _batches(module, training=training)
        assert images.is_contiguous() and not images.is_contiguous(memory_format=torch.channels_last)


def test_the_shared_batch_augmentations_follow_either_pipeline(tiny_synthetic):
    for cache in (False, True):
        module = FlowerDataModule(str(tiny_synthetic), image_size=64, batch_size=4, num_workers=0, cache=cache,
                                  mixup_alpha=0.4)
        _, labels = _batches(module, training=True)
        assert labels.shape == (4, 5) and torch.allclose(labels.sum(dim=1), torch.ones(4))  # mixed, soft


def test_each_pipeline_reads_its_settings_once_from_the_datamodules_arguments():
    module = FlowerDataModule(image_size=96, eval_image_size=128, crop_scale=(0.3, 1.0), auto_augment="trivial",
                              cache=True, cache_on_device=False)
    settings = module.pipeline.settings
    assert settings == settings_from(CachedSettings, module)
    assert (settings.image_size, settings.eval_image_size, settings.crop_scale) == (96, 128, (0.3, 1.0))
    assert settings.cache_on_device is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.image_size = 64
    assert FlowerDataModule(image_size=96).pipeline.settings == PilSettings(
        image_size=96, eval_image_size=96, crop_scale=(0.08, 1.0), auto_augment=None, mean=[0.5] * 3, std=[0.5] * 3)
    assert (module.shared_augment.mixup_alpha, module.shared_augment.random_erasing) == (0.0, 0.0)


def test_the_settings_roles_name_real_arguments():
    arguments = inspect.signature(FlowerDataModule).parameters
    module = FlowerDataModule()
    for name in FlowerDataModule.SPLIT_SETTINGS + FlowerDataModule.LOGGED_SETTINGS:
        assert name in arguments and hasattr(module, name), name
    assert set(FlowerDataModule.LOGGED_SETTINGS) <= set(FlowerDataModule.SPLIT_SETTINGS)


def test_labelled_datasets_give_their_labels_without_decoding(tmp_path):
    samples = [Sample(str(tmp_path / f"missing{i}.jpg"), i % 3) for i in range(7)]  # no file is ever read
    assert LabelledImages(samples, transform=None).labels == [0, 1, 2, 0, 1, 2, 0]


class SolidColours(Dataset):
    """Each image one flat colour, from its class: stands in for a pipeline that reads no photo files."""

    def __init__(self, samples, side: int) -> None:
        self.labels = [sample.label for sample in samples]
        self.side = side

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key):
        index = key[0] if isinstance(key, tuple) else key  # (index, seed) from the training sampler
        label = self.labels[index]
        return torch.full((3, self.side, self.side), 40 * label, dtype=torch.uint8), label


class SolidColourPipeline(TrainingPipeline):
    """A third pipeline, written outside flowers.data: its own datasets, collate and device step."""

    def __init__(self) -> None:
        self.collated = 0
        self.seen: list[BatchContext] = []

    def datasets(self, train, val, *, root, trainer):
        return SolidColours(train, 96), SolidColours(val, 96)

    def train_collate(self):
        def collate(items):
            self.collated += 1
            return default_collate(items)

        return collate

    def on_device(self, batch, context):
        self.seen.append(context)
        images, labels = batch
        images = images.float() / 127.5 - 1
        if context.training:
            return TrainImages(torch.nn.functional.interpolate(images, size=context.train_size), labels)
        return images, labels


def test_a_third_pipeline_plugs_in_through_the_interface(tiny_synthetic, tmp_path):
    module = FlowerDataModule(str(tiny_synthetic), image_size=96, start_image_size=64, batch_size=4, num_workers=0,
                              random_erasing=1.0)
    module.pipeline = pipeline = SolidColourPipeline()
    sides = []

    class Sides(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            images, _ = batch
            sides.append(images.shape[-1])
            # random_erasing=1.0, shared by every pipeline: each image has a rectangle set to 0.
            assert ((images == 0).flatten(1).any(dim=1)).all()

    trainer = L.Trainer(accelerator="cpu", max_epochs=4, limit_train_batches=2, limit_val_batches=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[Sides()], default_root_dir=tmp_path)
    trainer.fit(FlowerClassifier(module.num_classes), datamodule=module)
    assert trainer.global_step == 8 and pipeline.collated == 8
    assert sides == [64, 64, 64, 64, 80, 80, 96, 96]  # the DataModule's progressive-resizing schedule
    assert {c.training for c in pipeline.seen} == {True, False}  # training and validation batches
    assert set(module.class_counts()) == {"train", "val"}  # from the datasets' labels
