"""ONNX nodes -> fusegraph Graph ops: one lowering function per ONNX op type.

An :class:`Importer` builds one fusegraph Graph from a set of ONNX nodes (a claimed
partition, or a single node when the partitioner asks "can we run this?"). Each lowering
either emits graph ops or raises :class:`Unmappable` with a precise reason (op type,
attribute and value), which the partition report shows. Constants become graph inputs
whose arrays are packed once, here, into the layout the engine wants (conv filters as
``FILTER_LAYOUTS`` says for the engine, activations channels-last inside partitions that
hold convolutions or pooling).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper

from fusegraph.dtypes import DataType
from fusegraph.errors import FusegraphError
from fusegraph.graph import layout
from fusegraph.graph.graph import Graph
from fusegraph.graph.ops import PointwiseMode, PoolingMode, ReductionMode
from fusegraph.graph.tensor import TensorAttr
from fusegraph.onnx.model import OnnxGraph, ONode

M = PointwiseMode


class Unmappable(Exception):
    """This node cannot become fusegraph ops; ``reason`` says exactly why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


_ELEM_TO_DT: dict[int, DataType] = {
    onnx.TensorProto.FLOAT: DataType.FLOAT,
    onnx.TensorProto.FLOAT16: DataType.HALF,
    onnx.TensorProto.BFLOAT16: DataType.BFLOAT16,
    onnx.TensorProto.DOUBLE: DataType.DOUBLE,
    onnx.TensorProto.INT8: DataType.INT8,
    onnx.TensorProto.UINT8: DataType.UINT8,
    onnx.TensorProto.INT16: DataType.INT16,
    onnx.TensorProto.INT32: DataType.INT32,
    onnx.TensorProto.INT64: DataType.INT64,
    onnx.TensorProto.BOOL: DataType.BOOLEAN,
}

# Memory order of channels-last activations and filters, by rank.
CHANNELS_LAST = {3: "NHC", 4: "NHWC", 5: "NDHWC"}
SPATIAL_OPS = frozenset({"Conv", "ConvTranspose", "MaxPool", "AveragePool", "LRN"})


def data_type_of(elem: int, what: str) -> DataType:
    dt = _ELEM_TO_DT.get(elem)
    if dt is None:
        name = onnx.TensorProto.DataType.Name(elem) if elem else "unknown"
        raise Unmappable(f"{what} has element type {name}, which fusegraph does not run")
    return dt


def channels_last_strides(dims: Sequence[int]) -> tuple[int, ...]:
    return layout.strides_for(dims, CHANNELS_LAST[len(dims)])


# How each engine wants conv filters ([K, C, spatial...] logical) laid out in memory, so that
# no engine re-lays them out on every call. Measured on light ResNet-50 (CPU, batch 1):
# the torch engine runs 38.8 ms with KRSC filters, 44.7 ms with KCRS and 146 ms with HWCF;
# the IREE engine reads HWCF (its channels-last named convolutions; any other order is a
# transpose per call). Engines not listed get KRSC.
FILTER_LAYOUTS: dict[str, str] = {"iree": "HWCF", "torch": "KRSC", "reference": "KRSC"}
DEFAULT_FILTER_LAYOUT = "KRSC"


# Constant 2-D matmul operands (a Gemm's or MatMul's B, [K, N] logical) follow the same
# per-engine choice: the torch engine's oneDNN linear reads B as [N, K] rows (light AlexNet's
# 9216x4096 FC: 4.0 ms against 5.4 ms through F.linear and 6.7 ms through mm on [K, N]),
# so with its filter layout B is stored column-major; IREE keeps row-major.
MATRIX_COLUMN_MAJOR = frozenset({"KRSC"})


def filter_layout_for(engine: str | None) -> str:
    return FILTER_LAYOUTS.get(engine or "", DEFAULT_FILTER_LAYOUT)


def filter_strides(dims: Sequence[int], filter_layout: str = "HWCF") -> tuple[int, ...]:
    """Strides of a [K, C, spatial...] filter stored as ``filter_layout`` says: "HWCF"
    (spatial-major, then C, then K), "KRSC" (K, spatial, C) or "KCRS" (row-major)."""
    rank = len(dims)
    orders = {
        "HWCF": (*range(2, rank), 1, 0),
        "KRSC": (0, *range(2, rank), 1),
        "KCRS": tuple(range(rank)),
    }
    return layout.packed_strides(dims, orders[filter_layout])


def with_strides(arr: np.ndarray, strides: Sequence[int]) -> np.ndarray:
    """``arr`` (logical dims) viewed over a buffer laid out as ``strides`` order it; copies
    only when the memory order differs."""
    want = tuple(strides)
    have = layout.element_strides(arr.shape, arr.strides, arr.itemsize)
    if have is not None and layout.same_strides(arr.shape, have, want):
        return arr
    order = layout.physical_order(arr.shape, want)
    phys = np.ascontiguousarray(arr.transpose(order))
    return phys.transpose(tuple(order.index(a) for a in range(arr.ndim)))


_NAME_OK = re.compile(r"[^A-Za-z0-9_]")


class Importer:
    """Builds one fusegraph Graph from ONNX nodes of one specialized model."""

    def __init__(
        self,
        og: OnnxGraph,
        name: str,
        *,
        channels_last: bool,
        filter_layout: str = DEFAULT_FILTER_LAYOUT,
        pack: bool = True,
    ) -> None:
        self.og = og
        self.g = Graph(_NAME_OK.sub("_", name))
        self.channels_last = channels_last
        self.filter_layout = filter_layout
        self.pack = pack  # False: only the graph is wanted (weights stay unpacked, not runnable)
        self.values: dict[str, TensorAttr] = {}  # ONNX value -> tensor holding it
        self.inputs: dict[str, TensorAttr] = {}  # ONNX activation -> graph input
        self.weights: dict[str, np.ndarray] = {}  # graph tensor name -> bound array (declared strides)
        self._names: set[str] = set()
        self.node: ONode | None = None

    # ---- naming -----------------------------------------------------------------------------
    def _unique(self, base: str) -> str:
        name = _NAME_OK.sub("_", base) or "t"
        if name[0].isdigit():
            name = "t" + name
        cand, k = name, 0
        while cand in self._names:
            k += 1
            cand = f"{name}_{k}"
        self._names.add(cand)
        return cand

    # ---- operands ---------------------------------------------------------------------------
    def is_const(self, name: str) -> bool:
        return bool(name) and name in self.og.constants

    def const(self, name: str, what: str) -> np.ndarray:
        if not name or name not in self.og.constants:
            raise Unmappable(f"{self.op}: {what} ('{name}') is not a constant")
        return self.og.constants[name]

    @property
    def op(self) -> str:
        return self.node.op_type if self.node is not None else "?"

    def tensor(self, name: str, role: str = "act") -> TensorAttr:
        """The tensor holding ONNX value ``name``; constants and outside values become inputs.

        ``role`` picks the layout of a new input: "act" (channels-last when the partition
        is), "filter" (the engine's filter layout), "matrix" (a matmul's B: column-major for
        the engines in MATRIX_COLUMN_MAJOR) or "plain" (row-major).
        """
        if name in self.values:
            return self.values[name]
        if name in self.og.constants:
            t = self.constant(self.og.constants[name], name, role)
        else:
            info = self.og.types.get(name)
            if info is None or info.shape is None:
                raise Unmappable(f"{self.op}: the shape of input '{name}' is unknown after shape inference")
            dt = data_type_of(info.elem, f"input '{name}'")
            dims = info.shape
            if not dims or 0 in dims:
                raise Unmappable(f"{self.op}: input '{name}' has dims {list(dims)} (rank-0 or empty tensors stay on ONNX Runtime)")
            # Activations entering a channels-last partition are NHWC whoever reads them first.
            if role == "plain" and len(dims) in (4, 5) and not __import__("os").environ.get("FG_NCHW_IN"):
                role = "act"
            t = self.g.tensor(self._unique(name), dims, self._strides(dims, role), dt)
            self.inputs[name] = t
        self.values[name] = t
        return t

    def _strides(self, dims: Sequence[int], role: str) -> tuple[int, ...]:
        if role == "matrix" and len(dims) == 2 and self.filter_layout in MATRIX_COLUMN_MAJOR:
            return (1, dims[0])
        if self.channels_last and len(dims) in CHANNELS_LAST:
            if role == "filter":
                return filter_strides(dims, self.filter_layout)
            if role == "act":
                return channels_last_strides(dims)
        return layout.packed_strides(dims)

    def constant(self, arr: np.ndarray, hint: str, role: str = "act") -> TensorAttr:
        """A new graph input bound once to ``arr``, packed for the engine."""
        arr = np.asarray(arr)
        dt = data_type_of(int(helper.np_dtype_to_tensor_dtype(arr.dtype)), f"constant '{hint}'")
        if arr.ndim == 0:
            arr = arr.reshape(1)
        if 0 in arr.shape:
            raise Unmappable(f"{self.op}: constant '{hint}' is empty {list(arr.shape)}")
        strides = self._strides(arr.shape, role)
        t = self.g.tensor(self._unique(hint), arr.shape, strides, dt)
        if not self.pack:
            self.weights[t.name] = arr
            return t
        packed = with_strides(arr, strides)
        if not packed.flags.writeable:  # engines may alias host inputs, which needs writable memory
            packed = with_strides(np.array(arr, copy=True), strides)
        self.weights[t.name] = packed
        return t

    def scalar(self, value: float, dt: DataType) -> TensorAttr:
        return self.g.scalar(value, dt)

    def operand(self, name: str, out_rank: int) -> TensorAttr:
        """An elementwise operand: a one-element constant that does not raise the result's
        rank is inlined as a scalar, anything else is a tensor."""
        if self.is_const(name):
            arr = self.og.constants[name]
            if arr.size == 1 and arr.ndim <= out_rank:
                dt = data_type_of(int(helper.np_dtype_to_tensor_dtype(arr.dtype)), f"constant '{name}'")
                v = arr.reshape(-1)[0]
                return self.g.scalar(bool(v) if dt == DataType.BOOLEAN else v.item(), dt)
        return self.tensor(name)

    def set(self, name: str, t: TensorAttr) -> None:
        if name:
            self.values[name] = t

    def shape(self, name: str) -> tuple[int, ...]:
        s = self.og.shape(name)
        if s is None:
            raise Unmappable(f"{self.op}: the shape of '{name}' is unknown after shape inference")
        return s

    def dtype(self, name: str) -> DataType:
        return data_type_of(self.og.elem(name), f"value '{name}'")

    # ---- driving ------------------------------------------------------------------------------
    def lower(self, node: ONode) -> None:
        self.node = node
        if not node.is_default_domain:
            raise Unmappable(f"{node.op_type}: domain '{node.domain}' is not the default ONNX domain")
        fn = LOWER.get(node.op_type)
        if fn is None:
            raise Unmappable(f"{node.op_type}: no fusegraph lowering for this op type")
        try:
            fn(self, node)
        except Unmappable:
            raise
        except FusegraphError as exc:
            raise Unmappable(f"{node.op_type}: {exc}") from None
        self.node = None

    def finish(self, outputs: Sequence[str]) -> dict[str, str]:
        """Marks ``outputs`` as graph outputs, validates; returns ONNX name -> tensor name."""
        names: dict[str, str] = {}
        for o in outputs:
            t = self.values.get(o)
            if t is None:
                raise Unmappable(f"value '{o}' is read downstream but its producer's lowering does not compute it")
            if t.producer is None:  # an input or constant passed straight through
                t = self.g.identity(t, name=self._unique(f"pass_{o}"))
                self.values[o] = t
            if not t.is_output:
                t.set_output(True)
            names[o] = t.name
        try:
            self.g.validate()
        except FusegraphError as exc:
            raise Unmappable(str(exc)) from None
        for onnx_name, t in self.values.items():
            want = self.og.shape(onnx_name)
            if want is not None and t.producer is not None and tuple(t.dim) != want:
                raise Unmappable(
                    f"lowering of '{onnx_name}' gives dims {t.dim}, ONNX shape inference says {list(want)}"
                )
        return names


# ---- helpers shared by lowerings ----------------------------------------------------------------
def _ints(v: Any) -> list[int]:
    return [int(x) for x in v]


def _spatial_attrs(imp: Importer, node: ONode, in_sp: Sequence[int], kernel: Sequence[int], dilation: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """(stride, pre_padding, post_padding) from strides/pads/auto_pad."""
    nsp = len(in_sp)
    stride = _ints(node.attr("strides", [1] * nsp))
    pads = _ints(node.attr("pads", [0] * (2 * nsp)))
    if len(stride) != nsp or len(pads) != 2 * nsp:
        raise Unmappable(f"{node.op_type}: strides={stride} / pads={pads} do not fit {nsp} spatial axes")
    auto = node.attr("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else str(auto)
    if auto == "VALID":
        pads = [0] * (2 * nsp)
    elif auto in ("SAME_UPPER", "SAME_LOWER"):
        pre, post = [], []
        for x, k, s, d in zip(in_sp, kernel, stride, dilation, strict=True):
            out = -(-x // s)
            total = max((out - 1) * s + (k - 1) * d + 1 - x, 0)
            small, big = total // 2, total - total // 2
            pre.append(small if auto == "SAME_UPPER" else big)
            post.append(big if auto == "SAME_UPPER" else small)
        pads = pre + post
    elif auto != "NOTSET":
        raise Unmappable(f"{node.op_type}: auto_pad={auto!r} is not an ONNX value")
    return stride, pads[:nsp], pads[nsp:]


def _per_channel(arr: np.ndarray, rank: int) -> np.ndarray:
    """A [C] vector as [1, C, 1, ...] for a rank-``rank`` activation."""
    return arr.reshape((1, -1) + (1,) * (rank - 2))


def _reshape(imp: Importer, t: TensorAttr, dims: Sequence[int]) -> TensorAttr:
    if tuple(t.dim) == tuple(dims):
        return t
    return imp.g.reshape(t, list(dims))


# ---- convolution and matmul ---------------------------------------------------------------------
def lower_conv(imp: Importer, node: ONode) -> None:
    xs = imp.shape(node.inputs[0])
    if not 3 <= len(xs) <= 5:
        raise Unmappable(f"Conv: input rank {len(xs)} (fusegraph runs 1-D, 2-D and 3-D convolutions)")
    nsp = len(xs) - 2
    ws = imp.shape(node.inputs[1])
    kernel = list(ws[2:])
    ks = node.attr("kernel_shape")
    if ks is not None and _ints(ks) != kernel:
        raise Unmappable(f"Conv: kernel_shape={list(ks)} differs from the weight's spatial dims {kernel}")
    dil = _ints(node.attr("dilations", [1] * nsp))
    group = int(node.attr("group", 1))
    if xs[1] != ws[1] * group:
        raise Unmappable(f"Conv: group={group} with {xs[1]} input channels and weight {list(ws)}")
    stride, pre, post = _spatial_attrs(imp, node, xs[2:], kernel, dil)
    x = imp.tensor(node.inputs[0])
    w = imp.tensor(node.inputs[1], "filter")
    y = imp.g.conv_fprop(x, w, stride=stride, dilation=dil, pre_padding=pre, post_padding=post)
    if len(node.inputs) > 2 and node.inputs[2]:
        y = imp.g.add(y, _channel_vector(imp, node.inputs[2], len(xs)))
    imp.set(node.outputs[0], y)


def _channel_vector(imp: Importer, name: str, rank: int) -> TensorAttr:
    if imp.is_const(name):
        return imp.constant(_per_channel(imp.og.constants[name], rank), name)
    t = imp.tensor(name, "plain")
    return _reshape(imp, t, (1, t.dim[0]) + (1,) * (rank - 2))


def lower_conv_transpose(imp: Importer, node: ONode) -> None:
    """As conv_dgrad: the adjoint of a forward convolution whose filter is the weight."""
    xs = imp.shape(node.inputs[0])
    if not 3 <= len(xs) <= 5:
        raise Unmappable(f"ConvTranspose: input rank {len(xs)}")
    nsp = len(xs) - 2
    ws = imp.shape(node.inputs[1])
    group = int(node.attr("group", 1))
    kernel = list(ws[2:])
    dil = _ints(node.attr("dilations", [1] * nsp))
    stride = _ints(node.attr("strides", [1] * nsp))
    outpad = _ints(node.attr("output_padding", [0] * nsp))
    if xs[1] != ws[0]:
        raise Unmappable(f"ConvTranspose: {xs[1]} input channels but weight {list(ws)}")
    cout = ws[1] * group
    span = [(k - 1) * d + 1 for k, d in zip(kernel, dil, strict=True)]
    out_shape = node.attr("output_shape")
    auto = node.attr("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else str(auto)
    if out_shape is not None or auto in ("SAME_UPPER", "SAME_LOWER"):
        target = _ints(out_shape)[-nsp:] if out_shape is not None else [x * s for x, s in zip(xs[2:], stride, strict=True)]
        pre, post = [], []
        for i in range(nsp):
            total = stride[i] * (xs[2 + i] - 1) + outpad[i] + span[i] - target[i]
            if total < 0:
                raise Unmappable(f"ConvTranspose: output_shape {target} needs negative padding on axis {i}")
            if auto == "SAME_UPPER":
                pre.append(total // 2)
                post.append(total - total // 2)
            else:
                pre.append(total - total // 2)
                post.append(total // 2)
    else:
        pads = _ints(node.attr("pads", [0] * (2 * nsp)))
        pre, post = pads[:nsp], pads[nsp:]
    out_sp = [
        stride[i] * (xs[2 + i] - 1) + outpad[i] + span[i] - pre[i] - post[i] for i in range(nsp)
    ]
    for i in range(nsp):
        if outpad[i] >= stride[i]:
            raise Unmappable(f"ConvTranspose: output_padding={outpad} must be < strides={stride}")
    x = imp.tensor(node.inputs[0])
    w = imp.tensor(node.inputs[1], "filter")
    y = imp.g.conv_dgrad(x, w, stride=stride, dilation=dil, pre_padding=pre, post_padding=post)
    dims = [xs[0], cout, *out_sp]
    y.set_dim(dims)
    y.set_stride(imp._strides(dims, "act"))
    if len(node.inputs) > 2 and node.inputs[2]:
        y = imp.g.add(y, _channel_vector(imp, node.inputs[2], len(xs)))
    imp.set(node.outputs[0], y)


def lower_matmul(imp: Importer, node: ONode) -> None:
    a_s, b_s = imp.shape(node.inputs[0]), imp.shape(node.inputs[1])
    a = imp.tensor(node.inputs[0], "plain")
    b = imp.tensor(node.inputs[1], "matrix" if len(b_s) == 2 and imp.is_const(node.inputs[1]) else "plain")
    if len(a_s) == 1:
        a = _reshape(imp, a, (1, a_s[0]))
    if len(b_s) == 1:
        b = _reshape(imp, b, (b_s[0], 1))
    y = imp.g.matmul(a, b)
    out = imp.og.shape(node.outputs[0])
    if out is not None and (len(a_s) == 1 or len(b_s) == 1):
        y = _reshape(imp, y, out) if out else y
    imp.set(node.outputs[0], y)


def lower_gemm(imp: Importer, node: ONode) -> None:
    alpha, beta = float(node.attr("alpha", 1.0)), float(node.attr("beta", 1.0))
    ta, tb = int(node.attr("transA", 0)), int(node.attr("transB", 0))
    for n in node.inputs[:2]:
        if len(imp.shape(n)) != 2:
            raise Unmappable(f"Gemm: input '{n}' is not 2-D {list(imp.shape(n))}")
    if imp.is_const(node.inputs[0]) and ta:
        a = imp.constant(np.ascontiguousarray(imp.og.constants[node.inputs[0]].T), node.inputs[0], "plain")
    else:
        a = imp.tensor(node.inputs[0], "plain")
        if ta:
            a = imp.g.transpose(a, [1, 0])
    folded_alpha = False
    if imp.is_const(node.inputs[1]):
        bw = imp.og.constants[node.inputs[1]]
        bw = bw.T if tb else bw
        if alpha != 1.0 and bw.dtype.kind == "f":
            bw = bw * np.asarray(alpha, dtype=bw.dtype)
            folded_alpha = True
        b = imp.constant(np.ascontiguousarray(bw), node.inputs[1], "matrix")
    else:
        b = imp.tensor(node.inputs[1], "plain")
        if tb:
            b = imp.g.transpose(b, [1, 0])
    y = imp.g.matmul(a, b)
    if alpha != 1.0 and not folded_alpha:
        y = imp.g.mul(y, imp.scalar(alpha, y.dtype))
    if len(node.inputs) > 2 and node.inputs[2] and beta != 0.0:
        cname = node.inputs[2]
        if imp.is_const(cname):
            c = imp.og.constants[cname]
            if beta != 1.0:
                c = c * np.asarray(beta, dtype=c.dtype)
            ct = imp.g.scalar(c.reshape(-1)[0].item(), y.dtype) if c.size == 1 else imp.constant(c, cname, "plain")
        else:
            ct = imp.tensor(cname, "plain")
            if beta != 1.0:
                ct = imp.g.mul(ct, imp.scalar(beta, ct.dtype))
        y = imp.g.add(y, ct)
    imp.set(node.outputs[0], y)


# ---- elementwise --------------------------------------------------------------------------------
_BINARY = {
    "Add": M.ADD, "Sub": M.SUB, "Mul": M.MUL, "Div": M.DIV, "Pow": M.POW,
    "Equal": M.CMP_EQ, "Greater": M.CMP_GT, "Less": M.CMP_LT,
    "GreaterOrEqual": M.CMP_GE, "LessOrEqual": M.CMP_LE, "And": M.LOGICAL_AND, "Or": M.LOGICAL_OR,
}
_COMMUTATIVE = frozenset({"Add", "Mul", "Max", "Min", "Sum", "Mean", "Equal", "And", "Or"})


def _out_rank(imp: Importer, node: ONode) -> int:
    return max(len(imp.shape(i)) for i in node.inputs if i)


def _ordered(imp: Importer, node: ONode, names: Sequence[str]) -> list[str]:
    """Activations first for commutative ops, so outputs inherit their memory layout."""
    if node.op_type not in _COMMUTATIVE:
        return list(names)
    return sorted(names, key=lambda n: (imp.is_const(n), -len(imp.shape(n))))


def lower_binary(imp: Importer, node: ONode) -> None:
    if node.op_type == "Div" and imp.dtype(node.inputs[0]).is_integer:
        raise Unmappable("Div: integer division (ONNX truncation semantics are left to ONNX Runtime)")
    if node.op_type == "Pow" and imp.dtype(node.inputs[0]) != imp.dtype(node.inputs[1]):
        raise Unmappable(
            f"Pow: base {imp.dtype(node.inputs[0]).name} and exponent {imp.dtype(node.inputs[1]).name} types differ"
        )
    rank = _out_rank(imp, node)
    a_name, b_name = _ordered(imp, node, node.inputs[:2])
    y = imp.g.pointwise(imp.operand(a_name, rank), imp.operand(b_name, rank), mode=_BINARY[node.op_type])
    imp.set(node.outputs[0], y)


def lower_variadic(imp: Importer, node: ONode) -> None:
    mode = {"Max": M.MAX, "Min": M.MIN, "Sum": M.ADD, "Mean": M.ADD}[node.op_type]
    names = _ordered(imp, node, [i for i in node.inputs if i])
    rank = _out_rank(imp, node)
    acc = imp.operand(names[0], rank)
    if len(names) == 1:
        acc = imp.g.identity(acc)
    for n in names[1:]:
        acc = imp.g.pointwise(acc, imp.operand(n, rank), mode=mode)
    if node.op_type == "Mean" and len(names) > 1:
        acc = imp.g.mul(acc, imp.scalar(1.0 / len(names), acc.dtype))
    imp.set(node.outputs[0], acc)


def _unary(mode: PointwiseMode) -> Callable[[Importer, ONode], None]:
    def lower(imp: Importer, node: ONode) -> None:
        imp.set(node.outputs[0], imp.g.pointwise(imp.tensor(node.inputs[0]), mode=mode))

    return lower


def lower_leaky_relu(imp: Importer, node: ONode) -> None:
    alpha = float(node.attr("alpha", 0.01))
    imp.set(node.outputs[0], imp.g.relu(imp.tensor(node.inputs[0]), negative_slope=alpha))


def lower_elu(imp: Importer, node: ONode) -> None:
    imp.set(node.outputs[0], imp.g.elu(imp.tensor(node.inputs[0]), alpha=float(node.attr("alpha", 1.0))))


def lower_selu(imp: Importer, node: ONode) -> None:
    alpha = float(node.attr("alpha", 1.67326319217681884765625))
    gamma = float(node.attr("gamma", 1.05070102214813232421875))
    x = imp.tensor(node.inputs[0])
    y = imp.g.elu(x, alpha=alpha)
    imp.set(node.outputs[0], imp.g.mul(y, imp.scalar(gamma, y.dtype)))


def _hard_sigmoid(imp: Importer, x: TensorAttr, alpha: float, beta: float) -> TensorAttr:
    t = imp.g.add(imp.g.mul(x, imp.scalar(alpha, x.dtype)), imp.scalar(beta, x.dtype))
    return imp.g.relu(t, lower_clip=0.0, upper_clip=1.0)


def lower_hard_sigmoid(imp: Importer, node: ONode) -> None:
    x = imp.tensor(node.inputs[0])
    imp.set(node.outputs[0], _hard_sigmoid(imp, x, float(node.attr("alpha", 0.2)), float(node.attr("beta", 0.5))))


def lower_hard_swish(imp: Importer, node: ONode) -> None:
    x = imp.tensor(node.inputs[0])
    imp.set(node.outputs[0], imp.g.mul(x, _hard_sigmoid(imp, x, 1.0 / 6.0, 0.5)))


def lower_softsign(imp: Importer, node: ONode) -> None:
    x = imp.tensor(node.inputs[0])
    den = imp.g.add(imp.g.abs(x), imp.scalar(1.0, x.dtype))
    imp.set(node.outputs[0], imp.g.div(x, den))


def lower_mish(imp: Importer, node: ONode) -> None:
    x = imp.tensor(node.inputs[0])
    imp.set(node.outputs[0], imp.g.mul(x, imp.g.tanh(imp.g.softplus(x))))


def lower_gelu(imp: Importer, node: ONode) -> None:
    approx = node.attr("approximate", b"none")
    approx = approx.decode() if isinstance(approx, bytes) else str(approx)
    x = imp.tensor(node.inputs[0])
    if approx == "tanh":
        imp.set(node.outputs[0], imp.g.gelu_approx_tanh(x))
    elif approx == "none":
        imp.set(node.outputs[0], imp.g.gelu(x))
    else:
        raise Unmappable(f"Gelu: approximate={approx!r}")


def lower_prelu(imp: Importer, node: ONode) -> None:
    """max(x, 0) + slope * min(x, 0): PRelu's slope broadcasts (unidirectionally)."""
    x = imp.tensor(node.inputs[0])
    rank = len(x.dim)
    slope = imp.operand(node.inputs[1], rank)
    zero = imp.scalar(0.0, x.dtype)
    y = imp.g.add(imp.g.max(x, zero), imp.g.mul(imp.g.min(x, zero), slope))
    imp.set(node.outputs[0], y)


def lower_thresholded_relu(imp: Importer, node: ONode) -> None:
    x = imp.tensor(node.inputs[0])
    alpha = float(node.attr("alpha", 1.0))
    keep = imp.g.cmp_gt(x, imp.scalar(alpha, x.dtype))
    imp.set(node.outputs[0], imp.g.binary_select(x, imp.scalar(0.0, x.dtype), keep))


def lower_clip(imp: Importer, node: ONode) -> None:
    x = imp.tensor(node.inputs[0])
    if imp.og.opset < 11:
        lo: float | None = float(node.attr("min", -3.4028234663852886e38))
        hi: float | None = float(node.attr("max", 3.4028234663852886e38))
    else:
        lo = hi = None
        if len(node.inputs) > 1 and node.inputs[1]:
            lo = float(imp.const(node.inputs[1], "min").reshape(-1)[0])
        if len(node.inputs) > 2 and node.inputs[2]:
            hi = float(imp.const(node.inputs[2], "max").reshape(-1)[0])
    y = x
    if lo is not None and hi is not None and x.dtype.is_float and lo <= hi:
        y = imp.g.relu(x, lower_clip=lo, upper_clip=hi)
    else:
        if lo is not None:
            y = imp.g.max(y, imp.scalar(lo, x.dtype))
        if hi is not None:
            y = imp.g.min(y, imp.scalar(hi, x.dtype))
        if y is x:
            y = imp.g.identity(x)
    imp.set(node.outputs[0], y)


def lower_sign(imp: Importer, node: ONode) -> None:
    x = imp.tensor(node.inputs[0])
    dt = x.dtype
    zero = imp.scalar(0.0, dt)
    neg = imp.g.binary_select(imp.scalar(-1.0, dt), zero, imp.g.cmp_lt(x, imp.scalar(0.0, dt)))
    imp.set(node.outputs[0], imp.g.binary_select(imp.scalar(1.0, dt), neg, imp.g.cmp_gt(x, imp.scalar(0.0, dt))))


def lower_shrink(imp: Importer, node: ONode) -> None:
    x = imp.tensor(node.inputs[0])
    dt = x.dtype
    lambd, bias = float(node.attr("lambd", 0.5)), float(node.attr("bias", 0.0))
    hi = imp.g.binary_select(imp.g.sub(x, imp.scalar(bias, dt)), imp.scalar(0.0, dt), imp.g.cmp_gt(x, imp.scalar(lambd, dt)))
    y = imp.g.binary_select(imp.g.add(x, imp.scalar(bias, dt)), hi, imp.g.cmp_lt(x, imp.scalar(-lambd, dt)))
    imp.set(node.outputs[0], y)


def lower_pad(imp: Importer, node: ONode) -> None:
    """Constant-mode Pad as a concatenation with constant slabs (negative pads crop)."""
    mode = node.attr("mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    if mode != "constant":
        raise Unmappable(f"Pad: mode={mode!r} (only 'constant' is lowered)")
    xs = imp.shape(node.inputs[0])
    rank = len(xs)
    if imp.og.opset < 11:
        pads = _ints(node.attr("pads"))
        value = float(node.attr("value", 0.0))
        axes = list(range(rank))
    else:
        pads = _ints(imp.const(node.inputs[1], "pads").reshape(-1))
        value = 0.0
        if len(node.inputs) > 2 and node.inputs[2]:
            value = imp.const(node.inputs[2], "constant_value").reshape(-1)[0].item()
        axes = (
            [a % rank for a in _ints(imp.const(node.inputs[3], "axes").reshape(-1))]
            if len(node.inputs) > 3 and node.inputs[3] else list(range(rank))
        )
    n = len(axes)
    if len(pads) != 2 * n:
        raise Unmappable(f"Pad: {len(pads)} pads for {n} axes")
    y = imp.tensor(node.inputs[0])
    crop = [(a, max(-pads[i], 0), max(-pads[n + i], 0)) for i, a in enumerate(axes)]
    if any(b or e for _, b, e in crop):
        dims = list(y.dim)
        y = imp.g.slice(y, [b for _, b, _ in crop], [dims[a] - e for a, _, e in crop], axes=[a for a, _, _ in crop])
    for i, a in enumerate(axes):
        before, after = max(pads[i], 0), max(pads[n + i], 0)
        if not before and not after:
            continue
        parts: list[TensorAttr | None] = []
        dims = list(y.dim)
        for size in (before, after):
            if size:
                slab = [*dims[:a], size, *dims[a + 1:]]
                parts.append(imp.constant(np.full(slab, value, dtype=y.dtype.numpy), f"pad_{a}"))
            else:
                parts.append(None)
        seq = [p for p in (parts[0], y, parts[1]) if p is not None]
        y = imp.g.concatenate(seq, axis=a)
    if y is imp.values.get(node.inputs[0]):
        y = imp.g.identity(y)
    imp.set(node.outputs[0], y)


def lower_where(imp: Importer, node: ONode) -> None:
    rank = _out_rank(imp, node)
    c = imp.operand(node.inputs[0], rank)
    a, b = imp.operand(node.inputs[1], rank), imp.operand(node.inputs[2], rank)
    imp.set(node.outputs[0], imp.g.binary_select(a, b, c))


def lower_not(imp: Importer, node: ONode) -> None:
    imp.set(node.outputs[0], imp.g.logical_not(imp.tensor(node.inputs[0])))


def lower_cast(imp: Importer, node: ONode) -> None:
    to = data_type_of(int(node.attr("to")), "Cast target")
    x = imp.tensor(node.inputs[0])
    if x.dtype == to:
        imp.set(node.outputs[0], imp.g.identity(x))
        return
    if x.dtype.is_float and to == DataType.BOOLEAN:
        raise Unmappable("Cast: float -> bool (ONNX tests != 0; left to ONNX Runtime)")
    y = imp.g.identity(x)
    y.set_data_type(to)
    imp.set(node.outputs[0], y)


def lower_identity(imp: Importer, node: ONode) -> None:
    """Identity, and Dropout at inference: the value passes through unchanged."""
    if node.op_type == "Dropout":
        if len(node.inputs) > 2 and node.inputs[2]:
            mode = imp.const(node.inputs[2], "training_mode")
            if bool(mode.reshape(-1)[0]):
                raise Unmappable("Dropout: training_mode=True")
        if len(node.outputs) > 1 and node.outputs[1] and _is_read(imp, node.outputs[1]):
            raise Unmappable("Dropout: the mask output is used")
    imp.set(node.outputs[0], imp.tensor(node.inputs[0]))


def _is_read(imp: Importer, name: str) -> bool:
    return name in imp.og.outputs or any(name in n.all_inputs() for n in imp.og.nodes)


# ---- normalization ------------------------------------------------------------------------------
def lower_batchnorm(imp: Importer, node: ONode) -> None:
    if int(node.attr("training_mode", 0)):
        raise Unmappable("BatchNormalization: training_mode=1 (inference only)")
    if imp.og.opset < 9 and int(node.attr("spatial", 1)) == 0:
        raise Unmappable("BatchNormalization: spatial=0")
    if imp.og.opset < 7 and not int(node.attr("is_test", 0)):
        raise Unmappable("BatchNormalization: is_test=0")
    for extra in node.outputs[1:]:
        if extra and _is_read(imp, extra):
            raise Unmappable(f"BatchNormalization: statistics output '{extra}' is used (inference only)")
    eps = float(node.attr("epsilon", 1e-5))
    xs = imp.shape(node.inputs[0])
    x = imp.tensor(node.inputs[0])
    names = node.inputs[1:5]
    if all(imp.is_const(n) for n in names):
        scale, bias, mean, var = (imp.og.constants[n].astype(np.float64) for n in names)
        a = scale / np.sqrt(var + eps)
        b = bias - mean * a
        dt = x.dtype.numpy
        at = imp.constant(_per_channel(a.astype(dt), len(xs)), f"{names[0]}_folded")
        bt = imp.constant(_per_channel(b.astype(dt), len(xs)), f"{names[1]}_folded")
        imp.set(node.outputs[0], imp.g.add(imp.g.mul(x, at), bt))
        return
    ts, tb, tm, tv = (imp.tensor(n, "plain") for n in names)
    imp.set(node.outputs[0], imp.g.batchnorm_inference(x, ts, tb, tm, tv, epsilon=eps))


def _rows(imp: Importer, x: TensorAttr, axis: int) -> tuple[TensorAttr, int, int]:
    dims = x.dim
    outer, inner = math.prod(dims[:axis]), math.prod(dims[axis:])
    return _reshape(imp, x, (outer, inner)), outer, inner


def lower_layernorm(imp: Importer, node: ONode) -> None:
    for extra in node.outputs[1:]:
        if extra and _is_read(imp, extra):
            raise Unmappable(f"LayerNormalization: output '{extra}' (Mean/InvStdDev) is used")
    xs = imp.shape(node.inputs[0])
    axis = int(node.attr("axis", -1)) % len(xs)
    if axis == 0:
        raise Unmappable("LayerNormalization: axis=0 (normalizing over the batch axis too)")
    eps = float(node.attr("epsilon", 1e-5))
    x = imp.tensor(node.inputs[0], "plain")
    x2, _, inner = _rows(imp, x, axis)
    feat = tuple(xs[axis:])

    def param(name: str | None, fill: float) -> TensorAttr:
        if name and imp.is_const(name):
            arr = np.broadcast_to(imp.og.constants[name], feat).reshape(1, inner)
            return imp.constant(np.ascontiguousarray(arr), name, "plain")
        if name:
            t = imp.tensor(name, "plain")
            if tuple(t.dim) != feat:
                raise Unmappable(f"LayerNormalization: non-constant '{name}' {t.dim} must have dims {list(feat)}")
            return _reshape(imp, t, (1, inner))
        return imp.constant(np.full((1, inner), fill, dtype=x.dtype.numpy), "ln_zero_bias", "plain")

    scale = param(node.inputs[1], 1.0)
    bias = param(node.inputs[2] if len(node.inputs) > 2 else None, 0.0)
    y, _, _ = imp.g.layernorm(x2, scale, bias, epsilon=eps)
    imp.set(node.outputs[0], _reshape(imp, y, xs))


def lower_instancenorm(imp: Importer, node: ONode) -> None:
    xs = imp.shape(node.inputs[0])
    if len(xs) < 3:
        raise Unmappable(f"InstanceNormalization: input rank {len(xs)} < 3")
    eps = float(node.attr("epsilon", 1e-5))
    x = imp.tensor(node.inputs[0], "plain")
    n, c, sp = xs[0], xs[1], math.prod(xs[2:])
    dt = x.dtype.numpy
    x2 = _reshape(imp, x, (n * c, sp))
    ones = imp.constant(np.ones((1, sp), dtype=dt), "in_one", "plain")
    zeros = imp.constant(np.zeros((1, sp), dtype=dt), "in_zero", "plain")
    y, _, _ = imp.g.layernorm(x2, ones, zeros, epsilon=eps)
    y = _reshape(imp, y, xs)
    y = imp.g.mul(y, _channel_vector(imp, node.inputs[1], len(xs)))
    y = imp.g.add(y, _channel_vector(imp, node.inputs[2], len(xs)))
    imp.set(node.outputs[0], y)


def lower_lrn(imp: Importer, node: ONode) -> None:
    """x / (bias + alpha/size * sum of squares over a channel window) ** beta.

    The channel-window sum is an average pool over a [N, 1, C, spatial] view of x².
    """
    xs = imp.shape(node.inputs[0])
    if len(xs) < 3:
        raise Unmappable(f"LRN: input rank {len(xs)} < 3")
    size = int(node.attr("size"))
    alpha, beta = float(node.attr("alpha", 1e-4)), float(node.attr("beta", 0.75))
    bias = float(node.attr("bias", 1.0))
    if size < 1:
        raise Unmappable(f"LRN: size={size}")
    x = imp.tensor(node.inputs[0])
    n, c, sp = xs[0], xs[1], math.prod(xs[2:])
    sq = imp.g.mul(x, x)
    v = _reshape(imp, sq, (n, 1, c, sp))
    pre, post = (size - 1) // 2, size - 1 - (size - 1) // 2
    if size == 1:
        avg = v
    else:
        avg = imp.g.pooling(
            v, PoolingMode.AVG_INCLUDE_PAD, window=(size, 1), stride=(1, 1),
            pre_padding=(pre, 0), post_padding=(post, 0),
        )
    avg = _reshape(imp, avg, xs)
    t = imp.g.add(imp.g.mul(avg, imp.scalar(alpha, x.dtype)), imp.scalar(bias, x.dtype))
    den = imp.g.pow(t, imp.scalar(beta, x.dtype))
    imp.set(node.outputs[0], imp.g.div(x, den))


# ---- pooling and reductions -------------------------------------------------------------------
def lower_pool(imp: Importer, node: ONode) -> None:
    op = node.op_type
    xs = imp.shape(node.inputs[0])
    if not 3 <= len(xs) <= 5:
        raise Unmappable(f"{op}: input rank {len(xs)}")
    nsp = len(xs) - 2
    kernel = _ints(node.attr("kernel_shape"))
    dil = _ints(node.attr("dilations", [1] * nsp))
    if any(d != 1 for d in dil):
        raise Unmappable(f"{op}: dilations={dil} (fusegraph pooling has no dilation)")
    if op == "MaxPool":
        if int(node.attr("storage_order", 0)):
            raise Unmappable("MaxPool: storage_order=1")
        if len(node.outputs) > 1 and node.outputs[1] and _is_read(imp, node.outputs[1]):
            raise Unmappable("MaxPool: the Indices output is used")
        mode = PoolingMode.MAX
    else:
        mode = PoolingMode.AVG_INCLUDE_PAD if int(node.attr("count_include_pad", 0)) else PoolingMode.AVG_EXCLUDE_PAD
    stride, pre, post = _spatial_attrs(imp, node, xs[2:], kernel, dil)
    if int(node.attr("ceil_mode", 0)):
        post = list(post)
        for i in range(nsp):
            span = xs[2 + i] + pre[i] + post[i] - kernel[i]
            out = -(-span // stride[i]) + 1
            if (out - 1) * stride[i] >= xs[2 + i] + pre[i]:
                out -= 1
            extra = (out - 1) * stride[i] + kernel[i] - (xs[2 + i] + pre[i] + post[i])
            if extra > 0:
                if mode == PoolingMode.AVG_INCLUDE_PAD:
                    raise Unmappable(f"{op}: ceil_mode=1 with count_include_pad=1 needs a partial window")
                post[i] += extra
    for i in range(nsp):
        if not (pre[i] < kernel[i] and post[i] < kernel[i]):
            raise Unmappable(f"{op}: pads {pre}+{post} not smaller than kernel_shape={kernel}")
    x = imp.tensor(node.inputs[0])
    y = imp.g.pooling(x, mode, window=kernel, stride=stride, pre_padding=pre, post_padding=post)
    imp.set(node.outputs[0], y)


def lower_global_pool(imp: Importer, node: ONode) -> None:
    xs = imp.shape(node.inputs[0])
    if len(xs) < 3:
        raise Unmappable(f"{node.op_type}: input rank {len(xs)} < 3")
    mode = ReductionMode.AVG if node.op_type == "GlobalAveragePool" else ReductionMode.MAX
    x = imp.tensor(node.inputs[0])
    imp.set(node.outputs[0], imp.g.reduction(x, mode, axes=list(range(2, len(xs)))))


_REDUCE = {
    "ReduceSum": ReductionMode.SUM, "ReduceMean": ReductionMode.AVG, "ReduceMax": ReductionMode.MAX,
    "ReduceMin": ReductionMode.MIN, "ReduceProd": ReductionMode.MUL, "ReduceL1": ReductionMode.NORM1,
    "ReduceL2": ReductionMode.NORM2, "ReduceSumSquare": ReductionMode.SUM, "ReduceLogSum": ReductionMode.SUM,
}


def lower_reduce(imp: Importer, node: ONode) -> None:
    op = node.op_type
    xs = imp.shape(node.inputs[0])
    axes_as_input = imp.og.opset >= (13 if op == "ReduceSum" else 18)
    if axes_as_input:
        axes_v = imp.const(node.inputs[1], "axes") if len(node.inputs) > 1 and node.inputs[1] else None
        axes = _ints(axes_v.reshape(-1)) if axes_v is not None else []
    else:
        axes = _ints(node.attr("axes", []))
    keep = int(node.attr("keepdims", 1))
    x = imp.tensor(node.inputs[0], "plain")
    if not axes:
        if int(node.attr("noop_with_empty_axes", 0)):
            imp.set(node.outputs[0], imp.g.identity(x))
            return
        axes = list(range(len(xs)))
    axes = sorted({a % len(xs) for a in axes})
    if not keep and len(axes) == len(xs):
        raise Unmappable(f"{op}: keepdims=0 over every axis gives a rank-0 tensor")
    src = imp.g.mul(x, x) if op == "ReduceSumSquare" else x
    y = imp.g.reduction(src, _REDUCE[op], axes=axes)
    if op == "ReduceLogSum":
        y = imp.g.log(y)
    if not keep:
        y = _reshape(imp, y, [d for i, d in enumerate(xs) if i not in axes])
    imp.set(node.outputs[0], y)


def lower_softmax(imp: Importer, node: ONode) -> None:
    xs = imp.shape(node.inputs[0])
    log = node.op_type == "LogSoftmax"
    x = imp.tensor(node.inputs[0], "plain")
    if imp.og.opset < 13:
        axis = int(node.attr("axis", 1)) % len(xs)
        if axis == len(xs) - 1:
            y = imp.g.softmax(x, axis=axis, log=log)
        else:
            x2, _, _ = _rows(imp, x, axis)
            y = _reshape(imp, imp.g.softmax(x2, axis=1, log=log), xs)
    else:
        axis = int(node.attr("axis", -1)) % len(xs)
        y = imp.g.softmax(x, axis=axis, log=log)
    imp.set(node.outputs[0], y)


# ---- data movement --------------------------------------------------------------------------------
def _out_dims(imp: Importer, node: ONode) -> tuple[int, ...]:
    return imp.shape(node.outputs[0])


def lower_reshape_like(imp: Importer, node: ONode) -> None:
    """Reshape, Flatten, Squeeze, Unsqueeze: a row-major reshape to the inferred dims.

    The target comes from ONNX shape inference, which already resolved 0 / -1 / axes; the
    shape input of Reshape (and axes of Squeeze/Unsqueeze) must be constant for that.
    """
    op = node.op_type
    if op == "Reshape" and not imp.is_const(node.inputs[1]):
        raise Unmappable("Reshape: the target shape is computed at run time (not a constant)")
    if op in ("Squeeze", "Unsqueeze") and len(node.inputs) > 1 and node.inputs[1] and not imp.is_const(node.inputs[1]):
        raise Unmappable(f"{op}: axes are computed at run time")
    out = _out_dims(imp, node)
    if not out or 0 in out:
        raise Unmappable(f"{op}: output dims {list(out)} (rank-0 or empty)")
    x = imp.tensor(node.inputs[0], "plain")
    y = imp.g.reshape(x, list(out))
    if imp.channels_last and len(out) == 4:
        y.set_stride(imp._strides(out, "act"))  # back to NHWC after e.g. a channel shuffle
    imp.set(node.outputs[0], y)


def lower_transpose(imp: Importer, node: ONode) -> None:
    xs = imp.shape(node.inputs[0])
    perm = _ints(node.attr("perm", list(reversed(range(len(xs))))))
    imp.set(node.outputs[0], imp.g.transpose(imp.tensor(node.inputs[0], "plain"), perm))


def lower_concat(imp: Importer, node: ONode) -> None:
    names = [i for i in node.inputs if i]
    rank = len(imp.shape(names[0]))
    axis = int(node.attr("axis", 1)) % rank
    parts = [imp.tensor(n) for n in names]
    y = imp.g.concatenate(parts, axis=axis) if len(parts) > 1 else imp.g.identity(parts[0])
    imp.set(node.outputs[0], y)


def lower_slice(imp: Importer, node: ONode) -> None:
    xs = imp.shape(node.inputs[0])
    if imp.og.opset < 10:
        starts, ends = _ints(node.attr("starts")), _ints(node.attr("ends"))
        axes = _ints(node.attr("axes", list(range(len(starts)))))
        steps = [1] * len(starts)
    else:
        starts = _ints(imp.const(node.inputs[1], "starts").reshape(-1))
        ends = _ints(imp.const(node.inputs[2], "ends").reshape(-1))
        axes = (
            _ints(imp.const(node.inputs[3], "axes").reshape(-1))
            if len(node.inputs) > 3 and node.inputs[3] else list(range(len(starts)))
        )
        steps = (
            _ints(imp.const(node.inputs[4], "steps").reshape(-1))
            if len(node.inputs) > 4 and node.inputs[4] else [1] * len(starts)
        )
    if any(s < 1 for s in steps):
        raise Unmappable(f"Slice: steps={steps} (fusegraph slices with positive steps only)")
    big = 2**62
    ends = [min(max(e, -big), big) for e in ends]
    starts = [min(max(s, -big), big) for s in starts]
    x = imp.tensor(node.inputs[0])
    imp.set(node.outputs[0], imp.g.slice(x, starts, ends, steps, axes=[a % len(xs) for a in axes]))


def lower_split(imp: Importer, node: ONode) -> None:
    xs = imp.shape(node.inputs[0])
    axis = int(node.attr("axis", 0)) % len(xs)
    outs = [o for o in node.outputs]
    sizes: list[int] = []
    for o in outs:
        s = imp.og.shape(o) if o else None
        if s is None:
            raise Unmappable(f"Split: the shape of output '{o}' is unknown")
        sizes.append(s[axis])
    x = imp.tensor(node.inputs[0])
    start = 0
    for o, size in zip(outs, sizes, strict=True):
        imp.set(o, imp.g.slice(x, [start], [start + size], [1], axes=[axis]))
        start += size


def lower_gather(imp: Importer, node: ONode) -> None:
    """Gather with constant indices that form an arithmetic run: a slice (and a reshape)."""
    xs = imp.shape(node.inputs[0])
    axis = int(node.attr("axis", 0)) % len(xs)
    idx = imp.const(node.inputs[1], "indices").astype(np.int64)
    flat = np.where(idx < 0, idx + xs[axis], idx).reshape(-1)
    if flat.size == 0:
        raise Unmappable("Gather: empty indices")
    step = int(flat[1] - flat[0]) if flat.size > 1 else 1
    if step < 1 or not np.array_equal(flat, flat[0] + step * np.arange(flat.size)):
        raise Unmappable(f"Gather: indices {flat.tolist()[:8]} are not an increasing arithmetic run")
    x = imp.tensor(node.inputs[0])
    y = imp.g.slice(x, [int(flat[0])], [int(flat[-1]) + 1], [step], axes=[axis])
    out = _out_dims(imp, node)
    if not out:
        raise Unmappable("Gather: rank-0 output")
    imp.set(node.outputs[0], _reshape(imp, y, out))


def lower_depth_space(imp: Importer, node: ONode) -> None:
    xs = imp.shape(node.inputs[0])
    if len(xs) != 4:
        raise Unmappable(f"{node.op_type}: input rank {len(xs)} != 4")
    b = int(node.attr("blocksize"))
    n, c, h, w = xs
    x = imp.tensor(node.inputs[0], "plain")
    if node.op_type == "DepthToSpace":
        mode = node.attr("mode", b"DCR")
        mode = mode.decode() if isinstance(mode, bytes) else str(mode)
        if mode == "DCR":
            t = imp.g.reshape(x, [n, b, b, c // (b * b), h, w])
            t = imp.g.transpose(t, [0, 3, 4, 1, 5, 2])
        else:
            t = imp.g.reshape(x, [n, c // (b * b), b, b, h, w])
            t = imp.g.transpose(t, [0, 1, 4, 2, 5, 3])
        y = imp.g.reshape(t, [n, c // (b * b), h * b, w * b])
    else:
        t = imp.g.reshape(x, [n, c, h // b, b, w // b, b])
        t = imp.g.transpose(t, [0, 3, 5, 1, 2, 4])
        y = imp.g.reshape(t, [n, c * b * b, h // b, w // b])
    imp.set(node.outputs[0], y)


Lowering = Callable[[Importer, ONode], None]

LOWER: dict[str, Lowering] = {
    "Conv": lower_conv,
    "ConvTranspose": lower_conv_transpose,
    "MatMul": lower_matmul,
    "Gemm": lower_gemm,
    "BatchNormalization": lower_batchnorm,
    "LayerNormalization": lower_layernorm,
    "InstanceNormalization": lower_instancenorm,
    "LRN": lower_lrn,
    "Relu": _unary(M.RELU_FWD),
    "LeakyRelu": lower_leaky_relu,
    "PRelu": lower_prelu,
    "ThresholdedRelu": lower_thresholded_relu,
    "Sigmoid": _unary(M.SIGMOID_FWD),
    "Tanh": _unary(M.TANH_FWD),
    "Elu": lower_elu,
    "Selu": lower_selu,
    "Gelu": lower_gelu,
    "Erf": _unary(M.ERF),
    "Softplus": _unary(M.SOFTPLUS_FWD),
    "Softsign": lower_softsign,
    "Mish": lower_mish,
    "HardSigmoid": lower_hard_sigmoid,
    "HardSwish": lower_hard_swish,
    "Clip": lower_clip,
    "Abs": _unary(M.ABS),
    "Neg": _unary(M.NEG),
    "Exp": _unary(M.EXP),
    "Log": _unary(M.LOG),
    "Sqrt": _unary(M.SQRT),
    "Reciprocal": _unary(M.RECIPROCAL),
    "Sin": _unary(M.SIN),
    "Cos": _unary(M.COS),
    "Floor": _unary(M.FLOOR),
    "Ceil": _unary(M.CEIL),
    "Not": lower_not,
    "Cast": lower_cast,
    "Where": lower_where,
    "Sign": lower_sign,
    "Shrink": lower_shrink,
    "Pad": lower_pad,
    **{op: lower_binary for op in _BINARY},
    "Max": lower_variadic,
    "Min": lower_variadic,
    "Sum": lower_variadic,
    "Mean": lower_variadic,
    "MaxPool": lower_pool,
    "AveragePool": lower_pool,
    "GlobalAveragePool": lower_global_pool,
    "GlobalMaxPool": lower_global_pool,
    **{op: lower_reduce for op in _REDUCE},
    "Softmax": lower_softmax,
    "LogSoftmax": lower_softmax,
    "Reshape": lower_reshape_like,
    "Flatten": lower_reshape_like,
    "Squeeze": lower_reshape_like,
    "Unsqueeze": lower_reshape_like,
    "Transpose": lower_transpose,
    "Concat": lower_concat,
    "Slice": lower_slice,
    "Split": lower_split,
    "Gather": lower_gather,
    "DepthToSpace": lower_depth_space,
    "SpaceToDepth": lower_depth_space,
    "Identity": lower_identity,
    "Dropout": lower_identity,
}
