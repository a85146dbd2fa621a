"""Converters of ATen's constant pads and slices (registered in aten.CONVERTERS).

TF-style "same" padding, as ``transformers`` builds EfficientNet and MobileNetV2, pads each
strided convolution's input unevenly (``constant_pad_nd``) before a convolution without
padding: a held-out MobileNetV2's training graphs held 103 such nodes, each cutting the
regions around it. The graph API has no op that fills a constant, so:

- a pad that only crops (every amount <= 0: what the pad's backward is) is a slice;
- a zero pad a convolution reads is that convolution's own padding, which the graph's
  convolution takes per side (``folded``, asked by aten._conv): the convolution reads the
  pad's input; a pad nothing else reads (inference) is taken into the convolution's node,
  one that something else reads too (the forward's pad, saved for the backward's weight
  gradient) stays outside and runs there;
- any other pad that adds elements is refused, saying so.

``aten.slice.Tensor`` (a slice of one axis, with a step) is the graph's slice."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from fusegraph.graph.tensor import TensorAttr
from fusegraph.torch.aten import Ctx, Refused, _args, _int, _shape, converts, meta

aten = torch.ops.aten


def _pairs(pad: Sequence[Any], rank: int) -> list[tuple[int, int]]:
    """constant_pad_nd's list -- (before, after) pairs from the last axis backwards -- as one
    (before, after) pair per axis, first to last."""
    amounts = [_int(p) for p in pad]
    if len(amounts) % 2 or len(amounts) // 2 > rank:
        raise Refused(f"a pad list of {len(amounts)} entries for a rank-{rank} tensor")
    out = [(0, 0)] * rank
    for i in range(len(amounts) // 2):
        out[rank - 1 - i] = (amounts[2 * i], amounts[2 * i + 1])
    return out


def _value(n: torch.fx.Node) -> Any:
    args = _args(n)
    return args[2] if len(args) > 2 else n.kwargs.get("value", 0.0)


@converts(aten.constant_pad_nd.default)
def _pad(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    x, pad = _args(n)[:2]
    shape = _shape(meta(x))
    pairs = _pairs(pad, len(shape))
    if any(before > 0 or after > 0 for before, after in pairs):
        raise Refused("a pad that adds elements: no graph op fills a constant (a zero pad a convolution "
                      "reads is folded into that convolution's padding)")
    starts = [-before for before, _ in pairs]
    ends = [d + after for d, (_, after) in zip(shape, pairs, strict=True)]
    return c.g.slice(c.value(x), starts, ends, [1] * len(shape))


def folded(x: Any) -> tuple[torch.fx.Node, list[int], list[int]] | None:
    """Where a convolution's input ``x`` is a zero ``constant_pad_nd`` that adds elements on
    the spatial axes only: the pad's input and the amounts before and after each spatial
    axis, for the convolution to take as padding (None otherwise)."""
    if not isinstance(x, torch.fx.Node) or x.target is not aten.constant_pad_nd.default:
        return None
    src, pad = _args(x)[:2]
    value = _value(x)
    if not isinstance(src, torch.fx.Node) or isinstance(value, bool) or value != 0:
        return None
    try:
        pairs = _pairs(pad, len(_shape(meta(src))))
    except Refused:
        return None
    if any(p != (0, 0) for p in pairs[:2]) or any(b < 0 or a < 0 for b, a in pairs[2:]):
        return None
    return src, [b for b, _ in pairs[2:]], [a for _, a in pairs[2:]]


@converts(aten.slice.Tensor)
def _slice(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    args = _args(n)
    x = args[0]
    dim = _int(args[1]) if len(args) > 1 else 0
    shape = _shape(meta(x))
    d = dim % len(shape)
    out = _shape(meta(n))
    start = _int(args[2]) if len(args) > 2 and args[2] is not None else 0
    step = _int(args[4]) if len(args) > 4 else 1
    if step < 1:
        raise Refused(f"a slice with step {step}")
    size = shape[d]
    start = min(max(start + size if start < 0 else start, 0), size)
    starts, ends, steps = [0] * len(shape), list(shape), [1] * len(shape)
    starts[d], steps[d] = start, step
    ends[d] = min(start + (out[d] - 1) * step + 1, size) if out[d] else start
    return c.g.slice(c.value(x), starts, ends, steps)
