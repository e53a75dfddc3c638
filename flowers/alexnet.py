"""The tutorial's half-width AlexNet, as a plain ``nn.Module``.

Module names and layer order match the tutorial's ``AlexNet`` class exactly, so a ``state_dict``
moves between the two with ``strict=True`` (keys ``features.0.weight`` … ``classifier.6.bias``).
"""

from __future__ import annotations

import torch
from torch import nn

# With k11/s4 then three k3/s2 poolings, a side shorter than this collapses to zero.
MIN_IMAGE_SIZE = 63
POOLED = (6, 6)  # the features' side at the tutorial's 224 px, which the classifier's first layer expects


def pooling_matrix(size: int, pooled: int, *, like: torch.Tensor) -> torch.Tensor:
    """``pooled × size``: row i averages the input positions of adaptive average pooling's bin i."""
    starts = [i * size // pooled for i in range(pooled)]
    ends = [-(-(i + 1) * size // pooled) for i in range(pooled)]
    matrix = torch.zeros(pooled, size, dtype=like.dtype, device=like.device)
    for i, (start, end) in enumerate(zip(starts, ends, strict=True)):
        matrix[i, start:end] = 1 / (end - start)
    return matrix


def adaptive_avg_pool_by_matmul(x: torch.Tensor, pooled: tuple[int, int]) -> torch.Tensor:
    """``adaptive_avg_pool2d`` as two matrix products, whose CUDA backward is deterministic (the pool's is not,
    so ``--trainer.deterministic=true`` would stop at the first backward)."""
    rows = pooling_matrix(x.shape[-2], pooled[0], like=x)
    cols = pooling_matrix(x.shape[-1], pooled[1], like=x)
    return rows @ x @ cols.T


class AlexNet(nn.Module):
    def __init__(self, num_classes: int = 5, *, dropout: float = 0.5, init_weights: bool = True) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 48, kernel_size=11, stride=4, padding=2),  # 48x55x55 at 224
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),  # 48x27x27
            nn.Conv2d(48, 128, kernel_size=5, padding=2),  # 128x27x27
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),  # 128x13x13
            nn.Conv2d(128, 192, kernel_size=3, padding=1),  # 192x13x13
            nn.ReLU(inplace=True),
            nn.Conv2d(192, 192, kernel_size=3, padding=1),  # 192x13x13
            nn.ReLU(inplace=True),
            nn.Conv2d(192, 128, kernel_size=3, padding=1),  # 128x13x13
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),  # 128x6x6
        )
        # Not in the tutorial: lets image sizes other than 224 reach the 6x6 the classifier expects.
        # It has no parameters, so state_dict keys are unchanged; forward skips it at 224, where it is the identity.
        self.avgpool = nn.AdaptiveAvgPool2d(POOLED)
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout),
            nn.Linear(128 * 6 * 6, 2048),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(2048, 2048),
            nn.ReLU(inplace=True),
            nn.Linear(2048, num_classes),
        )
        if init_weights:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """The tutorial's optional init: Kaiming-normal convs, N(0, 0.01) linears, zero biases."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        if x.shape[-2] != 6 or x.shape[-1] != 6:  # POOLED, spelled out for TorchScript
            x = self.avgpool(x) if torch.jit.is_scripting() else self._pool(x)
        return self.classifier(torch.flatten(x, start_dim=1))

    @torch.jit.unused  # an exported TorchScript network pools as it is; deterministic training is eager
    def _pool(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and torch.are_deterministic_algorithms_enabled():
            return adaptive_avg_pool_by_matmul(x, POOLED)
        return self.avgpool(x)
