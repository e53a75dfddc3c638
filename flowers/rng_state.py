"""The global random number generators' states, saved in each checkpoint and restored on resume.

Lightning saves no global RNG state in its checkpoints (only the loops', optimizers' and callbacks' states), so a
resumed run would shuffle, crop and drop out differently from an uninterrupted one.
"""

from __future__ import annotations

import random
from typing import Any

import lightning as L
import numpy as np
import torch


class RNGStateCheckpoint(L.Callback):
    """Saves the global torch/CUDA/numpy/Python RNG states in each checkpoint and restores them on resume.

    The checkpoint is written by global rank 0 only, so every rank gets rank 0's state back. That is what
    they had anyway: ``seed_everything`` seeds all ranks alike and they draw the same numbers in step
    (equal-sized training shards), while the ``DistributedSampler`` shuffles from its own seed and epoch.
    (The cached loader's per-rank crops come from generators seeded by such shared draws:
    ``batch_augment.WithTrainViews``.)
    Stored as tensors and plain numbers so ``weights_only=True`` loading accepts it.
    """

    def state_dict(self) -> dict[str, Any]:
        _, keys, position, has_gauss, gauss = np.random.get_state()
        state = {
            "torch": torch.get_rng_state(),
            "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "python": list(random.getstate()),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()  # dropout on a GPU draws from the device's generator
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])
        numpy = state_dict["numpy"]
        np.random.set_state(("MT19937", numpy["keys"].numpy().astype(np.uint32), numpy["position"],
                             numpy["has_gauss"], numpy["gauss"]))
        version, state, gauss = state_dict["python"]
        random.setstate((version, tuple(state), gauss))
