"""Shape and dtype inference of the forward norms (batchnorm in inference and training,
layernorm, RMSNorm), with checks that name the culprit. The per-row and per-channel checks
are shared with their backward ops (infer_backward.py), which take the statistics these
produce."""

from __future__ import annotations

import math
from collections.abc import Callable

from fusegraph.dtypes import DataType
from fusegraph.graph.infer_base import (
    Dims,
    Proposal,
    broadcast_dims,
    fail,
    stats_dtype,
)
from fusegraph.graph.node import Node
from fusegraph.graph.ops import OpKind
from fusegraph.graph.tensor import TensorAttr


def per_channel(node: Node, t: TensorAttr, x: TensorAttr) -> None:
    c = x.shape[1]
    ok_rank1 = t.shape == (c,)
    ok_full = len(t.shape) == len(x.shape) and t.shape[1] == c and math.prod(t.shape) == c
    if not (ok_rank1 or ok_full):
        raise fail(
            node,
            f"expected per-channel dims [{c}] or [1, {c}, 1, ...], got {list(t.shape)}",
            t,
        )
    if not t.dtype.is_float:
        raise fail(node, f"expected a floating-point tensor, got {t.dtype.name}", t)


def _epsilon(node: Node) -> None:
    eps = node.inputs["epsilon"]
    if math.prod(eps.shape) != 1 or not eps.dtype.is_float:
        raise fail(node, f"epsilon must be one floating-point value, got {list(eps.shape)} {eps.dtype.name}", eps)
    value = eps.value
    if isinstance(value, int | float) and not (math.isfinite(value) and value >= 0.0):
        # NaN makes every y NaN, +inf makes it 0, a negative one takes sqrt of a negative
        raise fail(node, f"epsilon must be finite and >= 0, got {value}", eps)



def infer_batchnorm_inference(node: Node) -> Proposal:
    x = node.inputs["x"]
    norm_input(node, x, min_rank=2)
    for p in ("scale", "bias", "mean", "var"):
        per_channel(node, node.inputs[p], x)
    _epsilon(node)
    return {"y": (x.shape, x.dtype)}


_RUNNING = ("in_running_mean", "in_running_var", "momentum")
_NEXT_RUNNING = ("next_running_mean", "next_running_var")


def infer_batchnorm(node: Node) -> Proposal:
    x = node.inputs["x"]
    norm_input(node, x, min_rank=2)
    for p in ("scale", "bias"):
        per_channel(node, node.inputs[p], x)
    _epsilon(node)
    stats = (1, x.shape[1]) + (1,) * (len(x.shape) - 2)
    sdt = stats_dtype(x.dtype)
    out: Proposal = {"y": (x.shape, x.dtype), "mean": (stats, sdt), "inv_var": (stats, sdt)}
    given = [p for p in _RUNNING if p in node.inputs]
    made = [p for p in _NEXT_RUNNING if p in node.outputs]
    if given and (len(given) != len(_RUNNING) or len(made) != len(_NEXT_RUNNING)):
        raise fail(
            node,
            "running statistics need in_running_mean, in_running_var and momentum together "
            f"(got {given}) and produce next_running_mean and next_running_var (got {made})",
        )
    if made and not given:
        raise fail(node, f"{made} need the inputs in_running_mean, in_running_var and momentum")
    if given:
        if math.prod(x.shape) // x.shape[1] < 2:
            raise fail(node, "running statistics need more than one value per channel (the variance is unbiased)", x)
        for p, q in zip(("in_running_mean", "in_running_var"), _NEXT_RUNNING, strict=True):
            t = node.inputs[p]
            per_channel(node, t, x)
            out[q] = (t.shape, t.dtype)
        m = node.inputs["momentum"]
        if math.prod(m.shape) != 1 or not m.dtype.is_float:
            raise fail(node, f"momentum must be one floating-point value, got {list(m.shape)} {m.dtype.name}", m)
        if isinstance(m.value, int | float) and not (math.isfinite(m.value) and 0.0 <= m.value <= 1.0):
            raise fail(node, f"momentum must be in [0, 1], got {m.value}", m)
    return out


def norm_input(node: Node, x: TensorAttr, min_rank: int) -> None:
    if len(x.shape) < min_rank:
        raise fail(node, f"input needs rank >= {min_rank}, got {list(x.shape)}", x)
    if not x.dtype.is_float:
        raise fail(node, f"expected a floating-point input, got {x.dtype.name}", x)


def feature_param(node: Node, t: TensorAttr, x: TensorAttr) -> None:
    feat = (1, *x.shape[1:])
    if len(t.shape) > len(feat) or broadcast_dims([t.shape, feat]) != feat:
        raise fail(
            node,
            f"expected dims that broadcast to {list(feat)} (one value per normalized element), "
            f"got {list(t.shape)}",
            t,
        )
    if not t.dtype.is_float:
        raise fail(node, f"expected a floating-point tensor, got {t.dtype.name}", t)


def row_stats(node: Node, x: TensorAttr) -> tuple[Dims, DataType]:
    return (x.shape[0],) + (1,) * (len(x.shape) - 1), stats_dtype(x.dtype)


def infer_layernorm(node: Node) -> Proposal:
    x = node.inputs["x"]
    norm_input(node, x, min_rank=2)
    feature_param(node, node.inputs["scale"], x)
    feature_param(node, node.inputs["bias"], x)
    _epsilon(node)
    out: Proposal = {"y": (x.shape, x.dtype)}
    for p in ("mean", "inv_var"):
        if p in node.outputs:
            out[p] = row_stats(node, x)
    return out


def infer_rmsnorm(node: Node) -> Proposal:
    x = node.inputs["x"]
    norm_input(node, x, min_rank=2)
    feature_param(node, node.inputs["scale"], x)
    if "bias" in node.inputs:
        feature_param(node, node.inputs["bias"], x)
    _epsilon(node)
    out: Proposal = {"y": (x.shape, x.dtype)}
    if "inv_rms" in node.outputs:
        out["inv_rms"] = row_stats(node, x)
    return out


NORM_INFER: dict[OpKind, Callable[[Node], Proposal]] = {
    OpKind.BATCHNORM_INFERENCE: infer_batchnorm_inference,
    OpKind.BATCHNORM: infer_batchnorm,
    OpKind.LAYERNORM: infer_layernorm,
    OpKind.RMSNORM: infer_rmsnorm,
}
