"""``FlowerDataModule``: class folders in, train/val/test/predict loaders out."""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from flowers import lightning_internals
from flowers.data import synthetic
from flowers.data.batch_ops import BatchAugment
from flowers.data.cache import CACHE_FOLDER
from flowers.data.datasets import LabelledImages, UnlabelledImages
from flowers.data.download import (
    DEFAULT_DIR,
    FLOWER_PHOTOS_SHA256,
    FLOWER_PHOTOS_URL,
    check_source,
    fetch_flower_photos,
)
from flowers.data.folders import (
    Sample,
    drop_unreadable,
    find_classes,
    is_split_layout,
    list_image_files,
    list_images,
    stratified_split,
)
from flowers.data.pipelines import BatchContext, TrainImages, TrainingPipeline, settings_from
from flowers.data.pipelines.cached import CachedPipeline, CachedSettings
from flowers.data.pipelines.pil import PilPipeline, PilSettings
from flowers.data.resizing import schedule_sizes, size_at_epoch
from flowers.data.sampling import EpochSampler, ResumableLoader
from flowers.data.transforms import TUTORIAL_MEAN, TUTORIAL_STD, AutoAugment, eval_transform
from flowers.errors import ConfigError, DataError
from flowers.files import special_kind
from flowers.stretch import checked, position, stretched


class FlowerDataModule(L.LightningDataModule):
    """Flower photos from an ImageFolder tree, or the embedded synthetic set when ``data_dir`` is unset.

    The training and validation images reach the model through one training pipeline (flowers.data.pipelines):
    decoded and augmented one at a time in PIL, or with ``cache``, read from a decoded cache and augmented a
    whole batch at a time on the training device.

    Args:
        data_dir: ``root/<class>/…`` (split by ``val_split``) or ``root/train/<class>/…`` plus
            ``root/val/<class>/…`` (the tutorial's layout); an optional ``root/test/<class>/…`` is the
            test set. Unset: the synthetic set, drawn into ``synthetic_dir`` on first use.
        class_names: the classes a checkpoint was trained on; the folders must have exactly these.
            The CLI fills it from ``--ckpt_path``, so ``predict`` needs no training data.
        val_split: fraction of each class held out for validation in the single-folder layout.
        split_seed: seed of that split; the split never depends on the global seed or the rank.
        image_size: side of the square the network sees in training (the tutorial's 224).
        eval_image_size: side of the validation/test/predict square; defaults to ``image_size``. The
            random crops of training make objects look larger than in the full-image eval squash, so
            evaluating about 4/3 larger matches them (Touvron et al., "Fixing the train-test resolution
            discrepancy", 2019); the network's adaptive pooling takes any size.
        crop_scale: area range of the training RandomResizedCrop (the tutorial's, torchvision's default).
        start_image_size: progressive resizing: training starts at this side and grows to ``image_size``
            over ``resize_ramp`` (flowers.data.resizing); unset, every epoch trains at ``image_size``.
        resize_ramp: the fractions of ``max_epochs`` between which the training side grows.
        auto_augment: ``"trivial"`` (TrivialAugmentWide) or ``"rand"`` (RandAugment): one or two random
            photometric or geometric changes per training image, after its crop and flip (torchvision's).
        mixup_alpha, cutmix_alpha: blend pairs of training images (mixup) or paste a box of one into the
            other (cutmix), with the labels mixed alike; ``λ ~ Beta(α, α)``, 0 = off, half the batches
            each when both are on (flowers.data.batch_ops).
        random_erasing: the probability that a training image has a random rectangle blanked to its mean.
        class_balanced: draw each epoch's training images with replacement, each class equally often on
            average, instead of each image once.
        batch_size: per process: under ddp the global batch is ``batch_size × world size``.
        eval_batch_size: batch for val/test/predict; defaults to ``batch_size``.
        num_workers: loader processes per training process; default the tutorial's
            ``min(cpu_count, batch_size, 8)``, divided among the processes of this machine; 0 with
            ``cache`` when not training on CUDA (the training process copies cached items itself).
        predict_dir: a folder (searched recursively, hidden folders skipped) or one image file for ``predict``.
        predict_files: image files for ``predict``, e.g. ``--data.predict_files '[a.jpg, b.png]'``, after
            those of ``predict_dir``; a missing or unreadable one gets an ``error`` in its row.
        verify_images: decode every image once at setup and skip unreadable ones with one warning.
        download: fetch the TensorFlow flower_photos archive into ``data_dir`` (default
            ``data/flower_photos``) unless that folder already holds data; one process per machine downloads.
        download_url: where the archive comes from.
        download_sha256: its expected SHA-256, checked before extraction; null skips the check.
        cache: the fast data path: decode the train/val images once into a uint8 cache
            (flowers.data.cache) and crop, flip and normalise them in batches on the training device
            (flowers.data.batch_augment) instead of in PIL per image. Test and predict keep the PIL path.
        cache_dir: where the cache goes when the data folder is read-only.
        cache_on_device: with ``cache``, hold the whole cache in the training GPU's memory (a copy per
            process) and load each batch as indices into it: no loader workers, no host-to-device copy
            of pixels. Unset: on when training on CUDA and the cache takes under a quarter of the GPU's
            free memory (about 500 MB for 3,216 photos at 224 px).
        pin_memory: page-locked host batches for faster copies to the GPU; unset: on when training on CUDA.
        drop_last: leave out each epoch's last, smaller training batch, so every step has one shape: CUDA
            graphs (``model.compile_mode=reduce-overhead``) then replay one graph instead of recording another.
        mean, std: the per-channel normalisation. Unset: the one ``model.weights`` were trained with
            (ImageNet's for torchvision's weights), else the tutorial's 0.5; the run's config.yaml records it.
    """

    # The settings that rebuild a run's validation split and its evaluation from the run's config.yaml.
    SPLIT_SETTINGS = ("data_dir", "val_split", "split_seed", "image_size", "eval_image_size", "eval_batch_size",
                      "batch_size", "synthetic_dir", "synthetic_per_class", "synthetic_size")
    # The settings TensorBoard's HPARAMS tab shows beside the model's: those that change a run's results.
    LOGGED_SETTINGS = ("data_dir", "image_size", "eval_image_size", "batch_size", "val_split", "split_seed")

    def __init__(
        self,
        data_dir: str | None = None,
        *,
        class_names: list[str] | None = None,
        val_split: float = 0.1,
        split_seed: int = 42,
        image_size: int = 224,
        eval_image_size: int | None = None,
        crop_scale: tuple[float, float] = (0.08, 1.0),
        start_image_size: int | None = None,
        resize_ramp: tuple[float, float] = (0.25, 0.75),
        auto_augment: AutoAugment | None = None,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        random_erasing: float = 0.0,
        class_balanced: bool = False,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int | None = None,
        predict_dir: str | None = None,
        predict_files: list[str] | None = None,
        verify_images: bool = True,
        synthetic_dir: str = "data/synthetic",
        synthetic_per_class: int = 300,
        synthetic_size: int = 96,
        download: bool = False,
        download_url: str = FLOWER_PHOTOS_URL,
        download_sha256: str | None = FLOWER_PHOTOS_SHA256,
        cache: bool = False,
        cache_dir: str = "data/cache",
        cache_on_device: bool | None = None,
        pin_memory: bool | None = None,
        drop_last: bool = False,
        mean: list[float] | None = None,
        std: list[float] | None = None,
    ) -> None:
        super().__init__()
        if not 0 < val_split < 1:
            raise ConfigError(f"data.val_split must be between 0 and 1 (exclusive), got {val_split}.")
        for name, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
            if value is not None and value < 1:
                raise ConfigError(f"data.{name} must be at least 1 (images per batch), got {value}.")
        if num_workers is not None and num_workers < 0:
            raise ConfigError(f"data.num_workers={num_workers} is not a number of loader processes: use 0 (load in "
                              "the training process) or more, or leave it unset for the default.")
        if not 0 < crop_scale[0] <= crop_scale[1] <= 1:
            raise ConfigError(f"data.crop_scale must be two fractions of the image's area, 0 < first <= second <= 1, "
                              f"got {list(crop_scale)}.")
        if synthetic_per_class < 1 or synthetic_size < synthetic.MIN_SIZE:
            raise ConfigError(f"data.synthetic_per_class must be at least 1 and data.synthetic_size at least "
                              f"{synthetic.MIN_SIZE} px, got {synthetic_per_class} and {synthetic_size}.")
        for name, values in (("mean", mean), ("std", std)):
            if values is not None and (len(values) != 3 or not all(math.isfinite(v) for v in values)
                                       or (name == "std" and min(values) <= 0)):
                raise ConfigError(f"data.{name} must be three finite numbers, one per colour channel"
                                  f"{' and each above 0' if name == 'std' else ''}, got {list(values)}.")
        if download:
            check_source(download_url, download_sha256, "--data.download_url", "--data.download_sha256")
            # Here, not in prepare_data: the class folders are read below, when the CLI instantiates us.
            data_dir = str(fetch_flower_photos(data_dir or DEFAULT_DIR, url=download_url, sha256=download_sha256))
        self.data_dir = Path(data_dir).expanduser() if data_dir else None
        self.val_split = val_split
        self.split_seed = split_seed
        self.image_size = image_size
        self.eval_image_size = eval_image_size or image_size
        # Unset: the CLI fills in the model weights' own normalisation, else the tutorial's 0.5.
        self.mean, self.std = list(mean or TUTORIAL_MEAN), list(std or TUTORIAL_STD)
        self.crop_scale = crop_scale
        if not 0 <= resize_ramp[0] <= resize_ramp[1] <= 1:
            raise ConfigError(f"data.resize_ramp must be two fractions of the run, first <= second, got {resize_ramp}.")
        if not (0 <= mixup_alpha < math.inf and 0 <= cutmix_alpha < math.inf and 0 <= random_erasing <= 1):  # not nan
            raise ConfigError("data.mixup_alpha and data.cutmix_alpha must be >= 0 (0 = off) and data.random_erasing "
                              f"a probability; got {mixup_alpha}, {cutmix_alpha} and {random_erasing}.")
        self.start_image_size = start_image_size
        self.resize_ramp = tuple(resize_ramp)
        self.resize_knots: list[list[float]] = []  # flowers.stretch: set by a time budget's re-plan
        self.auto_augment = auto_augment
        self.mixup_alpha, self.cutmix_alpha, self.random_erasing = mixup_alpha, cutmix_alpha, random_erasing
        self.class_balanced = class_balanced
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self._num_workers = num_workers
        self.predict_dir = Path(predict_dir).expanduser() if predict_dir else None
        self.predict_files = [str(Path(f).expanduser()) for f in predict_files or []]
        self.verify_images = verify_images
        self.synthetic_dir = Path(synthetic_dir)
        self.synthetic_per_class = synthetic_per_class
        self.synthetic_size = synthetic_size
        self.cache = cache
        self.cache_dir = Path(cache_dir)
        self.cache_on_device = cache_on_device
        self.pin_memory = pin_memory
        self.drop_last = drop_last
        self.class_names = self._check_class_names(class_names)
        self.train_set = self.val_set = self.test_set = self.predict_set = None
        # How the training and validation images become batches: its datasets, training collate and device step.
        self.pipeline: TrainingPipeline = (CachedPipeline(settings_from(CachedSettings, self)) if cache
                                           else PilPipeline(settings_from(PilSettings, self)))
        self.shared_augment = settings_from(BatchAugment, self)  # every pipeline's training batches, after its step

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def class_counts(self) -> dict[str, dict[str, int]]:
        """Images of each class in each split set up so far: ``{"train": {"daisy": 10, …}, "val": {…}}``."""
        counts = {}
        for split, dataset in (("train", self.train_set), ("val", self.val_set), ("test", self.test_set)):
            if dataset is not None:
                counts[split] = {name: 0 for name in self.class_names}
                for label in dataset.labels:
                    counts[split][self.class_names[label]] += 1
        return counts

    def _check_class_names(self, expected: list[str] | None) -> list[str]:
        if self.data_dir is None:
            return list(expected or synthetic.CLASS_NAMES)
        root = self.data_dir
        if expected is not None and not root.exists():
            # predict with a checkpoint reads no training folder: a recipe's data_dir may be absent here.
            # validate/test/fit still stop in setup, where the folder is listed.
            return list(expected)
        if is_split_layout(root):
            found = find_classes(root / "train")
            for split in ("val", "test"):
                if (root / split).is_dir() and (other := find_classes(root / split)) != found:
                    raise DataError(
                        f"{root / split} has classes {other} but {root / 'train'} has {found}. Both must hold "
                        "the same class folders, spelled the same."
                    )
        else:
            found = find_classes(root)
        if expected is not None and list(expected) != found:
            raise DataError(
                f"The checkpoint was trained on classes {list(expected)}, but {root} has {found}. Point "
                "--data.data_dir at data with the checkpoint's classes."
            )
        return found

    # -- setup -------------------------------------------------------------------------------
    def _root(self) -> Path:
        if self.data_dir is not None:
            return self.data_dir
        return synthetic.ensure_synthetic(
            self.synthetic_dir, per_class=self.synthetic_per_class, size=self.synthetic_size
        )

    def _labelled(self, folder: Path) -> list[Sample]:
        samples = list_images(folder, self.class_names)
        if not self.verify_images:
            return samples
        record = self._root() / CACHE_FOLDER / f"verified-{hashlib.sha1(str(folder).encode()).hexdigest()[:12]}.json"
        return drop_unreadable(samples, where=folder, record=record)

    def prepare_data(self) -> None:
        # Runs on one process per machine; the others find the synthetic set already drawn. predict reads only
        # the files it is given: drawing a training set for it would cost seconds for nothing.
        predicting = self.trainer is not None and self.trainer.state.fn == TrainerFn.PREDICTING
        if self.data_dir is None and not predicting:
            self._root()

    def setup(self, stage: str) -> None:
        if stage == "predict":
            self.predict_set = UnlabelledImages(self._predict_paths(), self._eval_transform())
            return
        root = self._root()
        if stage in ("fit", "validate") and self.val_set is None:
            if is_split_layout(root):
                train, val = self._labelled(root / "train"), self._labelled(root / "val")
            else:
                train, val = stratified_split(
                    self._labelled(root), val_fraction=self.val_split, seed=self.split_seed
                )
            self.train_set, self.val_set = self.pipeline.datasets(train, val, root=root, trainer=self.trainer)
        if stage == "test":
            self.test_set = LabelledImages(self._labelled(self._test_folder(root)), self._eval_transform())
        rank_zero_info("Images per class: " + "; ".join(  # each split's balance, before any time is spent on it
            f"{split}: " + ", ".join(f"{name} {n}" for name, n in per_class.items())
            for split, per_class in self.class_counts().items()))

    def check_inputs(self, stage: str) -> None:
        """Fail now, in one paragraph, when the folders or files ``stage`` reads hold no images: a mistyped path
        then stops the command before the trainer makes a run folder. Lists the files; decodes none."""
        if stage == "predict":
            self._predict_paths()
        elif self.data_dir is not None and stage in ("fit", "validate", "test"):
            root = self.data_dir
            if not root.is_dir():
                find_classes(root)  # says what is there instead of a folder
            folders = ([self._test_folder(root)] if stage == "test" else
                       [root / "train", root / "val"] if is_split_layout(root) else [root])
            for folder in folders:
                list_images(folder, self.class_names)

    @staticmethod
    def _test_folder(root: Path) -> Path:
        if not (root / "test").is_dir():
            raise DataError(
                f"No test set: {root / 'test'} does not exist. Put a test/<class>/ tree there, or run "
                "`validate` to score the validation split."
            )
        return root / "test"

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        trainer = self.trainer
        return self.on_device(batch, training=trainer is not None and trainer.training, side=self.train_image_size())

    def on_device(self, batch, *, training: bool, side: int):
        """A loaded batch on the training device, made what the model gets: the pipeline's own step, then the
        augmentations every pipeline shares; ``side``: the training images' side."""
        precision = str(getattr(self.trainer, "precision", "")) if self.trainer is not None else ""
        context = BatchContext(training=training, train_size=side, bf16=precision.startswith("bf16"),
                               channels_last=self.channels_last)
        batch = self.pipeline.on_device(batch, context)
        if isinstance(batch, TrainImages):
            return self.shared_augment(batch.images, batch.labels, num_classes=self.num_classes)
        return batch

    @property
    def channels_last(self) -> bool:
        """Whether the model this feeds keeps its inputs in NHWC memory order (``model.channels_last``): the cached
        pipeline then builds its batches in that order, which the model would otherwise copy every step."""
        model = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        return bool(getattr(model, "channels_last", False))

    def train_image_size(self, epoch: int | None = None, max_epochs: int | None = None) -> int:
        """The side of the training images of ``epoch`` of ``max_epochs`` (unset: the trainer's current epoch and
        its max_epochs): ``image_size``, or its progressive-resizing schedule."""
        if self.start_image_size is None:
            return self.image_size
        if epoch is None or max_epochs is None:
            if self.trainer is None:
                return self.image_size
            epoch, max_epochs = self.trainer.current_epoch, self.trainer.max_epochs or 0
            epoch, max_epochs = position(epoch, self.resize_knots), position(max_epochs, self.resize_knots)
        return size_at_epoch(epoch, max_epochs, start_size=self.start_image_size, final_size=self.image_size,
                             ramp=self.resize_ramp)

    def stretch_resizing(self, *, at_epoch: int, epochs: int, new_epochs: int) -> None:
        """From ``at_epoch`` on, end the resizing schedule at ``new_epochs`` instead of ``epochs``."""
        self.resize_knots = stretched(self.resize_knots, at=at_epoch, end=epochs, new_end=new_epochs)

    def state_dict(self) -> dict:
        return {"resize_knots": self.resize_knots} if self.resize_knots else {}

    def load_state_dict(self, state_dict: dict) -> None:
        try:
            self.resize_knots = checked(state_dict.get("resize_knots", []) if isinstance(state_dict, dict) else None)
        except ValueError as error:
            raise ConfigError(f"The checkpoint's resizing schedule is not one flowers wrote ({error}): resume from "
                              "another checkpoint, or start a new run.") from None

    def train_image_sizes(self) -> list[int]:
        """Every side ``train_image_size`` can give, whatever the number of epochs."""
        return schedule_sizes(self.start_image_size or self.image_size, self.image_size)

    def _eval_transform(self):
        return eval_transform(crop_size=self.eval_image_size, mean=self.mean, std=self.std)

    def _predict_paths(self) -> list[str]:
        target = self.predict_dir
        if target is None and not self.predict_files:
            raise ConfigError(
                "predict needs images: set --data.predict_dir to a folder or an image file, or --data.predict_files."
            )
        return (self._predict_dir_paths(target) if target is not None else []) + self.predict_files

    def _predict_dir_paths(self, target: Path) -> list[str]:
        if target.is_file():
            return [str(target)]
        if not target.is_dir():
            kind = special_kind(target)
            raise DataError(f"--data.predict_dir {str(target)!r} " + (f"is {kind}:" if kind else "does not exist:")
                            + " pass a folder of images or one image file.")
        paths = sorted(str(path) for path in list_image_files(target))  # predictions.csv's row order, by path text
        if not paths:
            raise DataError(f"--data.predict_dir {str(target)!r} holds no images.")
        return paths

    # -- loaders ------------------------------------------------------------------------------
    @property
    def num_workers(self) -> int:
        if self._num_workers is not None:
            return self._num_workers
        if (wanted := self.pipeline.loader_workers(on_cuda=self._on_cuda())) is not None:
            return wanted
        # The tutorial's rule, shared among this machine's training processes so ddp does not oversubscribe.
        local_processes = 1
        if self.trainer is not None:
            local_processes = max(1, self.trainer.world_size // max(1, self.trainer.num_nodes))
        return min((os.cpu_count() or 1) // local_processes, self.batch_size, 8)

    def _on_cuda(self) -> bool:
        return self.trainer is not None and isinstance(self.trainer.accelerator, CUDAAccelerator)

    def _loader(self, dataset, *, batch_size: int, shuffle: bool, sampler=None, collate_fn=None,
                drop_last: bool = False, loader_class: type[DataLoader] = DataLoader) -> DataLoader:
        workers = self.num_workers
        # Index batches of a cache on the device are pinned too: their step's small copies then run asynchronously.
        pin = self._on_cuda() if self.pin_memory is None else self.pin_memory
        return loader_class(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            num_workers=workers,
            persistent_workers=workers > 0,
            pin_memory=pin,
            collate_fn=collate_fn,
            drop_last=drop_last,
            # Never the global generator: a loader's iterator draws its workers' base seed from it, and with
            # persistent workers that happens at a different point of a resumed run than of an unbroken one.
            generator=torch.Generator(),
        )

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        world_size, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        if self.drop_last and len(self.train_set) < self.batch_size * world_size:
            raise ConfigError(
                f"data.drop_last=true with {len(self.train_set)} training images and a batch of {self.batch_size} "
                f"per process ({world_size} processes) leaves no training batch. Lower --data.batch_size or set "
                "--data.drop_last=false."
            )
        # Our own DistributedSampler, also on one process: a resumable order (flowers.data.sampling), which
        # Lightning keeps as it is under ddp.
        sampler = EpochSampler(self.train_set, batch_size=self.batch_size, num_replicas=world_size, rank=rank,
                               weights=self._balancing_weights() if self.class_balanced else None)
        loader = self._loader(self.train_set, batch_size=self.batch_size, shuffle=False, sampler=sampler,
                              collate_fn=self.pipeline.train_collate(), drop_last=self.drop_last,
                              loader_class=ResumableLoader)
        if trainer is not None:
            loader.progress = lambda: lightning_internals.epoch_progress(trainer)
        return loader

    def _balancing_weights(self) -> list[float]:
        """Each training image's weight: one over its class's count, so every class is drawn alike."""
        labels = self.train_set.labels
        counts = torch.bincount(torch.as_tensor(labels), minlength=self.num_classes).tolist()
        return [1 / counts[label] for label in labels]

    def _eval_sampler(self, dataset):
        # Lightning's default DistributedSampler pads the last shard with repeated images, which skews
        # distributed val/test metrics. Rank r gets images r, r + world, …: each image exactly once.
        # Lightning keeps a sampler that already is a DistributedSampler.
        trainer = self.trainer
        if trainer is None or trainer.world_size <= 1:
            return None
        if len(dataset) < trainer.world_size:
            raise DataError(
                f"{len(dataset)} evaluation images cannot be shared among {trainer.world_size} processes; "
                "evaluate with fewer devices."
            )
        return lightning_internals.each_once_sampler(dataset, num_replicas=trainer.world_size, rank=trainer.global_rank)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, batch_size=self.eval_batch_size, shuffle=False,
                            sampler=self._eval_sampler(self.val_set))

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, batch_size=self.eval_batch_size, shuffle=False,
                            sampler=self._eval_sampler(self.test_set))

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.predict_set, batch_size=self.eval_batch_size, shuffle=False)
