"""Matmul: batch-broadcasting ``torch.aten.matmul`` in the compute type.

A broadcast (stride-0) graph input stays at its stand-in size 1 on its batch, M (of A) and
N (of B) axes: torch's matmul broadcasts batch axes itself, and a product over a broadcast
M or N axis is the product of one row (column), broadcast afterwards -- less work, and IREE
3.13's data tiling crashes (SIGSEGV in MaterializeEncoding) on a matmul whose operand is
an expanded broadcast. Only a broadcast K axis is expanded.
"""

from __future__ import annotations

import math

from fusegraph.dtypes import DataType
from fusegraph.engines.iree.lower_base import NARROW_FLOATS, Lowering, Val, identity
from fusegraph.graph.infer import broadcast_dims
from fusegraph.graph.node import Node
from fusegraph.graph.ops import OpKind
from fusegraph.graph.tensor import TensorAttr

# Nodes that IREE data-tiles (or may turn into a matmul): their results carry encodings.
CONTRACTIONS = frozenset({OpKind.MATMUL, OpKind.CONV_FPROP, OpKind.CONV_DGRAD, OpKind.CONV_WGRAD, OpKind.SDPA})


# Nodes whose reductions IREE fuses with a consumer's pack (see the matvec case below).
REDUCERS = frozenset({
    OpKind.LAYERNORM, OpKind.RMSNORM, OpKind.BATCHNORM, OpKind.REDUCTION, OpKind.SOFTMAX,
})


def _operand(ctx: Lowering, t: TensorAttr, k_axis: int) -> Val:
    """``t`` in logical order, broadcast only along its contraction axis."""
    rank = len(t.shape)
    v = ctx.get(t, identity(rank))
    if v.rank != rank:  # a scalar constant: full size
        return ctx.get(t, identity(rank), full=True)
    if v.shape[k_axis] != t.shape[k_axis]:
        dims = list(v.shape)
        dims[k_axis] = t.shape[k_axis]
        v = ctx.broadcast(v, dims, identity(rank))
    return v


def lower_matmul(ctx: Lowering, node: Node) -> None:
    at, bt, ct_ = node.inputs["a"], node.inputs["b"], node.outputs["c"]
    ct = ctx.compute_type(node, at.dtype, bt.dtype)
    if not ct.is_float and ct not in (DataType.INT32, DataType.INT64):
        # Integer products summed in the operands' own 8/16 bits wrap at once (int8 x int8
        # over K=32 already does): accumulate in at least 32 bits, as cuDNN's int8 matmul
        # (INT32 compute) and the exact reference do.
        ct = DataType.INT32
    # Operands in logical order: a transposed operand (column-major B...) becomes a
    # transpose that IREE folds into the contraction's indexing maps.
    a = ctx.cast(_operand(ctx, at, len(at.shape) - 1), ct)
    if math.prod(a.shape[:-2]) > 1 and ctx.computed_from(at, CONTRACTIONS):
        # IREE 3.13's data tiling miscompiles (silently wrong rows) a batched matmul whose
        # A operand is another contraction's result reshaped to split its M axis: IREE
        # itself computes a matmul with a broadcast B batch ([B, M, K] @ [1, K, N]) as one
        # [B*M, K] @ [K, N], and fuses unpack -> expand to [B, M, N] -> the next matmul's
        # pack into one dispatch, which writes the packed A tiles at the wrong offsets
        # (M = 3 over batch 2-3: rows shifted by one batch). A reshape op between the two,
        # or pointwise ops after the reshape, do the same. Fencing A keeps the pack out of
        # the producer's dispatch (tests/test_fuzz_regressions.py
        # test_fuzz_iree_matmul_of_a_reshaped_matmul_result).
        a = ctx.fence(a)
    elif bt.shape[-1] == 1 and bt.dtype in NARROW_FLOATS and ctx.computed_from(at, REDUCERS):
        # IREE 3.13 fuses a norm (its statistics and normalization) and the pack of A into
        # one dispatch with a mixed-precision matvec (f32 A x f16 B, N = 1) and its CPU code
        # generation fails on it ("failed to run translation of source executable"), with
        # data tiling: layernorm (f16 io, f32 compute) -> [M, K] @ [K, 1]. Fencing A keeps
        # the norm in its own dispatch (test_fuzz_iree_matvec_with_narrow_weight_after_a_norm).
        a = ctx.fence(a)
    b = ctx.cast(_operand(ctx, bt, len(bt.shape) - 2), ct)
    batch = broadcast_dims([a.shape[:-2], b.shape[:-2]]) if (a.rank > 2 or b.rank > 2) else ()
    assert batch is not None
    shape = (*batch, a.shape[-2], b.shape[-1])
    c = ctx.b.aten("matmul", [a, b], shape, ct, identity(len(shape)))
    ctx.set(ct_, c)  # broadcast to the output's dims where an operand was
