"""Graph: the IR users build (cuDNN Python frontend style), and its validation.

Ops are added through the builder methods (graph/builder.py, graph/builder_pointwise.py,
graph/builder_backward.py, graph/builder_gather.py)
that return their output TensorAttr(s); ``validate()`` infers every dim, stride and dtype
that was left unset and checks the whole graph. The validated graph is the descriptor every engine reads. The plan
methods (``build``, ``execute``...) come from graph/seam.py, which forwards them to the
selection layer without importing it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fusegraph.dtypes import DataType, as_data_type
from fusegraph.errors import ValidationError
from fusegraph.graph import layout
from fusegraph.graph.builder import GraphBuilder
from fusegraph.graph.builder_backward import BackwardBuilder
from fusegraph.graph.builder_gather import GatherBuilder
from fusegraph.graph.builder_pointwise import PointwiseBuilder
from fusegraph.graph.infer import INFER, INHERIT_LAYOUT, LAYOUT_SOURCE
from fusegraph.graph.node import Node
from fusegraph.graph.ops import OPS, OpAttrs, OpKind
from fusegraph.graph.seam import PlanMethods
from fusegraph.graph.tensor import Scalar, TensorAttr, _ints

log = logging.getLogger("fusegraph.graph")

Ints = Sequence[int]

# Output ports whose inferred type is the op's own, never the graph's I/O or intermediate
# type: attention's log-sum-exp statistics in f16/bf16 would cost the backward its accuracy
# (cuDNN keeps them FLOAT).
OWN_TYPE_PORTS = {OpKind.SDPA: "stats"}


class Graph(GraphBuilder, BackwardBuilder, GatherBuilder, PointwiseBuilder, PlanMethods):
    """A graph of tensor operations; see the README for a walk-through."""

    def __init__(
        self,
        name: str | None = None,
        io_data_type: Any = None,
        intermediate_data_type: Any = None,
        compute_data_type: Any = None,
    ) -> None:
        self.name = name or "graph"
        self.io_data_type = as_data_type(io_data_type) if io_data_type is not None else None
        self.intermediate_data_type = (
            as_data_type(intermediate_data_type) if intermediate_data_type is not None else None
        )
        self.compute_data_type = (
            as_data_type(compute_data_type) if compute_data_type is not None else None
        )
        self.tensors: list[TensorAttr] = []
        self._by_name: dict[str, TensorAttr] = {}  # a lookup cache, checked on every hit
        self.nodes: list[Node] = []
        self._counters: dict[str, int] = {}
        # Taken tensor and node names with their counts, kept as tensors and nodes are added or
        # renamed so _unique is O(1) (a set rebuilt per call made building quadratic). Callers
        # may edit ``tensors``/``nodes`` directly (passes prune them), so the counts are trusted
        # only while the lists are the ones, of the lengths, they were last synced with.
        self._names: dict[str, int] | None = None
        self._names_sync: tuple[int, int, int, int] = (0, 0, 0, 0)
        self._validated = False
        self._key: str | None = None
        # The topological order of the validated graph: a plan build of each region piece
        # asks for it several times (the fusion planners, the graph function), and every walk
        # allocates dicts and lists in what is, while a session opens, a big heap. Kept only
        # while validated and while ``nodes`` is the list, of the length, it was walked from.
        self._order: tuple[Node, ...] | None = None
        self._order_sync: tuple[int, int] = (0, 0)
        # Engines keep built plans here, keyed by (engine, handle); cleared on any change.
        self.plans: dict[Any, Any] = {}
        # What engines derive from the validated graph alone (the torch engine's knobs per
        # handle), keyed by (engine, what, ...); cleared on any change, as ``plans`` is.
        self.derived: dict[Any, Any] = {}
        self._selection: Any = None

    # ---- tensors ------------------------------------------------------------------------
    def tensor(
        self,
        name: str,
        dim: Ints,
        stride: Ints | None = None,
        data_type: Any = None,
    ) -> TensorAttr:
        """A graph input (or, with ``set_output``, a tensor the caller owns)."""
        if not isinstance(name, str) or not name:
            raise ValidationError(f"tensor names must be non-empty strings, got {name!r}")
        dims = _ints(dim, name, "dims")
        if stride is None:
            stride = layout.packed_strides(dims)
        if data_type is None:
            data_type = self.io_data_type
        return self._add_tensor(TensorAttr(self, name, dims, stride, data_type))

    def tensor_like(self, array: Any, name: str | None = None) -> TensorAttr:
        """A graph input with the dims, element strides and dtype of an array."""
        arr = np.asarray(array) if not hasattr(array, "__array_interface__") else array
        arr = np.asarray(arr)
        dt = as_data_type(arr.dtype)
        strides = layout.element_strides(arr.shape, arr.strides, arr.itemsize)
        if strides is None:
            raise ValidationError("array strides are not whole elements", tensor=name)
        return self.tensor(name or self._unique("tensor"), arr.shape, strides, dt)

    def scalar(self, value: Scalar, data_type: Any = None) -> TensorAttr:
        """A constant inlined into the graph (cuDNN's pass-by-value scalar)."""
        if data_type is None:
            data_type = (
                DataType.BOOLEAN
                if isinstance(value, bool | np.bool_)
                else DataType.INT64
                if isinstance(value, int | np.integer)
                else DataType.FLOAT
            )
        dt = as_data_type(data_type)
        name = self._unique("scalar")
        try:
            py: Scalar = bool(value) if dt == DataType.BOOLEAN else int(value) if dt.is_integer else float(value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValidationError(f"scalar {value!r} is not a {dt.name} value: {exc}", tensor=name) from None
        t = TensorAttr(self, name, (1,), (1,), dt, value=py)
        check_scalar_value(t)
        return self._add_tensor(t)

    def _add_tensor(self, t: TensorAttr) -> TensorAttr:
        self.tensors.append(t)
        self._names_added((t.name,), tensors=1)
        self._touch()
        return t

    def _lists_fingerprint(self) -> tuple[int, int, int, int]:
        return (id(self.tensors), len(self.tensors), id(self.nodes), len(self.nodes))

    def _taken_names(self) -> dict[str, int]:
        if self._names is None or self._names_sync != self._lists_fingerprint():
            names: dict[str, int] = {}
            for t in self.tensors:
                names[t.name] = names.get(t.name, 0) + 1
            for n in self.nodes:
                names[n.name] = names.get(n.name, 0) + 1
            self._names = names
            self._names_sync = self._lists_fingerprint()
        return self._names

    def _names_added(self, names: Sequence[str], *, tensors: int = 0, nodes: int = 0) -> None:
        """Count names just appended (``tensors`` to the tensor list, ``nodes`` to the node
        list); if the lists were edited behind our back the counts are dropped, rebuilt on use."""
        t_id, t_len, n_id, n_len = self._names_sync
        if self._names is None or (t_id, t_len + tensors, n_id, n_len + nodes) != self._lists_fingerprint():
            self._names = None
            return
        for name in names:
            self._names[name] = self._names.get(name, 0) + 1
        self._names_sync = self._lists_fingerprint()

    def _renamed(self, old: str, new: str) -> None:
        """A tensor of this graph changed its name (TensorAttr.set_name)."""
        if self._names is None or self._names_sync != self._lists_fingerprint():
            self._names = None
            return
        left = self._names.get(old, 0) - 1
        if left > 0:
            self._names[old] = left
        else:
            self._names.pop(old, None)
        self._names[new] = self._names.get(new, 0) + 1

    def _unique(self, base: str) -> str:
        taken = self._taken_names()
        while True:
            i = self._counters.get(base, 0)
            self._counters[base] = i + 1
            name = f"{base}_{i}"
            if name not in taken:
                return name

    def _touch(self) -> None:
        self._validated = False
        self._key = None
        self._order = None
        if self.plans:
            self.plans.clear()
        if self.derived:
            self.derived.clear()
        self._selection = None

    # ---- generic node construction -------------------------------------------------------
    def _check_operand(self, t: Any, port: str, op: str) -> TensorAttr:
        if not isinstance(t, TensorAttr):
            raise ValidationError(
                f"input '{port}' must be a TensorAttr of this graph, got {type(t).__name__}", node=op
            )
        if not t.belongs_to(self):
            raise ValidationError(f"input '{port}' belongs to another graph", node=op, tensor=t.name)
        return t

    def _add_node(
        self,
        kind: OpKind,
        attrs: OpAttrs,
        inputs: Mapping[str, TensorAttr | None],
        name: str | None,
        outputs: Sequence[str] | None = None,
    ) -> Node:
        node_name = name or self._unique(kind.value)
        ins = {p: self._check_operand(t, p, node_name) for p, t in inputs.items() if t is not None}
        spec = OPS[kind]
        outs: dict[str, TensorAttr] = {}
        for port in outputs if outputs is not None else spec.outputs:
            t = TensorAttr(self, f"{node_name}::{port}", is_virtual=True)
            t.producer = node_name
            outs[port] = t
            self.tensors.append(t)
        node = Node(node_name, kind, attrs, ins, outs)
        self.nodes.append(node)
        self._names_added([node_name, *(t.name for t in outs.values())], tensors=len(outs), nodes=1)
        self._touch()
        self._try_infer(node)
        return node

    def _try_infer(self, node: Node) -> None:
        """Fill output dims/dtypes right away when inputs are known (validate() re-checks)."""
        known = all(t._dim is not None and t._data_type is not None for t in node.inputs.values())
        if not known:
            return
        try:
            proposal = INFER[node.kind](node)
        except ValidationError:
            return  # reported by validate(), where the whole graph is in view
        except (ValueError, KeyError, IndexError, TypeError):
            return
        for port, (dims, dt) in proposal.items():
            t = node.outputs[port]
            if not t.dim_set:
                t._infer(dim=dims)
            if not t.dtype_set:
                t._infer(data_type=self._default_dtype(t, dt, node))

    def _default_dtype(self, t: TensorAttr, proposed: DataType, node: Node | None = None) -> DataType:
        own = node is not None and node.outputs.get(OWN_TYPE_PORTS.get(node.kind, "")) is t
        if not proposed.is_float or own:
            return proposed
        chosen = self.intermediate_data_type if t.is_virtual else self.io_data_type
        return chosen or proposed

    def _compute_default(self, compute_data_type: Any) -> DataType | None:
        return as_data_type(compute_data_type) if compute_data_type is not None else None

    # ---- validation ---------------------------------------------------------------------------
    def validate(self) -> Graph:
        """Infers what was left unset and checks the whole graph; raises ValidationError."""
        self._check_names()
        order = self._walk_order()  # always walked afresh: validating is what vouches for the cache
        produced = {t.name for n in self.nodes for t in n.outputs.values()}
        used: set[int] = set()
        for n in self.nodes:
            for t in n.inputs.values():
                used.add(id(t))
                if t.is_virtual and t.name not in produced:
                    raise ValidationError(
                        "virtual tensor is used but no node produces it", node=n.name, tensor=t.name
                    )
                if not t.is_virtual and t.producer is None:
                    self._check_tensor(t, is_input=True)
        for n in order:
            for t in n.inputs.values():
                if t._dim is None or t._data_type is None:
                    raise ValidationError(
                        "dims or data type unknown (set them, or check the producing node)",
                        node=n.name,
                        tensor=t.name,
                    )
            proposal = INFER[n.kind](n)
            for port, (dims, dt) in proposal.items():
                self._settle_output(n, n.outputs[port], dims, dt)
        outputs = [t for t in self.tensors if t.is_output]
        if not outputs:
            raise ValidationError(
                f"graph '{self.name}' has no output: mark at least one tensor with .set_output(True)"
            )
        for t in outputs:
            if t.producer is None:
                raise ValidationError("output is not produced by any node", tensor=t.name)
        for t in self.tensors:
            if t.producer is None and not t.is_scalar and id(t) not in used:
                log.debug("tensor '%s' is declared but never used", t.name)
        self._validated = True
        self._keep_order(order)
        return self

    def _settle_output(self, node: Node, t: TensorAttr, dims: tuple[int, ...], dt: DataType) -> None:
        if t.dim_set and t._dim != tuple(dims):
            raise ValidationError(
                f"dims were set to {t.dim} but the op produces {list(dims)}", node=node.name, tensor=t.name
            )
        t._infer(dim=dims)
        if not t.dtype_set:
            t._infer(data_type=self._default_dtype(t, dt, node))
        if not t.stride_set:
            t._infer(stride=self._output_strides(node, t, dims))
        self._check_tensor(t, is_input=False)

    def _output_strides(self, node: Node, t: TensorAttr, dims: tuple[int, ...]) -> tuple[int, ...]:
        """Strides of an output the user left unset. A pointwise output of its input's dims
        takes that input's strides as they are, gaps included (cuDNN frontend's rule: a
        rotary embedding of a slice of a packed QKV tensor writes into the same slice of
        another); other outputs are packed, in their source's memory order where the op
        keeps layouts (INHERIT_LAYOUT), else row-major."""
        sources = list(node.inputs.values())
        port = next((p for p, o in node.outputs.items() if o is t), "")
        if node.kind in LAYOUT_SOURCE and port in LAYOUT_SOURCE[node.kind]:
            sources = [node.inputs[LAYOUT_SOURCE[node.kind][port]]]
        elif node.kind not in INHERIT_LAYOUT:
            return layout.packed_strides(dims)
        if node.kind == OpKind.POINTWISE:
            for src in sources:
                if src.is_scalar or src._dim != tuple(dims) or layout.is_packed(src.dim, src.stride):
                    continue
                if not layout.self_overlapping(src.dim, src.stride):
                    return tuple(src.stride)  # a strided view: the output is one alike
        for src in sources:
            if len(src.dim) == len(dims) and not src.is_scalar and all(s > 0 for s in src.stride):
                return layout.packed_strides(dims, layout.stride_order(src.dim, src.stride))
        return layout.packed_strides(dims)

    def _check_tensor(self, t: TensorAttr, *, is_input: bool) -> None:
        # The tuples themselves, not the lists ``dim``/``stride`` copy them into: validation
        # checks every tensor of every region piece when a session opens (lists in the messages).
        dims, strides = t._dim or (), t._stride or ()
        if not dims:
            raise ValidationError("tensor has no dims", tensor=t.name)
        if min(dims) < 1:
            raise ValidationError(f"dims must be >= 1, got {list(dims)}", tensor=t.name)
        if t._data_type is None:
            raise ValidationError(
                "data type unknown: pass data_type= or set the graph's io_data_type", tensor=t.name
            )
        if len(strides) != len(dims):
            raise ValidationError(f"{len(strides)} strides for {len(dims)} dims", tensor=t.name)
        if min(strides) < 0:
            raise ValidationError(f"negative stride in {list(strides)}", tensor=t.name)
        _check_size(t, dims, strides)
        if t.value is not None:
            check_scalar_value(t)
        if is_input:
            # cuDNN reads inputs through their strides: a broadcast (0) or overlapping view
            # (a sliding window) reads memory more than once, which is valid for a read.
            return
        if 0 in strides and any(s == 0 and d > 1 for s, d in zip(strides, dims, strict=True)):
            what = "output" if t.is_output else "intermediate tensor"
            raise ValidationError(
                f"{what} has a broadcast (zero) stride {list(strides)}; only graph inputs may", tensor=t.name
            )
        pair = layout.overlapping_axes(dims, strides)
        if pair is not None:
            what = "output" if t.is_output else "intermediate tensor"
            raise ValidationError(
                f"{what} strides {list(strides)} overlap: axes {pair[0]} and {pair[1]} interleave or address "
                "the same memory (each axis must step over the whole extent of the axes inside it; only "
                "graph inputs may read memory twice)",
                tensor=t.name,
            )

    def _check_names(self) -> None:
        # Nodes first: a repeated node name also repeats its outputs' names.
        node_names: set[str] = set()
        for n in self.nodes:
            if n.name in node_names:
                raise ValidationError("duplicate node name", node=n.name)
            node_names.add(n.name)
        seen: set[str] = set()
        for t in self.tensors:
            if t.name in seen:
                raise ValidationError("duplicate tensor name", tensor=t.name)
            seen.add(t.name)

    def topological_order(self) -> list[Node]:
        """Nodes ordered so producers come first; raises ValidationError on a cycle. A new
        list on every call (callers keep and edit theirs), walked once per validation."""
        if self._order is not None and self._order_sync == (id(self.nodes), len(self.nodes)):
            return list(self._order)
        order = self._walk_order()
        if self._validated:
            self._keep_order(order)
        return order

    def _keep_order(self, order: list[Node]) -> None:
        self._order = tuple(order)
        self._order_sync = (id(self.nodes), len(self.nodes))

    def _walk_order(self) -> list[Node]:
        """Depth-first, roots in declaration order and each node's producers in port order,
        a node placed once its producers are (the order every engine's plans were built on)."""
        producer = {id(t): n for n in self.nodes for t in n.outputs.values()}

        def deps(node: Node) -> Iterator[Node]:
            for t in node.inputs.values():
                p = producer.get(id(t))
                if p is not None:
                    yield p

        state: dict[int, int] = {}  # 1 = on the stack, 2 = done
        order: list[Node] = []
        for root in self.nodes:
            if id(root) in state:
                continue
            state[id(root)] = 1
            stack: list[tuple[Node, Iterator[Node]]] = [(root, deps(root))]
            while stack:
                node, pending = stack[-1]
                for dep in pending:
                    s = state.get(id(dep))
                    if s == 1:
                        raise ValidationError("cycle: the node depends on its own output", node=dep.name)
                    if s is None:
                        state[id(dep)] = 1
                        stack.append((dep, deps(dep)))
                        break
                else:
                    stack.pop()
                    state[id(node)] = 2
                    order.append(node)
        return order

    # ---- views used by engines ---------------------------------------------------------------
    @property
    def is_validated(self) -> bool:
        return self._validated

    def ensure_valid(self) -> Graph:
        if not self._validated:
            self.validate()
        return self

    def inputs(self) -> list[TensorAttr]:
        """Non-virtual, non-scalar tensors read by some node, in declaration order."""
        read = {id(t) for n in self.nodes for t in n.inputs.values()}
        return [t for t in self.tensors if t.producer is None and not t.is_scalar and id(t) in read]

    def outputs(self) -> list[TensorAttr]:
        return [t for t in self.tensors if t.is_output]

    def tensor_by_name(self, name: str) -> TensorAttr:
        """O(1) on a hit (engines resolve every pack key through here on every call); tensors
        may be added or renamed at any time, so a miss or a stale entry rebuilds the index."""
        t = self._by_name.get(name)
        if t is not None and t.name == name:
            return t
        index: dict[str, TensorAttr] = {}
        for t in self.tensors:
            index.setdefault(t.name, t)  # the first of duplicates, as a linear search finds
        self._by_name = index
        try:
            return index[name]
        except KeyError:
            raise KeyError(name) from None

    def node_by_name(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    # ---- serialization -----------------------------------------------------------------------
    def to_json(self, indent: int | None = None) -> str:
        from fusegraph.graph.serialize import graph_to_json

        return graph_to_json(self, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Graph:
        from fusegraph.graph.serialize import graph_from_json

        return graph_from_json(text)

    def validated_state(self) -> ValidatedState:
        """What ``validate`` inferred (every tensor's dims, strides and type) and the content
        key, for another graph of the same contents to adopt (``adopt_validated``): kept here,
        beside ``validate``, so the two change together."""
        self.ensure_valid()
        return ValidatedState(tuple((t._dim, t._stride, t._data_type) for t in self.tensors), self.key())

    def adopt_validated(self, state: ValidatedState) -> Graph:
        """This graph as ``validate`` would leave it, from the state of a graph of the same
        contents (a model's repeated layers cut the same region again and again:
        regions/subgraph.py). Validating is a function of the contents alone; the caller
        vouches that they are the same."""
        if len(state.tensors) != len(self.tensors):
            raise ValueError(f"graph '{self.name}': {len(self.tensors)} tensors, the state has {len(state.tensors)}")
        for t, (dim, stride, dt) in zip(self.tensors, state.tensors, strict=True):
            t._infer(dim=dim, stride=stride, data_type=dt)
        self._validated = True
        self._key = state.key
        return self

    def key(self) -> str:
        """Stable content hash of the validated graph (hex sha256)."""
        if self._key is None:
            from fusegraph.graph.serialize import graph_key

            self.ensure_valid()
            self._key = graph_key(self)
        return self._key

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, {len(self.nodes)} nodes, {len(self.tensors)} tensors)"


@dataclass(frozen=True)
class ValidatedState:
    """``Graph.validated_state``: each tensor's (dims, strides, data type) in declaration
    order, and the content key."""

    tensors: tuple[tuple[Any, Any, Any], ...]
    key: str


_INT64_MAX = 2**63 - 1


def _check_size(t: TensorAttr, dims: Sequence[int], strides: Sequence[int]) -> None:
    """Element count and byte span must fit in int64: every engine indexes with it, and a
    tensor past that (dims of 2**40 x 2**40, a stride of 2**62) addresses no real memory."""
    count = math.prod(dims)
    if count > _INT64_MAX:
        raise ValidationError(
            f"dims {list(dims)} hold {count} elements, more than int64 can index (2**63 - 1)",
            tensor=t.name,
        )
    span = layout.extent(dims, strides) * t.dtype.itemsize
    if span > _INT64_MAX:
        raise ValidationError(
            f"dims {list(dims)} with strides {list(strides)} span {span} bytes, more than int64 can "
            "address (2**63 - 1)",
            tensor=t.name,
        )


def check_scalar_value(t: TensorAttr) -> None:
    """A constant must be a value of its type: NaN poisons every result it touches (inf is
    valid: masks use it), and an integer must fit its type (2**70 is no INT64)."""
    v, dt = t.value, t.dtype
    if dt.is_integer and not isinstance(v, bool):
        info = np.iinfo(dt.numpy)
        if not isinstance(v, int) or not info.min <= v <= info.max:
            raise ValidationError(
                f"scalar {v!r} does not fit {dt.name} ({dt.numpy}: {info.min} .. {info.max})",
                tensor=t.name,
            )
    elif dt.is_float and isinstance(v, float) and math.isnan(v):
        raise ValidationError("scalar constant is NaN; a NaN constant makes every result it touches NaN", tensor=t.name)
