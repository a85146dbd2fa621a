"""The backward (training) ops given to cuDNN's frontend: layer, RMS and batch norm backward
(``layernorm_backward``, ``rmsnorm_backward``, ``batchnorm_backward``) and attention
backward (``sdpa_backward``), each its cuDNN graph alone. rules.py describes their tensors
(norm backward as its forward: layer/RMS at rank 4 with unit dims appended, row-major;
batch norm's per-channel tensors as [1, C, 1, ...], its images row-major or channels-last;
attention backward at [b, h, s, d], row-major or heads-interleaved) and calls the lowerings
here through its LOWER table.

Pure Python: the refusal rules run on machines without cuDNN."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from fusegraph.dtypes import DataType
from fusegraph.graph.graph import Graph
from fusegraph.graph.node import Node
from fusegraph.graph.ops import BACKWARD, OpKind, SdpaAttrs

# Layer and RMS norm backward: described as their forwards are (rank 4, unit dims appended).
NORM_BACKWARD_LOWERED = frozenset({OpKind.LAYERNORM_BACKWARD, OpKind.RMSNORM_BACKWARD})

# the saved statistics each backward op reads (cuDNN reads them as float32, as its forwards write them)
SAVED_STATS: dict[OpKind, tuple[str, ...]] = {
    OpKind.LAYERNORM_BACKWARD: ("mean", "inv_var"),
    OpKind.BATCHNORM_BACKWARD: ("mean", "inv_var"),
    OpKind.RMSNORM_BACKWARD: ("inv_rms",),
    OpKind.SDPA_BACKWARD: ("stats",),
}


def backward_refusal(graph: Graph) -> str | None:
    """Why a graph holding a backward op, or an sdpa writing the statistics its backward
    reads, cannot go to cuDNN, or None. Those statistics are a float32 graph output; a
    backward op is its cuDNN graph alone (no fused neighbours: none were checked on the
    GPU), its saved statistics are float32, and every gradient it makes is a graph output
    (cuDNN writes them all)."""
    for n in graph.nodes:
        st = n.outputs.get("stats") if n.kind == OpKind.SDPA else None
        if st is not None and (not st.is_output or st.dtype != DataType.FLOAT):
            return (f"node '{n.name}' (sdpa): its statistics '{st.name}' must be a float32 graph output "
                    f"(cuDNN writes its Stats as float32 and needs their memory), got {st.dtype.name}"
                    f"{'' if st.is_output else ', not an output'}")
    back = [n for n in graph.nodes if n.kind in BACKWARD]
    if not back:
        return None
    node = back[0]

    def why(text: str) -> str:
        return f"node '{node.name}' ({node.kind.value}): {text}"

    if len(graph.nodes) > 1:
        others = sorted({n.kind.value for n in graph.nodes if n is not node})
        return why(f"a backward op is given to cuDNN alone, without fused neighbours (the graph also holds {others}); "
                   "split the graph")
    for port in SAVED_STATS.get(node.kind, ()):
        t = node.inputs[port]
        if t.dtype != DataType.FLOAT:
            return why(f"saved statistic '{port}' is {t.dtype.name}: cuDNN reads its statistics as float32 "
                       "(as its forward writes them)")
    unwritten = [p for p, t in node.outputs.items() if not t.is_output]
    if unwritten:
        return why(f"gradient(s) {unwritten} are not graph outputs: cuDNN writes every gradient of "
                   f"{node.kind.value} and needs its memory")
    return None


def _layernorm_backward(bld: Any, node: Node, prep: object) -> dict[str, Any]:
    ins = node.inputs
    dx, dscale, dbias = bld.g.layernorm_backward(
        bld.tensor(ins["dy"]), bld.tensor(ins["x"]), bld.tensor(ins["scale"]), bld.tensor(ins["mean"]),
        bld.tensor(ins["inv_var"]), compute_data_type=bld.compute(node), name=bld.name(node))
    return {"dx": dx, "dscale": dscale, "dbias": dbias}


def _rmsnorm_backward(bld: Any, node: Node, prep: object) -> dict[str, Any]:
    ins = node.inputs
    has_dbias = "dbias" in node.outputs
    dx, dscale, dbias = bld.g.rmsnorm_backward(
        bld.tensor(ins["dy"]), bld.tensor(ins["x"]), bld.tensor(ins["scale"]), bld.tensor(ins["inv_rms"]),
        has_dbias, compute_data_type=bld.compute(node), name=bld.name(node))
    return {"dx": dx, "dscale": dscale, **({"dbias": dbias} if has_dbias else {})}


def _batchnorm_backward(bld: Any, node: Node, prep: object) -> dict[str, Any]:
    """Batch norm backward from the saved per-channel mean and inverse variance (one GPU:
    no peer statistics)."""
    ins = node.inputs
    dx, dscale, dbias = bld.g.batchnorm_backward(
        bld.tensor(ins["dy"]), bld.tensor(ins["x"]), bld.tensor(ins["scale"]), bld.tensor(ins["mean"]),
        bld.tensor(ins["inv_var"]), peer_stats=[], compute_data_type=bld.compute(node), name=bld.name(node))
    return {"dx": dx, "dscale": dscale, "dbias": dbias}


def _sdpa_backward(bld: Any, node: Node, prep: object) -> dict[str, Any]:
    """dQ, dK, dV from the forward's output and log-sum-exp statistics (cuDNN's ``Stats``
    is the same quantity, [b, h_q, s_q, 1] float32); grouped-query heads as the forward's,
    the causal mask top-left aligned as fusegraph's."""
    a = node.attrs
    assert isinstance(a, SdpaAttrs)
    ins = node.inputs
    q = ins["q"]
    scale = a.attn_scale if a.attn_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    kw: dict[str, Any] = {"attn_scale": float(scale), "use_causal_mask": bool(a.causal),
                          "compute_data_type": bld.compute(node), "name": bld.name(node)}
    if "mask" in ins:
        kw["bias"] = bld.tensor(ins["mask"])
    dq, dk, dv = bld.g.sdpa_backward(bld.tensor(q), bld.tensor(ins["k"]), bld.tensor(ins["v"]), bld.tensor(ins["o"]),
                                     bld.tensor(ins["do"]), bld.tensor(ins["stats"]), **kw)
    return {"dq": dq, "dk": dk, "dv": dv}


BACKWARD_LOWER: dict[OpKind, Callable[[Any, Node, Any], dict[str, Any]]] = {
    OpKind.LAYERNORM_BACKWARD: _layernorm_backward,
    OpKind.RMSNORM_BACKWARD: _rmsnorm_backward,
    OpKind.BATCHNORM_BACKWARD: _batchnorm_backward,
    OpKind.SDPA_BACKWARD: _sdpa_backward,
}
