"""Strides and layouts: dims are logical (N, C, spatial...), the layout lives in the strides.

A layout name lists the logical axes from outermost to innermost in memory; ``NHWC`` on a
4-D tensor whose logical order is (N, C, H, W) means the permutation (0, 2, 3, 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

_CANONICAL = {
    2: "NC",
    3: "NCH",
    4: "NCHW",
    5: "NCDHW",
}
# Aliases: filters (K, C, spatial) and cuDNN's spellings.
_ALIASES = {
    "KC": "NC",
    "KCR": "NCH",
    "KRC": "NHC",
    "KCRS": "NCHW",
    "KRSC": "NHWC",
    "KCTRS": "NCDHW",
    "KTRSC": "NDHWC",
    "NWC": "NHC",
    "NCW": "NCH",
    "CN": "CN",
}


def layout_permutation(rank: int, layout: str) -> tuple[int, ...]:
    """Memory order (outermost first) of the logical axes for a named layout."""
    name = _ALIASES.get(layout.upper(), layout.upper())
    canonical = _CANONICAL.get(rank)
    if canonical is None or len(name) != rank or sorted(name) != sorted(canonical):
        raise ValueError(f"layout '{layout}' does not fit a rank-{rank} tensor")
    return tuple(canonical.index(ch) for ch in name)


def packed_strides(dim: Sequence[int], order: Sequence[int] | None = None) -> tuple[int, ...]:
    """Packed strides with ``order`` listing logical axes from outermost to innermost."""
    rank = len(dim)
    if order is None:
        order = range(rank)
    strides = [0] * rank
    step = 1
    for axis in reversed(list(order)):
        strides[axis] = step
        step *= max(int(dim[axis]), 1)
    return tuple(strides)


def strides_for(dim: Sequence[int], layout: str = "row_major") -> tuple[int, ...]:
    """Packed strides of ``dim`` in a named layout (NCHW, NHWC, NCDHW, NDHWC, NC, KRSC...)."""
    if layout.lower() in ("row_major", "packed"):
        return packed_strides(dim)
    return packed_strides(dim, layout_permutation(len(dim), layout))


def stride_order(dim: Sequence[int], stride: Sequence[int]) -> tuple[int, ...]:
    """Logical axes from outermost to innermost in memory; ties keep logical order."""
    return tuple(sorted(range(len(dim)), key=lambda a: (-int(stride[a]), a)))


def layout_name(dim: Sequence[int], stride: Sequence[int]) -> str | None:
    """The canonical name of a packed layout (``"NHWC"``...), or None.

    Where size-1 axes make the name ambiguous, their strides decide their place.
    """
    canonical = _CANONICAL.get(len(dim))
    if canonical is None or not is_packed(dim, stride):
        return None
    return "".join(canonical[a] for a in stride_order(dim, stride))


def is_packed(dim: Sequence[int], stride: Sequence[int]) -> bool:
    """True when the strides are a dense permutation (no gaps, no broadcast).

    Size-1 axes are never stepped over, so their strides do not matter (numpy gives
    them various values).
    """
    axes = [a for a in range(len(dim)) if dim[a] > 1]
    if any(stride[a] <= 0 for a in axes):
        return False
    step = 1
    for a in sorted(axes, key=lambda a: stride[a]):
        if stride[a] != step:
            return False
        step *= int(dim[a])
    return True


def same_strides(dim: Sequence[int], have: Sequence[int], want: Sequence[int]) -> bool:
    """Whether strides ``have`` lay ``dim`` out as ``want`` does: equal on every axis longer
    than one (a size-1 axis is never stepped over, so its stride does not matter)."""
    return all(d <= 1 or h == w for d, h, w in zip(dim, have, want, strict=True))


def overlapping_axes(dim: Sequence[int], stride: Sequence[int]) -> tuple[int, int] | None:
    """Two axes (of size > 1, non-zero stride) whose elements can alias, or None.

    Sorting axes by stride, each axis must step over the whole extent of the inner ones.
    """
    axes = [a for a in range(len(dim)) if dim[a] > 1 and stride[a] != 0]
    axes.sort(key=lambda a: (stride[a], a))
    extent = 1  # one past the largest offset the axes so far can reach
    prev: int | None = None
    for a in axes:
        if stride[a] < extent and prev is not None:
            return (prev, a)
        extent += stride[a] * (dim[a] - 1)
        prev = a
    return None


def extent(dim: Sequence[int], stride: Sequence[int]) -> int:
    """Elements of memory a tensor's view spans: one past its largest offset (strides >= 0)."""
    return 1 + sum(int(s) * (int(d) - 1) for d, s in zip(dim, stride, strict=True))


def is_dense(dim: Sequence[int], stride: Sequence[int]) -> bool:
    """Every element of the view's span is addressed exactly once (a packed permutation)."""
    return is_packed(dim, stride)


def empty_strided(dim: Sequence[int], stride: Sequence[int], dtype: Any) -> np.ndarray:
    """An uninitialized array of logical ``dim`` with the element strides ``stride``.

    A packed layout is a transposed dense array; any other (gaps, as in a slice of a larger
    buffer, or broadcast and overlapping axes, as in a sliding-window input) is a view of a
    buffer of the layout's extent, so its strides are exactly the declared ones.
    """
    if is_packed(dim, stride):
        order = stride_order(dim, stride)
        base = np.empty(tuple(dim[a] for a in order), dtype=dtype)
        return base.transpose(tuple(order.index(a) for a in range(len(dim))))
    dt = np.dtype(dtype)
    buf = np.empty(extent(dim, stride), dtype=dt)
    return np.lib.stride_tricks.as_strided(
        buf, tuple(int(d) for d in dim), tuple(int(s) * dt.itemsize for s in stride)
    )


def self_overlapping(dim: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether two elements of the view address the same memory (broadcast or overlap)."""
    if any(s == 0 and d > 1 for d, s in zip(dim, stride, strict=True)):
        return True
    return overlapping_axes(dim, stride) is not None


def element_strides(shape: Sequence[int], byte_strides: Sequence[int], itemsize: int) -> tuple[int, ...] | None:
    """Byte strides of an array as element strides, or None when not a whole number."""
    out = []
    for s in byte_strides:
        if s % itemsize:
            return None
        out.append(s // itemsize)
    return tuple(out)


def physical_order(dim: Sequence[int], stride: Sequence[int]) -> tuple[int, ...]:
    """Logical axes in memory order (outermost first) — how a buffer is laid out."""
    return stride_order(dim, stride)


def physical_shape(dim: Sequence[int], stride: Sequence[int]) -> tuple[int, ...]:
    """Shape of the dense buffer behind a tensor, in memory order; broadcast axes are 1.

    Compiled engines take and return buffers of this shape, so that a tensor declared NHWC
    crosses the boundary as an [N, H, W, C] buffer with no copy.
    """
    return tuple(
        1 if stride[a] == 0 else int(dim[a]) for a in physical_order(dim, stride)
    )


def to_physical(arr: np.ndarray, dim: Sequence[int], stride: Sequence[int]) -> np.ndarray:
    """The dense memory-order buffer of a logical-view array (a view when already dense)."""
    order = physical_order(dim, stride)
    view = arr.transpose(order)
    sl = tuple(slice(0, 1) if stride[a] == 0 else slice(None) for a in order)
    return np.ascontiguousarray(view[sl])


def from_physical(buf: np.ndarray, dim: Sequence[int], stride: Sequence[int]) -> np.ndarray:
    """The logical view (dims order) of a memory-order buffer; no copy."""
    order = physical_order(dim, stride)
    return buf.transpose(tuple(order.index(a) for a in range(len(dim))))
