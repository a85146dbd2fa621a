"""Norm backward ops in float64, written from the definition of their forward.

Every norm computes xhat = (x - mean) * inv (RMS norm: xhat = x * inv) over its groups and
y = xhat * scale + bias. Given dy and the saved statistics, with g = dy * scale:

* dbias = the sum of dy, and dscale = the sum of dy * xhat, over the axes along which
  scale (bias) is broadcast;
* dx = inv * (g - mean(g) - xhat * mean(g * xhat)), the means taken over each group (RMS
  norm has no mean to subtract: dx = inv * (g - xhat * mean(g * xhat))).

Layer and RMS norms group every axis but the first (one group per row); batch norm groups
the batch and spatial axes (one group per channel). The statistics are the saved ones
(the forward's), as cuDNN takes them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fusegraph.graph.node import Node
from fusegraph.graph.ops import OpKind

Arr = np.ndarray
Arrays = dict[str, Arr]


def sum_to(a: Arr, shape: tuple[int, ...]) -> Arr:
    """``a`` summed over the axes along which an array of ``shape`` broadcasts to it."""
    lead = a.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, d in enumerate(shape) if d == 1 and a.shape[lead + i] != 1
    )
    return np.sum(a, axis=axes, keepdims=True).reshape(shape)  # type: ignore[no-any-return]


def _channel(v: Arr, rank: int) -> Arr:
    return v.reshape((1, -1) + (1,) * (rank - 2))


def _param_grads(node: Node, dy: Arr, xhat: Arr, shape: tuple[int, ...]) -> Arrays:
    out = {"dscale": sum_to(dy * xhat, shape)}
    if "dbias" in node.outputs:
        out["dbias"] = sum_to(dy, shape)
    return out


def _dx(g: Arr, xhat: Arr, inv: Arr, axes: tuple[int, ...], centred: bool) -> Arr:
    proj = xhat * np.mean(g * xhat, axis=axes, keepdims=True)
    if centred:
        return inv * (g - np.mean(g, axis=axes, keepdims=True) - proj)  # type: ignore[no-any-return]
    return inv * (g - proj)  # type: ignore[no-any-return]


def layernorm_backward(node: Node, ins: Arrays) -> Arrays:
    dy, x, scale = ins["dy"], ins["x"], ins["scale"]
    xhat = (x - ins["mean"]) * ins["inv_var"]
    axes = tuple(range(1, x.ndim))
    dx = _dx(dy * scale, xhat, ins["inv_var"], axes, centred=True)
    return {"dx": dx, **_param_grads(node, dy, xhat, scale.shape)}


def rmsnorm_backward(node: Node, ins: Arrays) -> Arrays:
    dy, x, scale = ins["dy"], ins["x"], ins["scale"]
    xhat = x * ins["inv_rms"]
    axes = tuple(range(1, x.ndim))
    dx = _dx(dy * scale, xhat, ins["inv_rms"], axes, centred=False)
    return {"dx": dx, **_param_grads(node, dy, xhat, scale.shape)}


def batchnorm_backward(node: Node, ins: Arrays) -> Arrays:
    dy, x, scale = ins["dy"], ins["x"], ins["scale"]
    r = x.ndim
    inv = _channel(ins["inv_var"], r)
    xhat = (x - _channel(ins["mean"], r)) * inv
    axes = (0, *range(2, r))
    dx = _dx(dy * _channel(scale, r), xhat, inv, axes, centred=True)
    grads = _param_grads(node, dy, xhat, (1, x.shape[1]) + (1,) * (r - 2))
    return {"dx": dx, **{p: g.reshape(scale.shape) for p, g in grads.items()}}


NORM_BACKWARD: dict[OpKind, Callable[[Node, Arrays], Arrays]] = {
    OpKind.LAYERNORM_BACKWARD: layernorm_backward,
    OpKind.RMSNORM_BACKWARD: rmsnorm_backward,
    OpKind.BATCHNORM_BACKWARD: batchnorm_backward,
}
