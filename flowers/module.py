"""``FlowerClassifier``: the AlexNet, its loss, metrics and optimizer, as a LightningModule."""

from __future__ import annotations

import copy
import inspect
import math
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from filelock import FileLock
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from flowers import backbones, checkpoint_reader, lightning_internals
from flowers.data.transforms import TUTORIAL_MEAN, TUTORIAL_STD
from flowers.errors import ConfigError
from flowers.schedules import WarmupCosineLR
from flowers.strategies import DataParallelStrategy

TUTORIAL_LR = 2e-4  # the tutorial's Adam learning rate for single-device training


class BatchMean(Metric):
    """The mean of one value per batch (a loss), weighted by batch size; summed over ddp ranks at compute.

    By hand rather than torchmetrics' MeanMetric: its update checks the value for NaN and reads the answer
    on the host, two blocking syncs a step on a GPU, and its ``nan_strategy="disable"`` drops the weights
    (torchmetrics issue 3434). A NaN loss makes a NaN mean, as it should.
    """

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, value: torch.Tensor, weight: int) -> None:
        self.total += value.detach().float() * weight
        self.count += weight

    def compute(self) -> torch.Tensor:
        return self.total / self.count


def normalisation_of(settings: dict) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The per-channel (mean, std) of a model's settings: its own, else the tutorial's (checkpoints from before
    normalisation was recorded trained the tutorial's network with it)."""
    mean, std = settings.get("mean"), settings.get("std")
    return (tuple(mean), tuple(std)) if mean and std else (TUTORIAL_MEAN, TUTORIAL_STD)


def _synced_state(metric: Metric) -> dict[str, torch.Tensor]:
    with metric.sync_context(should_unsync=True):
        return {name: value.detach().cpu().clone() for name, value in metric.metric_state.items()}


def logits_with_mirror(net, images: torch.Tensor) -> torch.Tensor:
    """The mean of the logits of each image and of its mirror image: the test-time flip of ``eval_hflip``."""
    # Both views in one forward of a doubled batch: half the kernel launches of two forwards, and no output of a
    # CUDA-graph replay (compile_mode "reduce-overhead") held while the next replay overwrites it.
    both = net(torch.cat([images, images.flip(-1)]))
    return (both[: len(images)] + both[len(images):]) / 2


class FlowerClassifier(L.LightningModule):
    """Args:
        num_classes, class_names: filled from the data by the CLI; stored in the checkpoint so
            ``FlowerClassifier.load_from_checkpoint(path)`` needs no arguments.
        backbone: the network: ``tutorial_alexnet`` (the tutorial's half-width AlexNet) or a torchvision
            classification model by name (``resnet18``, ``mobilenet_v3_large``, ``vit_b_16`` …), its classifier
            head sized for the data's classes.
        weights: what the network starts from when a fit starts: None (a random initialisation), a torchvision
            weights name of the backbone (``DEFAULT``, ``IMAGENET1K_V1``; downloaded into torchvision's cache
            where the network allows) or a state_dict file. A head of another class count starts fresh.
            Never read on resume, predict or export: the checkpoint holds the network.
        init_from: another run's checkpoint whose network this run starts from (not its optimizer or epoch);
            a head of another class count starts fresh. Wins over ``weights``.
        freeze_backbone_epochs: train only the classifier head for this many epochs, then everything.
        head_lr: the classifier head's learning rate; unset, the optimizer's own for every layer.
        mean, std: the per-channel normalisation of the inputs; filled from the data by the CLI (the weights'
            own, or the tutorial's 0.5) and stored so predict and export normalise alike.
        label_smoothing: of the cross-entropy loss (0 = the tutorial's plain loss).
        dropout: of the two dropout layers in tutorial_alexnet's classifier (the tutorial's 0.5).
        optimizer: a callable ``params -> Optimizer``, set in YAML with ``class_path``/``init_args``;
            unset means the tutorial's recipe, Adam with lr 2e-4.
        scheduler: a callable ``optimizer -> LRScheduler``; unset means a constant learning rate.
        scheduler_interval: step the scheduler every "epoch" or every "step".
        channels_last: keep weights and inputs in NHWC, the layout oneDNN and cuDNN convolve fastest
            (most of all under bf16); the state_dict is unchanged.
        compile: ``torch.compile`` the network (in place, so checkpoint keys stay ``net.…``); the first
            steps are slow while it compiles.
        compile_mode: torch.compile's ``mode``: "reduce-overhead" replays the network's forward and its
            backward as two CUDA graphs instead of about 100 kernel launches (on a large GPU the tutorial's
            batch of 32 is bound by launches, not arithmetic); "max-autotune" also tries kernels.
            Unset: torch's default. On CPU there are no CUDA graphs and the modes compile alike.
        fused_optimizer: run the optimizer's step as torch's fused kernel (Adam, AdamW, SGD and others
            that take ``fused=True``, on CPU and CUDA): the same update, in one pass over the parameters
            instead of several per tensor. An optimizer without a fused kernel is kept as it is.
        lr_scaling: under ddp, multiply the optimizer's learning rates by the number of processes
            (``"linear"``, the rule for a global batch that grows with them, Goyal et al. 2017) or its square
            root (``"sqrt"``); ``"none"`` keeps them as written. Recorded as ``lr_scale`` in the hyperparameters.
        eval_hflip: score each image and its mirror image, averaging the two logits, wherever the
            model evaluates (validate, test, predict, ``flowers.analysis``); the training crops are flipped
            half the time, so both views are in distribution. Saved with the model; an exported network
            is the plain one.
        eval_image_size: the side the run evaluates at (``data.eval_image_size``, else ``data.image_size``);
            filled from the data by the CLI and stored, so predict, validate, test, serve and export evaluate
            a checkpoint at its own size without being told.
    """

    # Each setting's role, declared once: the CLI, resume and evaluation read them here.
    FROM_DATA = ("num_classes", "class_names", "mean", "std", "eval_image_size")  # the CLI fills them from the data
    HOW_IT_RUNS = ("channels_last", "compile", "compile_mode", "fused_optimizer")  # on resume, the command's
    HOW_IT_EVALUATES = ("eval_hflip",)  # validate, test and predict: the checkpoint's unless the command sets it

    def __init__(
        self,
        num_classes: int = 5,
        class_names: list[str] | None = None,
        *,
        label_smoothing: float = 0.0,
        dropout: float = 0.5,
        optimizer: OptimizerCallable | None = None,
        scheduler: LRSchedulerCallable | None = None,
        scheduler_interval: str = "epoch",
        channels_last: bool = False,
        compile: bool = False,
        compile_mode: str | None = None,
        fused_optimizer: bool = False,
        lr_scaling: Literal["none", "linear", "sqrt"] = "none",
        eval_hflip: bool = False,
        backbone: str = backbones.TUTORIAL_ALEXNET,
        weights: str | None = None,
        init_from: str | None = None,
        freeze_backbone_epochs: int = 0,
        head_lr: float | None = None,
        mean: list[float] | None = None,
        std: list[float] | None = None,
        eval_image_size: int | None = None,
    ) -> None:
        super().__init__()
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"{len(class_names)} class names given for {num_classes} classes")
        mean, std = (list(map(float, v)) if v else None for v in (mean, std))  # plain lists in hparams.yaml
        self.save_hyperparameters()
        self.class_names = list(class_names) if class_names else [str(i) for i in range(num_classes)]
        if freeze_backbone_epochs < 0:
            raise ConfigError(f"model.freeze_backbone_epochs must be 0 or more, got {freeze_backbone_epochs}.")
        self.net = backbones.build(backbone, num_classes, dropout=dropout)
        self._restored = False  # set when a checkpoint restores the network: weights and init_from are then unread
        self.channels_last = channels_last
        if channels_last:
            self.net.to(memory_format=torch.channels_last)
        if compile:
            self.net.compile(mode=compile_mode)
        self.loss = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.scheduler_interval = scheduler_interval
        self.fused_optimizer = fused_optimizer
        self.lr_scaling = lr_scaling
        self.eval_hflip = eval_hflip
        # micro = fraction of images right (what the tutorial prints); macro = mean of per-class accuracy.
        # validate_args checks the targets' range with a host sync each step: it stalled the GPU's queue.
        def accuracy(average: str) -> MulticlassAccuracy:
            return MulticlassAccuracy(num_classes, average=average, validate_args=False)

        # Training's is micro only: torchmetrics counts per class with torch.bincount, which on a GPU
        # reads the batch's min and max on the host, two blocking syncs a step.
        self.train_metrics = MetricCollection({"acc": accuracy("micro")}, prefix="train/")
        evaluation = MetricCollection({"acc": accuracy("micro"), "acc_macro": accuracy("macro")})
        self.val_metrics = evaluation.clone(prefix="val/")
        self.test_metrics = evaluation.clone(prefix="test/")
        # Each stage's mean loss. Evaluation shards are uneven under ddp (each image once), and Lightning's
        # sync_dist mean then divides by an integer-averaged batch count under gloo: a metric sums
        # (total, count) over the ranks instead.
        self.train_loss, self.val_loss, self.test_loss = BatchMean(), BatchMean(), BatchMean()

    def __deepcopy__(self, memo: dict) -> FlowerClassifier:
        # Weight averaging (Lightning's WeightAveraging) deep-copies the module. The optimizer and scheduler
        # factories build new objects on each call, so the copy shares them; copied, the command line's
        # partials fail under ddp, where they reach objects holding thread locks.
        for factory in (self.optimizer_factory, self.scheduler_factory):
            if factory is not None:
                memo[id(factory)] = factory
        duplicate = self.__class__.__new__(self.__class__)
        memo[id(self)] = duplicate
        duplicate.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return duplicate

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, *args, **kwargs):
        # Lightning rebuilds the model through jsonargparse, which builds any class_path it meets: the file's
        # settings are checked as data first (flowers.checkpoint_reader), whatever weights_only says.
        checkpoint_reader.read(checkpoint_path, "checkpoint_path", model_class=cls)
        kwargs.setdefault("weights_only", True)
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    def normalisation(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The per-channel (mean, std) the network's inputs are normalised with."""
        return normalisation_of(self.hparams)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return self.net(images)

    def eval_logits(self, images: torch.Tensor) -> torch.Tensor:
        """The logits evaluation scores: with ``eval_hflip``, the mean over the image and its mirror."""
        # Test-time augmentation by hand: Lightning has none.
        return logits_with_mirror(self, images) if self.eval_hflip else self(images)

    def _shared_step(self, batch, stage: str) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = batch
        logits = self(images) if stage == "train" else self.eval_logits(images)
        loss = self.loss(logits, labels)  # labels: class indices, or soft rows from mixup/cutmix
        metrics, mean_loss = getattr(self, f"{stage}_metrics"), getattr(self, f"{stage}_loss")
        metrics.update(logits, labels.argmax(dim=1) if labels.is_floating_point() else labels)
        mean_loss.update(loss, labels.shape[0])
        if stage == "train":
            # One self.log a step, for the progress bar and TensorBoard's step curve: this rank's batch loss.
            # The epoch values are logged once, at the epoch's end: each self.log call costs the host time,
            # and on a GPU bound by kernel launches the host's time is the step's time.
            self.log("train/loss_step", loss, on_step=True, on_epoch=False, prog_bar=True)
        else:
            self.log(f"{stage}/loss", mean_loss, on_step=False, on_epoch=True, prog_bar=True)
            self.log_dict(metrics, on_step=False, on_epoch=True, prog_bar=stage == "val")
        return loss, logits

    def on_train_epoch_end(self) -> None:
        # Metric objects: Lightning computes them (synced over the ranks), logs the values and resets them.
        if self.train_loss.update_count:  # an epoch with no training batches has nothing to log
            self.log("train/loss_epoch", self.train_loss, prog_bar=True)
            self.log_dict(self.train_metrics)

    def setup(self, stage: str) -> None:
        strategy = self.trainer.strategy
        if self.hparams.compile and isinstance(strategy, DataParallelStrategy) and strategy.on_cuda():
            # dp's replicas run the network class's own forward, not the compiled one, and dynamo would trace
            # into data_parallel's threads: refused before any work rather than silently uncompiled.
            raise ConfigError(
                "model.compile=true cannot be combined with strategy=dp on GPUs: dp's replicas would run the "
                "uncompiled network. Use --trainer.strategy=ddp (one compiled network per GPU), or set "
                "--model.compile=false."
            )

    def on_fit_start(self) -> None:
        if not self._restored:
            self._load_initial_weights()
        # Record how the run is spread: under dp one process splits each batch across its GPUs; under
        # ddp every process loads its own batch, so a step sees batch_size x world_size images.
        trainer = self.trainer
        scale = {"world_size": trainer.world_size, "num_nodes": trainer.num_nodes,
                 "devices_per_node": trainer.num_devices, "strategy": type(trainer.strategy).__name__}
        batch_size = getattr(trainer.datamodule, "batch_size", None)
        if batch_size is not None:
            scale["global_batch_size"] = batch_size * trainer.world_size
        scale["lr_scale"] = self.lr_scale()
        for logger in trainer.loggers:
            logger.log_hyperparams(scale)

    def check_initial_weights(self) -> None:
        """What a new fit starts from (``init_from``, a ``weights`` file or name) is readable and fits the network:
        shapes only, so the CLI checks it before it makes the run folder; ``on_fit_start`` loads it."""
        hparams = self.hparams
        if hparams.get("init_from"):
            backbones.check_matching(self.net, self._init_from_network(), what=f"--model.init_from "
                                     f"{hparams.init_from}", backbone=hparams.backbone)
        elif hparams.get("weights"):
            if backbones.is_named_weights(hparams.weights):
                backbones.preprocessing(hparams.backbone, hparams.weights)  # a known name; downloaded at fit start
            else:
                backbones.check_matching(self.net, backbones.read_state_dict(hparams.weights),
                                         what=f"--model.weights {hparams.weights}", backbone=hparams.backbone)

    def _init_from_network(self) -> dict[str, torch.Tensor]:
        """The network weights of the ``init_from`` checkpoint, refused unless they are this run's backbone."""
        hparams = self.hparams
        checkpoint = checkpoint_reader.read(hparams.init_from, "--model.init_from", model_class=type(self))
        source = (checkpoint.get("hyper_parameters") or {}).get("backbone", backbones.TUTORIAL_ALEXNET)
        if source != hparams.backbone:
            raise ConfigError(f"--model.init_from {hparams.init_from} holds a {source} network, not the "
                              f"--model.backbone={hparams.backbone} of this run. Set the backbone to {source}.")
        return backbones.network_weights(checkpoint["state_dict"])

    def _load_initial_weights(self) -> None:
        # Here rather than in __init__: a resumed, predicting or exporting model never reads (or downloads) them.
        # Every ddp rank loads the same file, so the replicas stay equal.
        hparams = self.hparams
        if hparams.get("init_from"):
            backbones.load_matching(self.net, self._init_from_network(), what=f"--model.init_from "
                                    f"{hparams.init_from}", backbone=hparams.backbone)
        elif hparams.get("weights"):
            cache = Path(torch.hub.get_dir())
            cache.mkdir(parents=True, exist_ok=True)
            with FileLock(cache / "flowers-weights.lock"):  # the processes of a machine download once
                backbones.load_weights(self.net, hparams.backbone, hparams.weights)

    def on_train_epoch_start(self) -> None:
        frozen = self.current_epoch < self.hparams.get("freeze_backbone_epochs", 0)
        if frozen or self.current_epoch == self.hparams.get("freeze_backbone_epochs", 0):
            rank_zero_info(f"Epoch {self.current_epoch}: " + ("training the classifier head only" if frozen
                                                              else "training the whole network"))

    def on_before_optimizer_step(self, optimizer) -> None:
        # Freezing by dropping the body's gradients before the step, not by requires_grad: under ddp the reducer
        # keeps the parameters it was built with, and the optimizer then skips them whole (no momentum, no decay).
        if self.current_epoch < self.hparams.get("freeze_backbone_epochs", 0):
            for parameter in backbones.head_parameters(self.net)[0]:
                parameter.grad = None

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._shared_step(batch, "train")[0]

    def validation_step(self, batch, batch_idx: int) -> dict[str, torch.Tensor]:
        # The logits reach callbacks (ValidationImages) through on_validation_batch_end, with no second forward.
        loss, logits = self._shared_step(batch, "val")
        return {"loss": loss, "logits": logits.detach()}

    def test_step(self, batch, batch_idx: int) -> None:
        self._shared_step(batch, "test")

    def predict_step(self, batch, batch_idx: int) -> dict:
        # "error" is "" for a decoded image, else why it could not be read (its probs are then meaningless).
        images, indices, errors = batch
        return {"index": indices, "probs": self.eval_logits(images).float().softmax(dim=1), "error": list(errors)}

    def make_optimizer(self) -> torch.optim.Optimizer:
        """A new optimizer over this module's parameters, as the config says (``configure_optimizers`` adds the
        schedule)."""
        params = list(self.parameters())
        if self.hparams.get("head_lr") is not None:
            body, head = backbones.head_parameters(self.net)
            params = [{"params": body}, {"params": head, "lr": self.hparams.head_lr}]
        factory = self.optimizer_factory or (lambda params: torch.optim.Adam(params, lr=TUTORIAL_LR))
        optimizer = factory(params)
        if self.fused_optimizer and "fused" in optimizer.defaults and not optimizer.defaults["fused"]:
            # Rebuilt from its own settings rather than passing fused=True to the factory: the factory is
            # whatever callable the YAML named. Its defaults hold its constructor's arguments (AdamW's also
            # one it fixes itself, hence the filter).
            accepted = inspect.signature(type(optimizer)).parameters
            settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
            optimizer = type(optimizer)(params, **{**settings, "foreach": None, "fused": True})
        return optimizer

    def lr_scale(self) -> float:
        """The factor ``lr_scaling`` applies to the learning rates at this run's world size."""
        world_size = self.trainer.world_size
        return {"none": 1.0, "linear": float(world_size), "sqrt": math.sqrt(world_size)}[self.lr_scaling]

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # A checkpoint in the middle of an epoch: the epoch's training loss and accuracy so far, summed over the
        # ranks (every rank is here: each calls the save, rank 0 writes), so a resume logs the same epoch values.
        done, per_epoch = lightning_internals.epoch_progress(self.trainer)
        if done < per_epoch:
            checkpoint["train_epoch_metrics"] = {name: _synced_state(metric)
                                                 for name, metric in self._train_epoch_metrics()}

    def _train_epoch_metrics(self) -> list[tuple[str, Metric]]:
        return [("loss", self.train_loss), *self.train_metrics.items()]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._restored = True
        saved = checkpoint.get("train_epoch_metrics", {})
        if saved and self.global_rank == 0:  # rank 0 adds the ranks' sums; the others start from zero
            for name, metric in self._train_epoch_metrics():
                if name in saved:
                    metric.merge_state(saved[name])
        # A resumed optimizer takes its settings from the checkpoint's param_groups, which would undo
        # fused_optimizer for a run saved without it. This hook runs before Lightning loads them.
        if not self.fused_optimizer:
            return
        for state in checkpoint.get("optimizer_states", []):
            for group in state.get("param_groups", []):
                if "fused" in group:
                    group.update(fused=True, foreach=None)

    def configure_optimizers(self):
        optimizer = self.make_optimizer()
        scale = self.lr_scale()
        for group in optimizer.param_groups:  # before the scheduler reads them as its base learning rates
            group["lr"] *= scale
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        if isinstance(scheduler, WarmupCosineLR) and scheduler.total_steps is None:
            scheduler.total_steps = int(self.trainer.estimated_stepping_batches)
        config = {"scheduler": scheduler, "interval": self.scheduler_interval}
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            config["monitor"] = "val/loss"
        return {"optimizer": optimizer, "lr_scheduler": config}

    @property
    def lr(self) -> float | None:
        """The learning rate of the optimizer's first parameter group; None before the trainer has built it.
        Lightning's ``LearningRateFinder`` looks for this attribute, and sets its suggestion through it."""
        try:
            optimizers = self.trainer.optimizers
        except RuntimeError:  # not attached to a trainer
            return None
        return optimizers[0].param_groups[0]["lr"] if optimizers else None

    @lr.setter
    def lr(self, value: float) -> None:
        # The optimizer is built by then: scale its rates and the schedulers' base rates alike, so a warm-up or a
        # decay runs from the new rate (Lightning then sets the groups' current rate itself).
        current = self.lr
        if not current:
            return
        for optimizer in self.trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] *= value / current
        for config in self.trainer.lr_scheduler_configs:
            if hasattr(config.scheduler, "base_lrs"):
                config.scheduler.base_lrs = [rate * value / current for rate in config.scheduler.base_lrs]
