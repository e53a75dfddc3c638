"""Progressive resizing: the training image size of each epoch, growing from a small start to the final size.

Small images early, while the network learns coarse features, make the first epochs several times cheaper
(the convolutions cost about the square of the side); the last epochs train at the final size, close to
the evaluation size (FFCV's ResNet recipes, "progressive resizing"). The size depends only on the epoch,
so a resumed run trains each epoch at the size an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Sequence

SIZE_MULTIPLE = 16  # few distinct sizes: each new shape costs a warm-up (oneDNN primitives, cuDNN autotuning)


def size_at_epoch(epoch: int, max_epochs: int, *, start_size: int, final_size: int,
                  ramp: Sequence[float] = (0.25, 0.75)) -> int:
    """``start_size`` until ``ramp[0]`` of the epochs, then linearly up to ``final_size`` at ``ramp[1]`` of them,
    then ``final_size``; in between, rounded down to a multiple of 16 (never below ``start_size``)."""
    if max_epochs <= 0 or start_size >= final_size:
        return final_size
    first, last = (r * max_epochs for r in ramp)
    if epoch >= last:
        return final_size
    if epoch <= first:
        return start_size
    size = start_size + (final_size - start_size) * (epoch - first) / (last - first)
    return max(start_size, int(size) // SIZE_MULTIPLE * SIZE_MULTIPLE)


def schedule_sizes(start_size: int, final_size: int) -> list[int]:
    """Every side ``size_at_epoch`` can give, whatever the number of epochs."""
    if start_size >= final_size:
        return [final_size]
    between = range((start_size // SIZE_MULTIPLE + 1) * SIZE_MULTIPLE, final_size, SIZE_MULTIPLE)
    return [start_size, *between, final_size]
