"""For check_modes.sh: rank 0 writes images/s, val/acc, the replicas' compute dtype and checkpoint keys to JSON."""

from __future__ import annotations

import json
import time
from pathlib import Path

import lightning as L
import torch
from torch import nn

from flowers.runs import last_checkpoint


def _last_linear(net: nn.Module) -> nn.Linear:
    return [m for m in net.modules() if isinstance(m, nn.Linear)][-1]


def _is_compiled(net: nn.Module) -> bool:
    return getattr(net, "_compiled_call_impl", None) is not None  # set by nn.Module.compile


class Throughput(L.Callback):
    """Times the training epochs after the first (warm-up: compiling, cudnn autotuning, worker start-up)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.dtypes: set[str] = set()
        self.images = 0
        self.seconds = 0.0
        self._started: float | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        # A hook on the last layer sees each replica's output dtype: under dp the hook dict is shared by
        # the replicas, so bf16-mixed must show bfloat16 here, not float16 (see flowers/strategies.py).
        # A compiled network gets no hook (its side effect could split the graphs): it is probed at the end.
        if not _is_compiled(pl_module.net):
            _last_linear(pl_module.net).register_forward_hook(
                lambda module, args, output: self.dtypes.add(str(output.dtype)))

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch >= 1:
            self._sync()
            self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._started is not None:
            self.images += batch[0].shape[0] * trainer.world_size  # ddp: every rank trains its own batch

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._started is not None:
            self._sync()
            self.seconds += time.perf_counter() - self._started
            self._started = None

    def _probe_compiled(self, trainer, pl_module) -> None:
        # One eager forward of the network's own code under the run's precision, with the hook on.
        net = pl_module.net
        size = trainer.datamodule.image_size if trainer.datamodule is not None else 224
        images = torch.zeros(2, 3, size, size, device=pl_module.device)
        if pl_module.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        handle = _last_linear(net).register_forward_hook(
            lambda module, args, output: self.dtypes.add(str(output.dtype)))
        try:
            with torch.no_grad(), trainer.precision_plugin.forward_context():
                type(net).forward(net, images)
        finally:
            handle.remove()

    def on_fit_end(self, trainer, pl_module) -> None:
        if _is_compiled(pl_module.net):
            self._probe_compiled(trainer, pl_module)
        if not trainer.is_global_zero:
            return
        checkpoint = Path(last_checkpoint(trainer)).resolve()
        keys = list(torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)["state_dict"])
        record = {
            "strategy": type(trainer.strategy).__name__,
            "world_size": trainer.world_size,
            "devices": trainer.num_devices,
            "precision": trainer.precision,
            "compiled": _is_compiled(pl_module.net),
            "replica_dtypes": sorted(self.dtypes),
            "images_per_s": self.images / self.seconds if self.seconds else None,
            "val_acc": float(trainer.callback_metrics.get("val/acc", float("nan"))),
            "last_ckpt": str(checkpoint),
            "checkpoint_keys": keys,
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "throughput.json").write_text(json.dumps(record, indent=1))
