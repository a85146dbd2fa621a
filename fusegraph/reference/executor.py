"""Runs a validated graph node by node in float64 (bool stays bool)."""

from __future__ import annotations

from typing import Any

import numpy as np

from fusegraph.dtypes import DataType
from fusegraph.errors import ExecutionError, FusegraphError
from fusegraph.reference.ops import REFERENCE

# Ports read as the integers given, not as float64 (validation makes them graph inputs or constants).
EXACT_PORTS = frozenset({"seed", "offset", "indices"})


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


def run_reference(graph: Any, inputs: dict[str, np.ndarray], *, materialize: bool = False) -> dict[str, np.ndarray]:
    """Float64 values of every graph output (not yet cast), by name.

    ``materialize``: every computed tensor that a node reads -- a graph output, or a
    virtual tensor -- is rounded to its own dtype before that node reads it: what an engine
    computes when it stores the tensor at its declared type and reads it back. The exact
    answer (the default) keeps it in float64, and where the reader cancels (the average of
    a bfloat16 layernorm output whose values sum to ~0; the batch-norm mean of a bfloat16
    dgrad result) the two differ by far more than any tolerance; an engine is right if it
    matches either."""
    env: dict[int, np.ndarray] = {}
    exact: dict[int, np.ndarray] = {}  # integer inputs as given: a dropout seed is 64 bits
    for t in graph.tensors:
        if t.is_scalar:
            # The constant as its declared type holds it (an engine sees no more than that).
            held = np.full((1,), t.value, dtype=t.dtype.numpy)
        elif t.name in inputs:
            held = np.asarray(inputs[t.name])
        else:
            continue
        env[id(t)] = as_float64(held)
        if held.dtype.kind in "iu":
            exact[id(t)] = held
    read = {id(t) for n in graph.nodes for t in n.inputs.values()} if materialize else set()
    for node in graph.topological_order():
        ins = {p: exact[id(t)] if p in EXACT_PORTS and id(t) in exact else env[id(t)] for p, t in node.inputs.items()}
        try:
            outs = REFERENCE[node.kind](node, ins)
        except FusegraphError:
            raise  # already typed and placed (an out-of-range gather index names its tensor)
        except Exception as exc:  # a bug or a numeric domain error: say where
            raise ExecutionError(f"reference {node.kind.value} failed: {exc}", node=node.name) from exc
        for port, value in outs.items():
            t = node.outputs[port]
            if id(t) in read and t.dtype != DataType.DOUBLE:
                value = as_float64(cast_to(value, t.dtype))
            # Intermediates stay in float64 otherwise: the reference is the exact answer.
            env[id(t)] = value
    return {t.name: env[id(t)] for t in graph.outputs()}


def reads_a_rounded_value(graph: Any) -> bool:
    """Whether a node reads a computed tensor narrower than float64 (where ``materialize``
    can change the answer)."""
    return any(t.producer is not None and t.dtype != DataType.DOUBLE for n in graph.nodes for t in n.inputs.values())
