"""Callbacks the GPU checks add to a fit with ``--trainer.callbacks+=tests.gpu.callbacks.NAME``."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch
from torch import nn


class HostSyncCheck(L.Callback):
    """Turns torch's sync debug mode to "error" from the end of ``warmup`` steps to the end of ``steps`` more: any
    operation that makes the host wait for the GPU then fails the step, naming where it happened."""

    def __init__(self, warmup: int = 2, steps: int = 30) -> None:
        self.warmup, self.steps, self.checked = warmup, steps, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.warmup - 1:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        elif batch_idx >= self.warmup:
            self.checked += 1
            if self.checked == self.steps:
                torch.cuda.set_sync_debug_mode(0)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        torch.cuda.set_sync_debug_mode(0)  # an epoch's end (metrics, checkpoint) is not a step

    def on_exception(self, trainer, pl_module, exception) -> None:
        torch.cuda.set_sync_debug_mode(0)  # Lightning's teardown synchronises too


class ModeRecord(L.Callback):
    """Rank 0 writes ``out_dir/mode.json``: strategy, processes, precision, the dtype each replica's last layer
    computed in, the final val/acc and the checkpoint's keys."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.dtypes = Path(out_dir), set()

    def _hook(self, pl_module) -> torch.utils.hooks.RemovableHandle:
        last = [m for m in pl_module.net.modules() if isinstance(m, nn.Linear)][-1]
        return last.register_forward_hook(lambda module, args, output: self.dtypes.add(str(output.dtype)))

    def setup(self, trainer, pl_module, stage: str) -> None:
        # Under dp the replicas share the hook dict, so bf16-mixed must show bfloat16 here, not float16. A compiled
        # network gets no hook (it could split the graphs): it is probed eagerly at the end.
        if not pl_module.hparams.compile:
            self._hook(pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        if pl_module.hparams.compile:
            handle, size = self._hook(pl_module), trainer.datamodule.image_size
            images = torch.zeros(2, 3, size, size, device=pl_module.device)
            with torch.no_grad(), trainer.precision_plugin.forward_context():
                type(pl_module.net).forward(pl_module.net, images)
            handle.remove()
        if trainer.is_global_zero:
            # From the checkpoint callbacks: trainer.log_dir would broadcast, and the other ranks are done.
            checkpoint = next(Path(c.best_model_path) for c in trainer.checkpoint_callbacks
                              if Path(c.best_model_path).name == "last.ckpt")
            keys = list(torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)["state_dict"])
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "mode.json").write_text(json.dumps({
                "strategy": type(trainer.strategy).__name__, "world_size": trainer.world_size,
                "precision": trainer.precision, "dtypes": sorted(self.dtypes), "keys": keys,
                "val_acc": float(trainer.callback_metrics.get("val/acc", float("nan")))}))
