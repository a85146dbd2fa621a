"""Where the IREE lowering stops a fusion: questions about a graph's structure that decide
whether a value is written out in a dispatch of its own (``Lowering.fence``) before its
readers read it.

Each rule answers one IREE 3.13 miscompile or verifier failure that the graph fuzzer found
(the docstrings name the seeds and the regression tests); keeping them apart from the
lowering's value bookkeeping lets a reader see every fence rule in one place, and lets the
rules go one by one as IREE fixes them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fusegraph.graph.node import Node
from fusegraph.graph.ops import OpKind, PointwiseMode
from fusegraph.graph.tensor import TensorAttr

if TYPE_CHECKING:
    from fusegraph.engines.iree.lower_base import Perm, Val
    from fusegraph.graph.graph import Graph

# Pointwise modes that multiply their operands (see Lowering.broadcast_product).
_PRODUCTS = frozenset({
    PointwiseMode.MUL, PointwiseMode.GELU_BWD, PointwiseMode.TANH_BWD, PointwiseMode.SIGMOID_BWD,
    PointwiseMode.RELU_BWD,
})


# Readers of a broadcast value that get it expanded in its own dispatch
# (Lowering._materialize_expansion).
_REDUCING_READERS = frozenset({
    OpKind.REDUCTION, OpKind.SOFTMAX, OpKind.LAYERNORM, OpKind.RMSNORM, OpKind.BATCHNORM,
})
_CONVOLUTIONS = frozenset({OpKind.CONV_FPROP, OpKind.CONV_DGRAD, OpKind.CONV_WGRAD})
# Operations whose data-tiled operands IREE packs (Lowering.shares_a_packed_operand), and the
# nodes it fuses into their producers' dispatches as elementwise work or views.
_CONTRACTIONS = _CONVOLUTIONS | {OpKind.MATMUL}
_ELEMENTWISE = frozenset({
    OpKind.POINTWISE, OpKind.BATCHNORM_INFERENCE, OpKind.RESHAPE, OpKind.TRANSPOSE, OpKind.SLICE,
    OpKind.CONCATENATE,
})

_ARITHMETIC = frozenset({OpKind.POINTWISE, OpKind.BATCHNORM_INFERENCE})
_SOFTMAX = frozenset({OpKind.SOFTMAX})


class FusionGuards:
    """The fence rules, mixed into :class:`~fusegraph.engines.iree.lower_base.Lowering`,
    which holds the state they read (declared here for the type checker)."""

    graph: Graph
    node: Node | None
    values: dict[int, dict[Perm, Val]]
    _producers: dict[str, Node]
    _read: set[int] | None
    _readers: dict[int, list[Node]] | None
    _packed_sources: frozenset[int] | None

    def _materialize_expansion(self, t: TensorAttr) -> bool:
        """Whether the node being lowered reads broadcast ``t`` (kept at a size-1 stand-in on
        its broadcast axes) through an expansion written out in its own dispatch (a fence
        after the broadcast_to) rather than fused into the reader. Two IREE 3.13 bugs:

        - a convolution (fprop, dgrad, wgrad) of an input broadcast along its spatial or
          batch axes: with data tiling, iree-compile crashed (SIGSEGV in MaterializeEncoding,
          DecomposeMismatchEncodingTensorStoreOp) on the expansion fused into the data-tiled
          operand (fuzz seed 2314104: a lone wgrad of x [2,6,3,5] with strides [1,2,0,0];
          test_fuzz_iree_convolution_of_a_broadcast_input);
        - a value computed from broadcast inputs read by reducing nodes: IREE fused its
          expansion, and its producer, into readers reducing along different axes and failed
          (two softmaxes over axes 0 and 1 of tanh(x[3,4] with strides [0,1]); a batchnorm's
          and an rmsnorm's statistics of a matmul of a broadcast row, fuzz seed 530993):
          "'vector.store' (or 'iree_linalg_ext.map_store') op write affecting operations on
          global resources are restricted to workgroup distributed contexts", or with data
          tiling "'linalg.unpack' op failed to verify that result type matches type of
          dest". Fencing the producer alone is not enough (the matmul case still failed)
          (test_fuzz_iree_broadcast_value_read_by_two_reducers).

        Such inputs are rare outside the fuzzer (stride-0 views; ONNX models bind packed
        tensors); the price is writing the expanded tensor once, shared by its readers."""
        if self.node is None:
            return False
        if self.node.kind in _CONVOLUTIONS:
            return True
        return t.producer is not None and self.node.kind in _REDUCING_READERS

    def producer(self, t: TensorAttr) -> Node | None:
        """The node writing ``t`` (None for a graph input or a constant)."""
        if t.producer is None:
            return None
        if not self._producers:
            self._producers.update({n.name: n for n in self.graph.nodes})
        return self._producers.get(t.producer)

    def is_read(self, t: TensorAttr) -> bool:
        """Whether any node reads ``t``."""
        if self._read is None:
            self._read = {id(x) for n in self.graph.nodes for x in n.inputs.values()}
        return id(t) in self._read

    def broadcast_product(self, t: TensorAttr, axes: Sequence[int]) -> bool:
        """Whether ``t`` is a product (mul, an activation backward, an rmsnorm without bias)
        with an operand broadcast along one of the logical ``axes``.

        IREE 3.13 fuses such a product into a sum over those axes (a reduction, the mean of a
        norm) as one contraction-like op that its CPU code generation cannot vectorize
        ("'vector.contract' op invalid accumulator/result vector shape"): mul(dy[1,2,1,4],
        x[5,2,3,4]) summed over axes 1-3 fails, summed over axis 3 compiles. Readers fence ``t``
        when this holds (tests/test_fuzz_regressions.py
        test_fuzz_iree_backward_op_with_broadcast_dy_into_reduction)."""
        node = self.producer(t)
        if node is None:
            return False
        # An rmsnorm without bias ends in a product too (x * inv_rms * scale): a scale broadcast
        # along a summed axis (scale [3] of x [2,4,1,3], then a layernorm or a mean over axes
        # 1-3) failed the same way (fuzz seed 453; a bias added after the product compiles).
        rms_product = node.kind == OpKind.RMSNORM and "bias" not in node.inputs
        if not rms_product and (node.kind != OpKind.POINTWISE or getattr(node.attrs, "mode", None) not in _PRODUCTS):
            return False
        rank = len(t.shape)
        for u in node.inputs.values():
            if u.is_scalar:
                continue
            stored = self.values.get(id(u))
            have = next(iter(stored.values())).logical_shape if stored else tuple(u.shape)
            k = rank - len(have)
            if any(t.shape[a] > 1 and (a < k or have[a - k] == 1) for a in axes):
                return True
        return False

    def _elementwise_sources(self, t: TensorAttr) -> frozenset[int]:
        """Ids of ``t`` and of the tensors it is computed from through elementwise ops and
        views only (what IREE may fuse into one dispatch with whatever reads ``t``)."""
        return frozenset(id(u) for u in self._tensors_through_elementwise(t, up=True))

    def shares_a_packed_operand(self, t: TensorAttr, kept: Sequence[int]) -> bool:
        """Whether a node reducing ``t`` to one value (every logical axis but ``kept`` summed,
        and those of extent 1) shares an elementwise producer with an operand of a matmul or
        a convolution.

        With data tiling, IREE 3.13 fuses that producer into the reduction's dispatch and,
        with it, the producer's other consumer: the pack (set_encoding) of the contraction's
        operand. A reduction to one value has no parallel loop to distribute, so the pack's
        store lands outside the distributed loops and iree-compile fails ("'vector.store' (or
        'memref.store') op write affecting operations on global resources are restricted to
        workgroup distributed contexts"; iree-org/iree issue 24058 describes this dispatch,
        elementwise -> reduction and -> set_encoding, the set_encoding left outside the
        workgroup loop). Fuzz seed 24718: x [3,1,1,2] read by a wgrad whose
        dy is 1x1 (a matmul over the batch) and by a batchnorm with one channel, f16 io (the
        shared producer is x's cast to f32); minimized: tanh(x[3,4]) read by a matmul and by a
        sum over both axes, or siblings of it (neg(t) into the matmul, exp(t) into the sum).
        A reduction keeping a parallel axis of extent > 1 compiles. The reader fences its
        input when this holds, so the reduction's dispatch reads a finished tensor
        (tests/test_fuzz_regressions.py test_fuzz_iree_lone_reduction_beside_a_packed_operand)."""
        if any(t.shape[a] > 1 for a in kept):
            return False
        if self._packed_sources is None:
            self._packed_sources = frozenset().union(*(
                self._elementwise_sources(u)
                for n in self.graph.nodes if n.kind in _CONTRACTIONS for u in n.inputs.values()
            ))
        return not self._packed_sources.isdisjoint(self._elementwise_sources(t))

    def computed_elementwise(self, t: TensorAttr) -> bool:
        """Whether ``t`` is computed by arithmetic elementwise ops (pointwise, an inference
        batch norm), perhaps through views: work IREE fuses into the dispatch of whatever
        reads ``t``. Views of graph inputs alone, and casts (which IREE clones into each
        reader), are not."""
        return self._made_by(t, _ARITHMETIC)

    def beside_a_softmax(self, x: TensorAttr, y: TensorAttr) -> tuple[bool, bool]:
        """Whether a layer (or batch) norm's input ``x`` is computed from a softmax, and
        whether its result ``y`` is read by a softmax, through elementwise ops and views only.

        A layer norm whose statistics (mean, inv_var) are graph outputs, fused with a
        softmax over the same rows, failed iree-compile 3.13: the statistics' stores, one
        value per row, were left outside the distributed loops of the softmax's dispatch
        ("'vector.store' (or 'memref.store') op write affecting operations on global
        resources are restricted to workgroup distributed contexts", the family of
        shares_a_packed_operand). Fuzz seeds 817 (softmax -> layernorm), 34410 (layernorm
        -> softmax) and 3000314297 (tanh(matmul) -> softmax -> layernorm); minimized:
        x[8,3] -> softmax(-1) -> layernorm with its statistics read out, or layernorm ->
        tanh -> softmax. Without the statistics, or with a sum or another norm in the
        softmax's place, it compiled. A batch norm failed alike where its groups are the
        softmax's rows (fuzz seed 31895: x[1,7,1,3] -> softmax over W -> batch norm).
        lower_norm fences the side that holds the softmax (tests/test_fuzz_regressions.py
        test_fuzz_iree_layernorm_statistics_beside_a_softmax, tests/test_fuzz_softmax_neighbours.py)."""
        return self._made_by(x, _SOFTMAX), self._read_by(y, _SOFTMAX)

    def shared_with_a_softmax(self, t: TensorAttr) -> bool:
        """Whether ``t`` is read by a softmax (through elementwise ops and views) and by at
        least one other node.

        iree-compile 3.13 fuses ``t``'s producer into the softmax's dispatch and stores ``t``
        for its other reader from there, outside the distributed loops ("'vector.store' op
        write affecting operations on global resources are restricted to workgroup
        distributed contexts"): fuzz seed 288016661 (x[4,3] -> softmax(0) -> softmax(1), and
        sin of the first softmax), seed 3308340 (gelu_backward -> softmax(0), and the same
        value concatenated into an output). With either reader alone it compiled. ``set``
        fences ``t``: it is materialized for the other reader anyway, so the fence costs the
        softmax one read of it (tests/test_fuzz_softmax_neighbours.py)."""
        return len(self._readers_of(t)) >= 2 and self._read_by(t, _SOFTMAX)

    def _readers_of(self, t: TensorAttr) -> list[Node]:
        """The nodes reading ``t`` (each once)."""
        if self._readers is None:
            self._readers = {}
            for n in self.graph.nodes:
                for v in {id(v): v for v in n.inputs.values()}.values():
                    self._readers.setdefault(id(v), []).append(n)
        return self._readers.get(id(t), [])

    def _made_by(self, t: TensorAttr, kinds: frozenset[OpKind]) -> bool:
        """Whether a node of ``kinds`` computes ``t`` through elementwise ops and views only."""
        return any(
            (n := self.producer(u)) is not None and n.kind in kinds
            for u in self._tensors_through_elementwise(t, up=True)
        )

    def _read_by(self, t: TensorAttr, kinds: frozenset[OpKind]) -> bool:
        """Whether a node of ``kinds`` reads ``t``, or what elementwise ops and views make of it."""
        return any(
            n.kind in kinds for u in self._tensors_through_elementwise(t, up=False) for n in self._readers_of(u)
        )

    def _tensors_through_elementwise(self, t: TensorAttr, *, up: bool) -> list[TensorAttr]:
        """``t`` and the tensors it is computed from (``up``) or that are computed from it,
        through elementwise ops and views only."""
        seen: dict[int, TensorAttr] = {}
        todo = [t]
        while todo:
            u = todo.pop()
            if u.is_scalar or id(u) in seen:
                continue
            seen[id(u)] = u
            if up:
                node = self.producer(u)
                if node is not None and node.kind in _ELEMENTWISE:
                    todo.extend(node.inputs.values())
            else:
                todo.extend(o for n in self._readers_of(u) if n.kind in _ELEMENTWISE for o in n.outputs.values())
        return list(seen.values())

    def one_group_into_a_contraction(self, x: TensorAttr, y: TensorAttr, kept: int) -> bool:
        """Whether a norm over a single group (``x``'s ``kept`` axis, the groups, of extent
        1: every statistic one value) writes ``y`` into an operand of a matmul or a
        convolution, through elementwise ops and views only.

        With data tiling, iree-compile 3.13 fused the normalization, and with it the pack
        (set_encoding) of the contraction's operand, into the dispatch of the single-valued
        mean; a reduction to one value has no parallel loop to distribute, so the pack's
        store was left outside the distributed loops ("'iree_linalg_ext.map_store' op write
        affecting operations on global resources are restricted to workgroup distributed
        contexts"; the family of shares_a_packed_operand). Fuzz seed 2, minimized:
        x[1,5,7,5] -> layernorm -> matmul with w[1,1,5,7]; with two groups (x[2,5,7,5]) it
        compiled; rmsnorm failed alike. The norm fences ``y``
        (tests/test_fuzz_single_group_norms.py)."""
        if x.shape[kept] != 1:
            return False
        return self._read_by(y, _CONTRACTIONS)

    def attention_operand_from_a_contraction(self, t: TensorAttr) -> bool:
        """Whether an attention's query or key ``t`` is computed by a matmul or a convolution,
        through elementwise ops and views only.

        iree-compile 3.13 compiled such graphs and returned wrong numbers: a matmul whose
        weight is broadcast over the batch (a[1,2,5,2] @ w[1,1,2,7], the projection of every
        transformer) feeding the query or the key of an attention gave relative errors of
        0.07-0.7 against the reference; with the weight not broadcast, or feeding the value,
        it was exact (fuzz seed 11681 of a local run on commit 66a0ea2: sdpa -> matmul ->
        tanh -> sdpa, minimized). The attention reads a fenced operand
        (tests/test_fuzz_attention_operands.py)."""
        return self._made_by(t, _CONTRACTIONS)

    def concatenates_an_output(self, t: TensorAttr) -> bool:
        """Whether a concatenation's operand ``t`` is a graph output.

        iree-compile 3.13 put the permute of such an operand (a conv result stored
        channels-last, concatenated in NCHW order) into one dispatch writing both the graph
        output and the operand's slice of the concatenation, and left the second store
        outside the distributed loops ("'vector.store' op write affecting operations on
        global resources are restricted to workgroup distributed contexts"): fuzz seed
        48897765, minimized: x[2,1,1,5] -> conv (a graph output) -> concatenated with x ->
        relu. Without the output it compiled. The output is written anyway, so the
        concatenation reading a fenced copy costs one read
        (tests/test_fuzz_concatenated_outputs.py)."""
        return t.is_output and not t.is_scalar

    @staticmethod
    def swap_commutative(a: Val, b: Val) -> bool:
        """Whether a commutative binary op's operands go in the other order: always the same
        order, whichever the graph gave (the larger operand first, so ``x + bias`` stays as
        written; then by SSA name), so that IREE folds two nodes computing f(x, y) and
        f(y, x) into one value before it forms dispatches.

        Left apart, iree-compile 3.13 fused both into one dispatch and failed (fuzz seed 2
        of run K: t = x + y, then max(x, t) and max(t, x), both graph outputs of int32
        x, y [5,5]; add and mul alike, f32 too; "'linalg.generic' op write affecting
        operations on global resources are restricted to workgroup distributed contexts").
        The same node twice in one order compiled: IREE folds identical ops. The swap
        changes no result: these ops are exactly commutative
        (tests/test_fuzz_commutative_twins.py)."""
        def key(v: Val) -> tuple[int, str]:
            return (-math.prod(v.shape), v.name)

        return key(b) < key(a)

    def computed_from(self, t: TensorAttr, kinds: frozenset[OpKind]) -> bool:
        """Whether any node of ``kinds`` is among the nodes that ``t`` is computed from."""
        seen: set[str] = set()
        todo = [t]
        while todo:
            node = self.producer(todo.pop())
            if node is None or node.name in seen:
                continue
            if node.kind in kinds:
                return True
            seen.add(node.name)
            todo.extend(node.inputs.values())
        return False
