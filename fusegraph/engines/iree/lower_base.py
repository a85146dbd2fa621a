"""The pieces every lowering shares: an SSA builder, typed values that know their layout,
and the dtype rules (compute type, casts).

A value (:class:`Val`) carries the permutation of logical axes it is stored in, so an
NHWC boundary tensor or a channels-last convolution result travels through pointwise ops
without ever being transposed; a permute is emitted only where an op needs a particular
order (and is cached per tensor and order, so each is emitted once).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fusegraph.dtypes import DataType, promote
from fusegraph.engines.iree.fusion_guards import FusionGuards
from fusegraph.errors import UnsupportedError
from fusegraph.graph.node import Node
from fusegraph.graph.tensor import TensorAttr

if TYPE_CHECKING:
    from fusegraph.engines.iree.emit import EmitOptions
    from fusegraph.graph.graph import Graph

Perm = tuple[int, ...]
Shape = tuple[int, ...]

# torch's ScalarType codes, as torch.aten.to.dtype takes them.
TORCH_DTYPE: dict[DataType, int] = {
    DataType.UINT8: 0,
    DataType.INT8: 1,
    DataType.INT16: 2,
    DataType.INT32: 3,
    DataType.INT64: 4,
    DataType.HALF: 5,
    DataType.FLOAT: 6,
    DataType.DOUBLE: 7,
    DataType.BOOLEAN: 11,
    DataType.BFLOAT16: 15,
    DataType.FP8_E5M2: 23,
    DataType.FP8_E4M3: 24,
}

# Element types of builtin tensors (linalg side): integers are signless there.
_BUILTIN_ELEM: dict[DataType, str] = {
    DataType.INT8: "i8",
    DataType.UINT8: "i8",
    DataType.INT16: "i16",
    DataType.INT32: "i32",
    DataType.INT64: "i64",
}

NARROW_FLOATS = frozenset(
    {DataType.HALF, DataType.BFLOAT16, DataType.FP8_E4M3, DataType.FP8_E5M2}
)


def identity(rank: int) -> Perm:
    return tuple(range(rank))


def vtensor(shape: Sequence[int], dtype: DataType) -> str:
    """The torch value-tensor type of a shape and element type."""
    return f"!torch.vtensor<[{','.join(str(int(d)) for d in shape)}],{dtype.mlir}>"


def builtin_elem(dtype: DataType) -> str:
    return _BUILTIN_ELEM.get(dtype, dtype.mlir)


def tensor_type(shape: Sequence[int], dtype: DataType) -> str:
    """The builtin tensor type (what linalg ops take)."""
    dims = "".join(f"{int(d)}x" for d in shape)
    return f"tensor<{dims}{builtin_elem(dtype)}>"


def float_literal(value: float, dtype: DataType = DataType.DOUBLE) -> str:
    """An MLIR float literal; non-finite values as the bit pattern of ``dtype``."""
    if math.isfinite(value):
        return f"{value:.17e}"
    if dtype == DataType.FLOAT:
        return "0x" + struct.pack(">f", value).hex().upper()
    if dtype == DataType.HALF:
        return "0x" + struct.pack(">e", value).hex().upper()
    if dtype == DataType.BFLOAT16:
        return "0x" + struct.pack(">f", value).hex().upper()[:4]
    return "0x" + struct.pack(">d", value).hex().upper()


def scalar_literal(value: float, dtype: DataType) -> str:
    """An arith.constant literal of ``dtype``: integers (an int8 convolution's INT32
    accumulator, its zero padding) are written as integers."""
    if dtype.is_integer:
        return str(int(value))
    return float_literal(value, dtype)


@dataclass(frozen=True)
class Val:
    """An SSA value of torch type: its dims are the logical dims permuted by ``perm``.

    ``shape[i]`` is the extent of logical axis ``perm[i]``; broadcast (stride-0) axes of
    graph inputs have extent 1 here and are expanded only where an op needs them.
    """

    name: str
    shape: Shape
    dtype: DataType
    perm: Perm

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def type(self) -> str:
        return vtensor(self.shape, self.dtype)

    @property
    def logical_shape(self) -> Shape:
        return tuple(self.shape[self.perm.index(a)] for a in range(self.rank))


class Builder:
    """Writes the body of one function: fresh SSA names, cached constants, op lines."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._count = 0
        self._consts: dict[tuple[str, str], str] = {}

    def fresh(self, hint: str = "v") -> str:
        self._count += 1
        return f"%{hint}{self._count}"

    def line(self, text: str) -> None:
        self.lines.append(text)

    # ---- torch constants (emitted once per value) ----------------------------------
    def _const(self, kind: str, literal: str, hint: str) -> str:
        key = (kind, literal)
        if key not in self._consts:
            name = self.fresh(hint)
            self.line(f"{name} = torch.constant.{kind} {literal}")
            self._consts[key] = name
        return self._consts[key]

    def const_int(self, value: int) -> str:
        return self._const("int", str(int(value)), "int")

    def const_float(self, value: float) -> str:
        return self._const("float", float_literal(float(value)), "float")

    def const_bool(self, value: bool) -> str:
        return self._const("bool", "true" if value else "false", "bool")

    def const_none(self) -> str:
        key = ("none", "")
        if key not in self._consts:
            name = self.fresh("none")
            self.line(f"{name} = torch.constant.none")
            self._consts[key] = name
        return self._consts[key]

    def const_str(self, value: str) -> str:
        return self._const("str", f'"{value}"', "str")

    def int_list(self, values: Sequence[int]) -> str:
        key = ("list", ",".join(str(int(v)) for v in values))
        if key not in self._consts:
            items = [self.const_int(v) for v in values]
            name = self.fresh("list")
            types = ", ".join("!torch.int" for _ in items)
            self.line(
                f"{name} = torch.prim.ListConstruct {', '.join(items)} : ({types}) -> !torch.list<int>"
            )
            self._consts[key] = name
        return self._consts[key]

    # ---- ops ----------------------------------------------------------------------
    def op(
        self,
        name: str,
        operands: Sequence[tuple[str, str]],
        result_type: str,
        hint: str = "v",
    ) -> str:
        """``%r = <name> %a, %b : ta, tb -> tr`` (torch dialect generic-ish form)."""
        res = self.fresh(hint)
        args = ", ".join(v for v, _ in operands)
        types = ", ".join(t for _, t in operands)
        self.line(f"{res} = {name} {args} : {types} -> {result_type}")
        return res

    def aten(
        self,
        name: str,
        operands: Sequence[Val | tuple[str, str]],
        shape: Sequence[int],
        dtype: DataType,
        perm: Perm,
        hint: str = "v",
    ) -> Val:
        """A ``torch.aten.<name>`` op whose tensor operands are Vals, scalars (ssa, type)."""
        ops = [(o.name, o.type) if isinstance(o, Val) else o for o in operands]
        shp = tuple(int(d) for d in shape)
        res = self.op(f"torch.aten.{name}", ops, vtensor(shp, dtype), hint)
        return Val(res, shp, dtype, perm)

    def literal(self, value: float | int | bool, dtype: DataType) -> Val:
        """A 0-d tensor constant (broadcasts against anything)."""
        if dtype == DataType.BOOLEAN:
            text = "true" if value else "false"
        elif dtype.is_integer:
            text = str(int(value))
        else:
            text = float_literal(float(value), dtype)
        key = ("literal", f"{text}:{dtype.mlir}")
        if key not in self._consts:
            name = self.fresh("cst")
            self.line(
                f"{name} = torch.vtensor.literal(dense<{text}> : tensor<{builtin_elem(dtype)}>)"
                f" : {vtensor((), dtype)}"
            )
            self._consts[key] = name
        return Val(self._consts[key], (), dtype, ())


def _stands_in(have: Sequence[int], dims: Sequence[int]) -> bool:
    """Whether ``have`` is ``dims`` with some axes at a broadcast stand-in size of 1."""
    return len(have) == len(dims) and all(h in (1, d) for h, d in zip(have, dims, strict=True))


# ---- the lowering context ----------------------------------------------------------------
@dataclass
class Lowering(FusionGuards):
    """State of one emission: the graph, the options and each tensor's values by layout."""

    graph: Graph
    options: EmitOptions
    b: Builder = field(default_factory=Builder)
    values: dict[int, dict[Perm, Val]] = field(default_factory=dict)
    node: Node | None = None  # the node being lowered (for error messages)
    _producers: dict[str, Node] = field(default_factory=dict)  # node name -> node, filled lazily
    _read: set[int] | None = None  # ids of the tensors some node reads, filled lazily
    _readers: dict[int, list[Node]] | None = None  # tensor id -> the nodes reading it, filled lazily
    _expanded: dict[tuple[int, Perm], Val] = field(default_factory=dict)  # see get()
    _packed_sources: frozenset[int] | None = None  # see shares_a_packed_operand, filled lazily

    # ---- reading and writing tensors --------------------------------------------------
    def bind(self, t: TensorAttr, val: Val) -> None:
        self.values.setdefault(id(t), {})[val.perm] = val

    def get(self, t: TensorAttr, perm: Perm | None = None, *, full: bool = False) -> Val:
        """The value of ``t`` in order ``perm`` (any stored order when None).

        ``full`` expands broadcast (size-1 stand-in) axes of graph inputs to their dims.
        """
        if t.is_scalar:
            assert t.value is not None
            lit = self.b.literal(t.value, t.dtype)
            if perm is None and not full:
                return lit
            return self.broadcast(lit, t.shape, perm or identity(len(t.shape)))
        stored = self.values.get(id(t))
        if not stored:
            raise UnsupportedError(
                "tensor has no value yet (produced by an unsupported node?)",
                node=self.node.name if self.node else None,
                tensor=t.name,
            )
        if perm is None:
            val = next(iter(stored.values()))
        elif perm in stored:
            val = stored[perm]
        else:
            val = self.permute(next(iter(stored.values())), perm)
            stored[perm] = val
        if full and val.logical_shape != tuple(t.shape):
            if self._materialize_expansion(t):
                key = (id(t), val.perm)
                if key not in self._expanded:
                    self._expanded[key] = self.fence(self.broadcast(val, t.shape, val.perm))
                return self._expanded[key]
            val = self.broadcast(val, t.shape, val.perm)
        return val

    def set(self, t: TensorAttr, val: Val) -> None:
        """Binds a node result, cast to the tensor's declared data type (a virtual tensor
        computed in a wider float type stays wide when round_intermediates is off).

        A result computed from broadcast inputs may keep size-1 stand-ins for its broadcast
        axes, as graph inputs do: readers expand them where they need to (``full=True``).
        Expanding eagerly made IREE 3.13's data tiling crash on a matmul reading the
        expansion (e.g. sigmoid of an expanded input, then matmul)."""
        if val.logical_shape != tuple(t.shape) and not _stands_in(val.logical_shape, t.shape):
            val = self.broadcast(val, t.shape, val.perm)
        keep_wide = (
            not self.options.round_intermediates
            and t.is_virtual
            and not t.is_output
            and t.dtype.is_float
            and val.dtype.is_float
            and val.dtype.itemsize > t.dtype.itemsize
        )
        val = val if keep_wide else self.cast(val, t.dtype)
        if t.is_output and self.is_read(t):
            # A graph output that another node reads: IREE 3.13 fuses its producer into the
            # reader's dispatch and stores the output from there; where the reader is a
            # reduction-like root (softmax, a wgrad convolution...) the CPU code generation
            # leaves that store outside the distributed loops and fails ("'vector.store' op
            # write affecting operations on global resources are restricted to workgroup
            # distributed contexts"). The output is written anyway, so fencing it costs one
            # read: the producer's dispatch writes it, the readers read it.
            val = self.fence(val)
        elif self.shared_with_a_softmax(t):
            val = self.fence(val)
        self.bind(t, val)

    # ---- layout ---------------------------------------------------------------------
    def permute(self, val: Val, perm: Perm) -> Val:
        """``val`` reordered so that its axes are the logical axes ``perm``."""
        if val.perm == perm:
            return val
        if len(perm) != val.rank:
            raise ValueError(f"permutation {perm} does not fit rank {val.rank}")
        src = [val.perm.index(a) for a in perm]  # value axis feeding each new axis
        shape = tuple(val.shape[i] for i in src)
        moved = [i for i in src if val.shape[i] != 1]
        if moved == sorted(moved):  # only unit axes move: a reshape is enough
            return self.reshape(val, shape, perm)
        return self.b.aten(
            "permute", [val, (self.b.int_list(src), "!torch.list<int>")], shape, val.dtype, perm
        )

    def reshape(self, val: Val, shape: Sequence[int], perm: Perm | None = None) -> Val:
        shp = tuple(int(d) for d in shape)
        new_perm = perm if perm is not None else identity(len(shp))
        if shp == val.shape:
            return Val(val.name, shp, val.dtype, new_perm)
        return self.b.aten(
            "view", [val, (self.b.int_list(shp), "!torch.list<int>")], shp, val.dtype, new_perm
        )

    def logical(self, val: Val) -> Val:
        return self.permute(val, identity(val.rank))

    def to_rank(self, val: Val, rank: int) -> Val:
        """NumPy-style rank extension: new unit axes in front (logical order)."""
        k = rank - val.rank
        if k <= 0 or val.rank == 0:
            return val
        perm = identity(k) + tuple(p + k for p in val.perm)
        return self.reshape(val, (1,) * k + val.shape, perm)

    def align(self, val: Val, perm: Perm) -> Val:
        """Ready for a broadcasting op whose result is in order ``perm`` (0-d stays 0-d)."""
        if val.rank == 0:
            return val
        return self.permute(self.to_rank(val, len(perm)), perm)

    def broadcast(self, val: Val, logical_dims: Sequence[int], perm: Perm) -> Val:
        """Expands ``val`` to ``logical_dims`` (stored in order ``perm``)."""
        v = self.align(self.to_rank(val, len(logical_dims)), perm) if val.rank else val
        shape = tuple(int(logical_dims[a]) for a in perm)
        if v.rank == len(shape) and v.shape == shape:
            return v
        return self.b.aten(
            "broadcast_to", [v, (self.b.int_list(shape), "!torch.list<int>")], shape, v.dtype, perm
        )

    # ---- dtypes ---------------------------------------------------------------------
    def cast(self, val: Val, dtype: DataType) -> Val:
        if val.dtype == dtype:
            return val
        b = self.b
        return b.aten(
            "to.dtype",
            [
                val,
                (b.const_int(TORCH_DTYPE[dtype]), "!torch.int"),
                (b.const_bool(False), "!torch.bool"),
                (b.const_bool(False), "!torch.bool"),
                (b.const_none(), "!torch.none"),
            ],
            val.shape,
            dtype,
            val.perm,
            hint="cast",
        )

    def compute_type(self, node: Node, *dtypes: DataType) -> DataType:
        """Math type of a floating-point op: the node's, else the graph's, else f32 for
        half, bf16 and fp8 inputs (f64 inputs compute in f64)."""
        declared = getattr(node.attrs, "compute_data_type", None) or self.graph.compute_data_type
        base = dtypes[0]
        for d in dtypes[1:]:
            base = promote(base, d)
        if not base.is_float:
            return base
        if declared is not None and declared.is_float:
            return declared
        # f64 computes in f64 (the graph's precision; its tolerance is 1e-9). The few modes
        # IREE's CPU code generation has no f64 code for (sin, cos, tanh, erf: libm symbols it
        # cannot link) fall back to f32 unless f64 is declared (lower_pointwise.NO_F64).
        return DataType.FLOAT if base in NARROW_FLOATS else base

    # ---- builtin-tensor bridge (for ops written directly in linalg) --------------------
    def to_builtin(self, val: Val) -> str:
        res = self.b.fresh("t")
        self.b.line(
            f"{res} = torch_c.to_builtin_tensor {val.name} : {val.type} -> {tensor_type(val.shape, val.dtype)}"
        )
        return res

    def from_builtin(self, name: str, shape: Sequence[int], dtype: DataType, perm: Perm) -> Val:
        res = self.b.fresh("v")
        shp = tuple(int(d) for d in shape)
        self.b.line(
            f"{res} = torch_c.from_builtin_tensor {name} : {tensor_type(shp, dtype)} -> {vtensor(shp, dtype)}"
        )
        return Val(res, shp, dtype, perm)

    def pad_builtin(
        self,
        xb: str,
        shape: Sequence[int],
        dtype: DataType,
        low: Sequence[int],
        high: Sequence[int],
        fill: float,
    ) -> tuple[str, Shape]:
        """tensor.pad of a builtin tensor with a constant; returns (value, padded shape)."""
        padded = tuple(int(d) + lo + hi for d, lo, hi in zip(shape, low, high, strict=True))
        if not any(low) and not any(high):
            return xb, padded
        b = self.b
        elem = builtin_elem(dtype)
        value = b.fresh("padval")
        b.line(f"{value} = arith.constant {scalar_literal(fill, dtype)} : {elem}")
        res = b.fresh("pad")
        idx = ", ".join(f"{b.fresh('i')}: index" for _ in shape)
        b.line(f"{res} = tensor.pad {xb} low[{', '.join(map(str, low))}] high[{', '.join(map(str, high))}] {{")
        b.line(f"^bb0({idx}):")
        b.line(f"  tensor.yield {value} : {elem}")
        b.line(f"}} : {tensor_type(shape, dtype)} to {tensor_type(padded, dtype)}")
        return res, padded

    def filled(self, shape: Sequence[int], dtype: DataType, fill: float) -> str:
        """A builtin tensor of ``shape`` filled with a constant (a linalg accumulator)."""
        b = self.b
        empty, value, res = b.fresh("empty"), b.fresh("init"), b.fresh("acc")
        ty = tensor_type(shape, dtype)
        elem = builtin_elem(dtype)
        b.line(f"{empty} = tensor.empty() : {ty}")
        b.line(f"{value} = arith.constant {scalar_literal(fill, dtype)} : {elem}")
        b.line(f"{res} = linalg.fill ins({value} : {elem}) outs({empty} : {ty}) -> {ty}")
        return res

    def fence(self, val: Val) -> Val:
        """``val`` behind IREE's dispatch-region marker (``compute_barrier.start``): what
        produced it cannot be fused with what reads it. Free at run time (the marker is
        dropped once dispatches are formed); the price is the fusion it stops. Used where
        IREE 3.13 miscompiles a fusion (see each caller)."""
        if val.rank == 0:
            return val
        vb = self.to_builtin(val)
        fenced = self.b.fresh("t")
        ty = tensor_type(val.shape, val.dtype)
        if math.prod(val.shape) == 1:
            # A one-element value: the marker's dispatch region can hold a one-element slice
            # and a view adding unit axes to it (slice x[6:7] of [7], reshaped to [1,1,1]),
            # and IREE 3.13's BubbleUpExpandShapesPass folds them into a rank-expanding
            # tensor.extract_slice, which the verifier rejects ("expected rank to be smaller
            # or equal to the other rank"; fuzz seed 1018). util.optimization_barrier keeps
            # the fence without forming that region; one more submission, for one element.
            self.b.line(f"{fenced} = util.optimization_barrier {vb} : {ty}")
            return self.from_builtin(fenced, val.shape, val.dtype, val.perm)
        self.b.line(f"{fenced} = iree_tensor_ext.compute_barrier.start {vb} : {ty} -> {ty}")
        return self.from_builtin(fenced, val.shape, val.dtype, val.perm)

    def fail(self, why: str) -> UnsupportedError:
        return UnsupportedError(why, node=self.node.name if self.node else None)
