"""Checks a variant pack (tensor -> array) against a validated graph.

Arrays must match exactly: shape == dims, dtype == data type, and element strides ==
declared strides on every axis longer than one (a broadcast input needs stride 0, as
``np.broadcast_to`` makes). Mismatches raise VariantPackError naming the tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fusegraph.errors import VariantPackError
from fusegraph.graph import layout
from fusegraph.graph.tensor import TensorAttr


@dataclass
class ResolvedPack:
    inputs: dict[str, Any]  # graph input name -> array (or device buffer)
    outputs: dict[str, Any]  # output name -> caller's array to write, when given
    overridden: bool = False  # a bound constant (ExecutionPlan.bind_constants) came as another object


def _key_name(graph: Any, key: Any) -> TensorAttr:
    if isinstance(key, TensorAttr):
        if key.graph is not graph:
            raise VariantPackError("tensor belongs to another graph", tensor=key.name)
        return key
    if isinstance(key, str):
        try:
            return graph.tensor_by_name(key)  # type: ignore[no-any-return]
        except KeyError:
            raise VariantPackError("no tensor of this name in the graph", tensor=key) from None
    raise VariantPackError(f"variant pack keys must be TensorAttr or names, got {type(key).__name__}")


def check_array(t: TensorAttr, value: Any, *, what: str, strides: bool = True) -> np.ndarray:
    """``value`` as a NumPy array matching ``t``; ``strides=False`` accepts any memory order
    (for an engine that lays host arrays out itself)."""
    arr: np.ndarray
    if isinstance(value, np.ndarray):
        arr = value
    elif hasattr(value, "__array__") or hasattr(value, "__array_interface__"):
        arr = np.asarray(value)
    else:
        raise VariantPackError(
            f"{what} must be a numpy array or a fusegraph Buffer, got {type(value).__name__}", tensor=t.name
        )
    if tuple(arr.shape) != t.shape:
        raise VariantPackError(f"{what} has shape {list(arr.shape)}, expected dims {t.dim}", tensor=t.name)
    if arr.dtype != t.dtype.numpy:
        raise VariantPackError(f"{what} has dtype {arr.dtype}, expected {t.dtype.name} ({t.dtype.numpy})", tensor=t.name)
    have = layout.element_strides(arr.shape, arr.strides, arr.itemsize)
    if not strides:  # what the engine can view as is (torch takes no negative strides), else a copy
        return arr if have is not None and min(have, default=0) >= 0 else np.ascontiguousarray(arr)
    if have is None or not layout.same_strides(t.shape, have, t.strides):
        raise VariantPackError(
            f"{what} has element strides {list(have) if have else arr.strides}, but the tensor "
            f"declares strides {t.stride}; pass an array in that layout (e.g. np.ascontiguousarray "
            "of the permuted data, viewed back with .transpose) or declare its strides",
            tensor=t.name,
        )
    return arr


def resolve_pack(graph: Any, variant_pack: Mapping[Any, Any], *, check: Any = check_array) -> ResolvedPack:
    """Maps the pack onto graph inputs/outputs; ``check`` validates each value."""
    if not isinstance(variant_pack, Mapping):
        raise VariantPackError(f"the variant pack must be a mapping, got {type(variant_pack).__name__}")
    inputs = {t.name: t for t in graph.inputs()}
    outputs = {t.name: t for t in graph.outputs()}
    res = ResolvedPack({}, {})
    for key, value in variant_pack.items():
        t = _key_name(graph, key)
        if t.name in inputs:
            res.inputs[t.name] = check(t, value, what="input")
        elif t.name in outputs:
            arr = check(t, value, what="output")
            if isinstance(arr, np.ndarray) and not arr.flags.writeable:
                raise VariantPackError("output array is read-only", tensor=t.name)
            res.outputs[t.name] = arr
        elif t.is_scalar:
            raise VariantPackError("scalar constants are inlined in the graph; do not pass them", tensor=t.name)
        elif t.is_virtual:
            raise VariantPackError("virtual (intermediate) tensor has no buffer; mark it set_output(True) to read it", tensor=t.name)
        else:
            raise VariantPackError("tensor is not read by any node; nothing takes this array", tensor=t.name)
    missing = [n for n in inputs if n not in res.inputs]
    if missing:
        raise VariantPackError(f"missing input(s) {missing}", tensor=missing[0])
    return res
