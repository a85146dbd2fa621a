"""Shape and dtype inference of the backward (training) ops: norm backward and attention
backward, with checks that name the culprit.

Each gradient has the dims of what it is the gradient of; the saved statistics must have
the dims the forward op gives them (graph/infer.py), so that a graph can wire a forward's
``mean``/``inv_var``/``inv_rms``/``stats`` outputs straight into its backward.
"""

from __future__ import annotations

from collections.abc import Callable

from fusegraph.dtypes import DataType
from fusegraph.graph.infer_attention import attention_operands
from fusegraph.graph.infer_base import Proposal, fail, same_float_type
from fusegraph.graph.infer_norms import feature_param, norm_input, per_channel, row_stats
from fusegraph.graph.node import Node
from fusegraph.graph.ops import OpKind
from fusegraph.graph.tensor import TensorAttr


def _gradient_of(node: Node, dy: TensorAttr, x: TensorAttr) -> DataType:
    if dy.shape != x.shape:
        raise fail(
            node, f"gradient dims {list(dy.shape)} differ from the input's {list(x.shape)} ('{x.name}')", dy
        )
    dt: DataType = same_float_type(node, dy, x)
    return dt


def _row_stat(node: Node, t: TensorAttr, x: TensorAttr) -> None:
    """A saved per-row statistic of a layer/RMS norm: [N, 1, ..., 1] at x's rank."""
    want, _ = row_stats(node, x)
    if t.shape != want:
        raise fail(
            node, f"saved statistic must have dims {list(want)} (one value per row of '{x.name}'), got {list(t.shape)}", t
        )
    if not t.dtype.is_float:
        raise fail(node, f"expected a floating-point tensor, got {t.dtype.name}", t)


def _param_grads(node: Node, scale: TensorAttr, ports: tuple[str, ...]) -> Proposal:
    return {p: (scale.shape, scale.dtype) for p in ports if p in node.outputs}


def infer_layernorm_backward(node: Node) -> Proposal:
    dy, x, scale = node.inputs["dy"], node.inputs["x"], node.inputs["scale"]
    norm_input(node, x, min_rank=2)
    dt = _gradient_of(node, dy, x)
    feature_param(node, scale, x)
    for p in ("mean", "inv_var"):
        _row_stat(node, node.inputs[p], x)
    return {"dx": (x.shape, dt), **_param_grads(node, scale, ("dscale", "dbias"))}


def infer_rmsnorm_backward(node: Node) -> Proposal:
    dy, x, scale = node.inputs["dy"], node.inputs["x"], node.inputs["scale"]
    norm_input(node, x, min_rank=2)
    dt = _gradient_of(node, dy, x)
    feature_param(node, scale, x)
    _row_stat(node, node.inputs["inv_rms"], x)
    return {"dx": (x.shape, dt), **_param_grads(node, scale, ("dscale", "dbias"))}


def infer_batchnorm_backward(node: Node) -> Proposal:
    dy, x, scale = node.inputs["dy"], node.inputs["x"], node.inputs["scale"]
    norm_input(node, x, min_rank=2)
    dt = _gradient_of(node, dy, x)
    for p in ("scale", "mean", "inv_var"):
        per_channel(node, node.inputs[p], x)
    return {"dx": (x.shape, dt), **_param_grads(node, scale, ("dscale", "dbias"))}


def infer_sdpa_backward(node: Node) -> Proposal:
    q, k, v = node.inputs["q"], node.inputs["k"], node.inputs["v"]
    o_dims, dt = attention_operands(node)
    for p in ("o", "do"):
        t = node.inputs[p]
        if t.shape != o_dims:
            raise fail(node, f"'{p}' must have the forward output's dims {list(o_dims)}, got {list(t.shape)}", t)
        same_float_type(node, q, t)
    stats = node.inputs["stats"]
    want = (*q.shape[:3], 1)
    if stats.shape != want:
        raise fail(
            node, f"stats must have dims {list(want)} (the forward's log-sum-exp per query row), got {list(stats.shape)}", stats
        )
    if not stats.dtype.is_float:
        raise fail(node, f"stats must be floating-point, got {stats.dtype.name}", stats)
    return {"dq": (q.shape, dt), "dk": (k.shape, dt), "dv": (v.shape, dt)}


BACKWARD_INFER: dict[OpKind, Callable[[Node], Proposal]] = {
    OpKind.LAYERNORM_BACKWARD: infer_layernorm_backward,
    OpKind.RMSNORM_BACKWARD: infer_rmsnorm_backward,
    OpKind.BATCHNORM_BACKWARD: infer_batchnorm_backward,
    OpKind.SDPA_BACKWARD: infer_sdpa_backward,
}
