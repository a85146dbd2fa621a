"""ONNX nodes -> one fusegraph Graph: the driver of the ONNX op table.

An :class:`Importer` builds one fusegraph Graph from a set of ONNX nodes (a claimed
partition, or a single node when the partitioner asks "can we run this?"). Each node is
lowered by the function the op table (``fusegraph.onnx.ops``) registers for its op type,
which either emits graph ops or raises :class:`Unmappable` with a precise reason (op type,
attribute and value) that the partition report shows. Constants become graph inputs whose
arrays are packed once, here, into the layout the engine wants (conv filters as
``FILTER_LAYOUTS`` says for the engine, activations channels-last inside partitions that
hold convolutions or pooling). The region path takes them unpacked (``pack=False``) and
lays them out as it copies them to the device: on a GPU the transposes then run there, not
on the host (ViT-B/16's column-major matmul weights: 0.45 s of host copies per session).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import numpy as np
from onnx import helper

from fusegraph.dtypes import DataType
from fusegraph.errors import FusegraphError
from fusegraph.graph import layout
from fusegraph.graph.graph import Graph
from fusegraph.graph.tensor import TensorAttr
from fusegraph.onnx.model import OnnxGraph, ONode
from fusegraph.onnx.ops import SPATIAL_OPS, TABLE, Unmappable, data_type_of
from fusegraph.onnx.ops.table import table_key

__all__ = [
    "CHANNELS_LAST", "DEFAULT_FILTER_LAYOUT", "FILTER_LAYOUTS", "MATRIX_COLUMN_MAJOR", "SPATIAL_OPS",
    "Importer", "Unmappable", "channels_last_strides", "data_type_of", "filter_layout_for",
    "filter_strides", "with_strides",
]

# Memory order of channels-last activations and filters, by rank.
CHANNELS_LAST = {3: "NHC", 4: "NHWC", 5: "NDHWC"}


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
        # False: the weights are kept in their logical (row-major) order, as the model holds
        # them (no copy; possibly read-only): for the graph alone, or for a consumer that lays
        # them out itself as the graph declares (the region path's upload, plan_regions)
        self.pack = pack
        self.values: dict[str, TensorAttr] = {}  # ONNX value -> tensor holding it
        self.inputs: dict[str, TensorAttr] = {}  # ONNX activation -> graph input
        self.weights: dict[str, np.ndarray] = {}  # graph tensor name -> bound array (declared strides; see pack)
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
            if role == "plain" and len(dims) in (4, 5) and not os.environ.get("FG_NCHW_IN"):
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
        if not self.pack:  # a folded constant may be a view with any strides: row-major for the consumer
            self.weights[t.name] = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
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
        entry = TABLE.get(table_key(node.op_type, node.domain))
        if entry is None and not node.is_default_domain:
            raise Unmappable(f"{node.op_type}: domain '{node.domain}' is not the default ONNX domain")
        if entry is None:
            raise Unmappable(f"{node.op_type}: no fusegraph lowering for this op type")
        try:
            entry.lower(self, node)
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
