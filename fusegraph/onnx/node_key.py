"""A node's claimability key: everything its lowering and its engine verdict read, without
its names, so that a session decides a model's repeated layers once (SessionPlan._verdict)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fusegraph.onnx.model import OnnxGraph, ONode

_KEY_CONSTANT = 64  # constants with at most this many elements are keyed by value (_verdict_key)
# ops whose lowerings read a large constant only to bind it as a weight (ops/gemm.py,
# ops/elementwise.py, ops/norm.py), never to decide on its values: keyed by type and shape
_BINDS_WEIGHTS = frozenset({"MatMul", "Gemm", "Add", "Sub", "Mul", "Div", "LayerNormalization"})
_NOT_PLAIN = object()


def _plain(v: Any) -> Any:
    """An attribute value as a hashable key part, or _NOT_PLAIN (tensors, graphs, arrays)."""
    if isinstance(v, float):
        return ("float", repr(v))  # -0.0 and 0.0 apart, NaN equal to itself
    if v is None or isinstance(v, bool | int | str | bytes):
        return (type(v).__name__, v)
    if isinstance(v, list | tuple):
        parts = [_plain(x) for x in v]
        return _NOT_PLAIN if any(p is _NOT_PLAIN for p in parts) else (type(v).__name__, tuple(parts))
    return _NOT_PLAIN


def node_key(og: OnnxGraph, node: ONode, channels_last: bool,
             is_read: Callable[[str], bool]) -> tuple[Any, ...] | None:
    """Everything a node's lowering and its engine verdict read, without its names: op,
    domain and attributes, per input its type and shape (a constant's values where small;
    where large, its type and shape for ops that only bind weights (_BINDS_WEIGHTS), else
    its name: within one plan a name is one value), which inputs are the same
    value, per output its type, shape and whether anything reads it. Two nodes with one
    key lower to the same graph up to names, so a node like one found claimable is
    claimable (refusals are not shared: their reasons name the node's values). None
    where a node reads more than this (subgraphs, tensor-valued attributes): checked
    on its own. A ViT-B/16 has 12 layers of the same nodes: 0.21 s of its warm setup
    went to lowering each node (H200 host, issue 24 item 6)."""
    if node.implicit_inputs:
        return None
    weights_by_shape = node.op_type in _BINDS_WEIGHTS and node.is_default_domain
    attrs = []
    for k in sorted(node.attrs):
        v = _plain(node.attrs[k])
        if v is _NOT_PLAIN:
            return None
        attrs.append((k, v))
    first: dict[str, int] = {}
    ins: list[Any] = []
    for pos, name in enumerate(node.inputs):
        if not name:
            ins.append(None)
            continue
        seen = first.setdefault(name, pos)
        c = og.constants.get(name)
        if c is not None:
            arr = np.asarray(c)
            if arr.size <= _KEY_CONSTANT:
                value: Any = (arr.dtype.str, arr.shape, arr.tobytes())
            else:  # a weight: where the lowering only binds it, its type and shape are what it reads
                value = ("weight", arr.dtype.str, arr.shape) if weights_by_shape else name
            ins.append(("const", seen, value))
            continue
        info = og.types.get(name)
        if info is None or not info.elem or info.shape is None:
            return None
        ins.append(("value", seen, info.elem, info.shape))
    outs: list[Any] = []
    for name in node.outputs:
        info = og.types.get(name) if name else None
        if name and (info is None or not info.elem or info.shape is None):
            return None
        outs.append(None if not name else (info.elem, info.shape, is_read(name)))  # type: ignore[union-attr]
    return (node.op_type, node.domain, tuple(attrs), tuple(ins), tuple(outs), channels_last)


__all__ = ["node_key"]
