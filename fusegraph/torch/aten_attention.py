"""ATen attention into fusegraph's ``sdpa`` and ``sdpa_backward``: the CPU flash overloads
and the CUDA flash / memory-efficient / cuDNN overloads, forward and backward, with the
log-sum-exp statistics the backward reads. Dropout and explicit masks are refused (the
converter cannot reproduce PyTorch's RNG stream or read an arbitrary mask layout); the
sizes and RNG state these ops also return are handed back as what PyTorch computed.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from fusegraph.graph.tensor import TensorAttr
from fusegraph.torch.aten import (
    MIXED_RESULTS,
    Ctx,
    Refused,
    Result,
    Zeros,
    _args,
    _reshape,
    _shape,
    converts,
    meta,
)

aten = torch.ops.aten
def _sdpa_args(n: torch.fx.Node, dropout_at: int, causal_at: int) -> tuple[bool, float | None]:
    args = list(_args(n))
    dropout = args[dropout_at] if len(args) > dropout_at else n.kwargs.get("dropout_p", 0.0)
    causal = args[causal_at] if len(args) > causal_at else n.kwargs.get("is_causal", False)
    if dropout:
        raise Refused("attention with dropout")
    if n.kwargs.get("attn_mask") is not None:
        raise Refused("attention with a mask")
    scale: Any = n.kwargs.get("scale")
    return bool(causal), (float(scale) if scale is not None else None)


@converts(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _sdpa_cpu(c: Ctx, n: torch.fx.Node) -> list[TensorAttr | None]:
    causal, scale = _sdpa_args(n, 3, 4)
    q, k, v = (c.value(a) for a in _args(n)[:3])
    o, stats = c.g.sdpa(q, k, v, scale, causal, generate_stats=True)
    return [o, _reshape(c, stats, _shape(meta(n)[1]))]


@converts(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _sdpa_cpu_bwd(c: Ctx, n: torch.fx.Node) -> list[TensorAttr | None]:
    do, q, k, v, o, lse = _args(n)[:6]
    causal, scale = _sdpa_args(n, 6, 7)
    stats = _reshape(c, c.value(lse), [*_shape(meta(lse)), 1])
    dq, dk, dv = c.g.sdpa_backward(c.value(q), c.value(k), c.value(v), c.value(o), c.value(do), stats, scale, causal)
    return [dq, dk, dv]


# The CUDA attention ops, forward and backward, by their signatures: where dropout, the
# causal flag and a bias sit, which results are the log-sum-exp and which only RNG state
# or debug output (zeros where there is no dropout: nothing reads them then).
@dataclass(frozen=True)
class _Attn:
    dropout: int
    causal: int
    bias: int | None
    lse: int
    zeros: tuple[int, ...]


_ATTENTION: dict[Any, _Attn] = {
    aten._scaled_dot_product_flash_attention.default: _Attn(3, 4, None, 1, (6, 7, 8)),
    aten._scaled_dot_product_efficient_attention.default: _Attn(5, 6, 3, 1, (2, 3)),
    aten._scaled_dot_product_cudnn_attention.default: _Attn(5, 6, 3, 1, (6, 7, 8)),
}


def _attention_flags(n: torch.fx.Node, dropout: int, causal: int, bias: int | None) -> tuple[bool, float | None]:
    args = _args(n)
    if bias is not None and len(args) > bias and args[bias] is not None:
        raise Refused("attention with a bias")
    if len(args) > dropout and args[dropout]:
        raise Refused("attention with dropout")
    scale: Any = n.kwargs.get("scale")
    return bool(args[causal]) if len(args) > causal else False, (float(scale) if scale is not None else None)


def _lse_shape(q: Any) -> list[int]:
    return _shape(q)[:-1]


@converts(*_ATTENTION)
def _sdpa_cuda(c: Ctx, n: torch.fx.Node) -> list[Result]:
    spec = _ATTENTION[n.target]
    causal, scale = _attention_flags(n, spec.dropout, spec.causal, spec.bias)
    v = meta(n)
    lse = v[spec.lse]
    q, k, vv = (c.value(a) for a in _args(n)[:3])
    lse_read = any(u.target is operator.getitem and u.args[1] == spec.lse and u.users for u in n.users)
    # no statistics asked for, or none read (inference: the flash kernel returns them all
    # the same): an sdpa with statistics runs the torch engine's explicit softmax, which on
    # an H200 took 3.07 ms against Inductor's 0.09 (bench_region_call.py, 12 heads x 1024)
    if lse is None or lse.numel() == 0 or not lse_read:
        o = c.g.sdpa(q, k, vv, scale, causal)
        stats_out: Result = None
    else:
        want = _shape(lse)
        if math.prod(want) != math.prod(_lse_shape(meta(_args(n)[0]))):
            raise Refused(f"attention statistics laid out as {want} (padded), not one per query row")
        o, stats = c.g.sdpa(q, k, vv, scale, causal, generate_stats=True)
        stats_out = _reshape(c, stats, want)
    out: list[Result] = [None] * len(v)
    out[0], out[spec.lse] = o, stats_out
    for i in spec.zeros:
        x = v[i]
        if isinstance(x, torch.Tensor):
            out[i] = Zeros(tuple(_shape(x)), x.dtype)
    for user in n.users:  # what else is read must be a size (max_q, max_k) or nothing
        idx = user.args[1] if user.target is operator.getitem else None
        if idx is None or (idx not in (0, spec.lse, *spec.zeros) and isinstance(v[idx], torch.Tensor)):
            raise Refused(f"attention result {idx} is read")
    return out


# backward ops: positions of (dO, q, k, v, o, lse), dropout, causal, bias
_ATTENTION_BWD: dict[Any, tuple[tuple[int, ...], int, int, int | None]] = {
    aten._scaled_dot_product_flash_attention_backward.default: ((0, 1, 2, 3, 4, 5), 10, 11, None),
    aten._scaled_dot_product_efficient_attention_backward.default: ((0, 1, 2, 3, 5, 6), 9, 11, 4),
    aten._scaled_dot_product_cudnn_attention_backward.default: ((0, 1, 2, 3, 4, 5), 13, 14, 8),
}


@converts(*_ATTENTION_BWD)
def _sdpa_cuda_bwd(c: Ctx, n: torch.fx.Node) -> list[Result]:
    where, dropout, causal, bias = _ATTENTION_BWD[n.target]
    flags_causal, scale = _attention_flags(n, dropout, causal, bias)
    args = _args(n)
    do, q, k, v, o, lse = (args[i] for i in where)
    rows = _lse_shape(meta(q))
    if math.prod(_shape(meta(lse))) != math.prod(rows):
        raise Refused("attention statistics laid out padded, not one per query row")
    stats = _reshape(c, c.value(lse), [*rows, 1])
    dq, dk, dv = c.g.sdpa_backward(c.value(q), c.value(k), c.value(v), c.value(o), c.value(do), stats, scale,
                                   flags_causal)
    out: list[Result] = [dq, dk, dv]
    if n.target is aten._scaled_dot_product_efficient_attention_backward.default:
        out.append(None)  # the bias gradient (no bias)
    return out


MIXED_RESULTS.update(_ATTENTION)
