"""Runs a validated graph node by node in float64 (bool stays bool)."""

from __future__ import annotations

from typing import Any

import numpy as np

from fusegraph.dtypes import DataType
from fusegraph.errors import ExecutionError
from fusegraph.reference.ops import REFERENCE


def as_float64(arr: np.ndarray) -> np.ndarray:
    if arr.dtype == np.bool_:
        return np.asarray(arr)
    return np.asarray(arr, dtype=np.float64)


def cast_to(values: np.ndarray, dt: DataType) -> np.ndarray:
    if dt == DataType.BOOLEAN:
        return np.asarray(values).astype(np.bool_)
    if dt.is_integer:
        return np.asarray(np.trunc(values)).astype(dt.numpy)
    return np.asarray(values).astype(dt.numpy)


def run_reference(graph: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Float64 values of every graph output (not yet cast), by name."""
    env: dict[int, np.ndarray] = {}
    for t in graph.tensors:
        if t.is_scalar:
            # The constant as its declared type holds it (an engine sees no more than that).
            env[id(t)] = as_float64(np.full((1,), t.value, dtype=t.dtype.numpy))
        elif t.name in inputs:
            env[id(t)] = as_float64(inputs[t.name])
    for node in graph.topological_order():
        ins = {p: env[id(t)] for p, t in node.inputs.items()}
        try:
            outs = REFERENCE[node.kind](node, ins)
        except Exception as exc:  # a bug or a numeric domain error: say where
            raise ExecutionError(f"reference {node.kind.value} failed: {exc}", node=node.name) from exc
        for port, value in outs.items():
            # Intermediates stay in float64: the reference is the exact answer.
            env[id(node.outputs[port])] = value
    return {t.name: env[id(t)] for t in graph.outputs()}
