"""Copies into tensors laid out as a graph declares them, expanded (stride-0) axes included.

Every GPU plan copies a host or differently laid out input into the declared layout on the
device; torch refuses to write into a tensor whose elements share memory, so those copies
write one slice per expanded axis. Kept apart from the engines so that the torch engine and
the cudnn/triton plans (engines/cuda_plan.py) share it without importing each other.
"""

from __future__ import annotations

from typing import Any


def copy_strided(dst: Any, src: Any) -> Any:
    """``dst.copy_(src)`` for a ``dst`` laid out as a graph declares it, expanded (stride-0)
    axes included: torch refuses to write into a tensor whose elements share memory ("more
    than one element of the written-to tensor refers to a single memory location", which the
    GPU fuzz run hit on every broadcast input copied to the device), so only the first slice
    along each expanded axis is written -- the one memory location those elements share."""
    axes = [a for a, (d, s) in enumerate(zip(dst.shape, dst.stride(), strict=True)) if s == 0 and d > 1]
    if not axes:
        return dst.copy_(src)
    index = tuple(slice(0, 1) if a in axes else slice(None) for a in range(dst.dim()))
    src = src.expand(dst.shape) if hasattr(src, "expand") else src
    dst[index].copy_(src[index])
    return dst
