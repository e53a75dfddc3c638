"""``FlowerClassifier``: the AlexNet, its loss, metrics and optimizer, as a LightningModule."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from flowers.model import AlexNet

SEED_LR = 2e-4  # the seed's Adam learning rate for single-device training


class FlowerClassifier(L.LightningModule):
    """Args:
        num_classes, class_names: filled from the data by the CLI; stored in the checkpoint so
            ``FlowerClassifier.load_from_checkpoint(path)`` needs no arguments.
        label_smoothing: of the cross-entropy loss (0 = the seed's plain loss).
        dropout: of the two dropout layers in the classifier (the seed's 0.5).
        optimizer: a callable ``params -> Optimizer``, set in YAML with ``class_path``/``init_args``;
            unset means the seed's recipe, Adam with lr 2e-4.
        scheduler: a callable ``optimizer -> LRScheduler``; unset means a constant learning rate.
        scheduler_interval: step the scheduler every "epoch" or every "step".
    """

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
    ) -> None:
        super().__init__()
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"{len(class_names)} class names given for {num_classes} classes")
        self.save_hyperparameters()
        self.class_names = list(class_names) if class_names else [str(i) for i in range(num_classes)]
        self.net = AlexNet(num_classes, dropout=dropout)
        self.loss = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.scheduler_interval = scheduler_interval
        # micro = fraction of images right (what the seed prints); macro = mean of per-class accuracy.
        metrics = MetricCollection({
            "acc": MulticlassAccuracy(num_classes, average="micro"),
            "acc_macro": MulticlassAccuracy(num_classes, average="macro"),
        })
        self.train_metrics = metrics.clone(prefix="train/")
        self.val_metrics = metrics.clone(prefix="val/")
        self.test_metrics = metrics.clone(prefix="test/")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def _shared_step(self, batch, stage: str) -> torch.Tensor:
        images, labels = batch
        logits = self(images)
        loss = self.loss(logits, labels)
        metrics = getattr(self, f"{stage}_metrics")
        metrics.update(logits, labels)
        on_step = stage == "train"
        self.log(f"{stage}/loss", loss, on_step=on_step, on_epoch=True, prog_bar=True, sync_dist=not on_step,
                 batch_size=labels.shape[0])
        self.log_dict(metrics, on_step=False, on_epoch=True, prog_bar=stage == "val")
        return loss

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._shared_step(batch, "train")

    def validation_step(self, batch, batch_idx: int) -> None:
        self._shared_step(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._shared_step(batch, "test")

    def predict_step(self, batch, batch_idx: int) -> dict[str, torch.Tensor]:
        images, indices = batch
        return {"index": indices, "probs": self(images).float().softmax(dim=1)}

    def configure_optimizers(self):
        params = self.parameters()
        optimizer = self.optimizer_factory(params) if self.optimizer_factory else torch.optim.Adam(params, lr=SEED_LR)
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        config = {"scheduler": scheduler, "interval": self.scheduler_interval}
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            config["monitor"] = "val/loss"
        return {"optimizer": optimizer, "lr_scheduler": config}
