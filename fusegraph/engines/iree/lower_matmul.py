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
from fusegraph.graph.infer_base import broadcast_dims
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


def _matvec_matrix_k_outer(ctx: Lowering, matrix: TensorAttr, k_axis: int, vector_width: int, rows: int) -> bool:
    """Whether ``matrix``, the matrix operand of a matrix-vector product (``vector_width``, N
    for A or M for B, is 1; ``rows``, the matrix's other axis, is not), is computed by
    elementwise arithmetic and stored with its contraction axis ``k_axis`` outside (A [M, K]
    stored K-major, B [K, N] stored row-major).

    With data tiling, IREE 3.13 puts the elementwise work, the pack of the matrix (a
    transpose of that order) and the matvec into one dispatch and its CPU code generation
    fails on it in two ways, with the matrix stored K-innermost it compiles:

    - the elementwise value also read by another node is stored from that dispatch, and
      where the matvec's parallel extent fits one tile (M <= 8 on this CPU; the tile is the
      target's) the store lies outside the distributed loops: "'vector.store' op write
      affecting operations on global resources are restricted to workgroup distributed
      contexts" (fuzz seed 234407: sub(s[1,1], x[5,8] K-major) @ w[8,1], the difference
      also concatenated into the output; tanh(x) @ w read by a neg; x[1,8] @ tanh(w[8,5]));
    - with K >= 512, whether or not the value is shared, the pack is vectorized whole:
      "One or more operations with large vector sizes (16384 bytes) were found"
      (tanh(x[4,1000] K-major) @ w[1000,1]; x[1,1000] @ tanh(w[1000,64]) row-major).

    Fencing the matrix, in its logical order, writes it out before the matvec's dispatch
    (one more write and read of the matrix; not where it is stored K-innermost, or comes from
    a graph input) (tests/test_fuzz_regressions.py
    test_fuzz_iree_matvec_of_an_elementwise_matrix_stored_k_outer)."""
    if vector_width != 1 or rows <= 1:
        return False
    stored = ctx.values.get(id(matrix))
    if not stored or not ctx.computed_elementwise(matrix):
        return False
    produced = next(iter(stored.values()))  # the order the producer wrote it in
    return produced.perm[-1] != k_axis


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
    elif _matvec_matrix_k_outer(ctx, at, len(at.shape) - 1, bt.shape[-1], at.shape[-2]):
        a = ctx.fence(a)
    b = ctx.cast(_operand(ctx, bt, len(bt.shape) - 2), ct)
    if _matvec_matrix_k_outer(ctx, bt, len(bt.shape) - 2, at.shape[-2], bt.shape[-1]):
        b = ctx.fence(b)
    batch = broadcast_dims([a.shape[:-2], b.shape[:-2]]) if (a.rank > 2 or b.rank > 2) else ()
    assert batch is not None
    shape = (*batch, a.shape[-2], b.shape[-1])
    c = ctx.b.aten("matmul", [a, b], shape, ct, identity(len(shape)))
    ctx.set(ct_, c)  # broadcast to the output's dims where an operand was
