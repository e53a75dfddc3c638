"""``precision: auto``: bf16 mixed precision where the hardware computes bf16 natively, fp32 elsewhere.

A CPU without ``avx512_bf16`` or ``amx_bf16`` (most laptops, many servers) emulates bf16, many times slower
than fp32 (docs/benchmarks.md); a GPU before Ampere has no bf16 at all.
"""

from __future__ import annotations

from pathlib import Path

import torch

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them; empty elsewhere (then bf16 counts as emulated)."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def resolve(accelerator: str | None) -> tuple[str, str]:
    """The Trainer precision ``auto`` stands for on this machine, and why, for ``accelerator``."""
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator in (None, "auto") and torch.cuda.is_available())
    if on_gpu:
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bf16-mixed", "this GPU computes in bf16"
        return "32-true", "this GPU has no bf16"
    if found := sorted(cpu_flags() & set(BF16_CPU_FLAGS)):
        return "bf16-mixed", f"this CPU has {' and '.join(found)}"
    return "32-true", "this CPU has no avx512_bf16 or amx_bf16, so bf16 would be emulated"
