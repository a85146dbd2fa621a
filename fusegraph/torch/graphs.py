"""The fusegraph graphs behind the autograd functions: for each fused pattern, its forward
and its backward as graphs of the op table, built from a signature (shapes, strides,
dtypes and the pattern's settings) -- never from tensors, so that one signature is one
graph, built once and cached (fusegraph/torch/plans.py).

Inputs are declared with the strides the caller's tensors have (channels-last stays
channels-last; an expanded gradient keeps its zero strides), so no copy is made to fit
a declared layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from fusegraph.dtypes import DataType
from fusegraph.graph.graph import Graph
from fusegraph.graph.ops import NormFwdPhase, PointwiseMode, ReductionMode
from fusegraph.graph.tensor import TensorAttr


@dataclass(frozen=True)
class TSpec:
    """A tensor as a graph declares it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: DataType


# activation name -> (forward mode, backward mode: (dy, pre-activation) -> dz)
ACTIVATIONS: dict[str, tuple[PointwiseMode | None, PointwiseMode | None]] = {
    "none": (None, None),
    "relu": (PointwiseMode.RELU_FWD, PointwiseMode.RELU_BWD),
    "gelu": (PointwiseMode.GELU_FWD, PointwiseMode.GELU_BWD),
    "gelu_tanh": (PointwiseMode.GELU_APPROX_TANH_FWD, getattr(PointwiseMode, "GELU_APPROX_TANH_BWD", None)),
    "tanh": (PointwiseMode.TANH_FWD, PointwiseMode.TANH_BWD),
    "sigmoid": (PointwiseMode.SIGMOID_FWD, PointwiseMode.SIGMOID_BWD),
    "silu": (PointwiseMode.SWISH_FWD, getattr(PointwiseMode, "SWISH_BWD", None)),
}


def saves_preactivation(act: str) -> bool:
    """ReLU's backward reads its output as well as its input (positive exactly where the
    input is): only other activations keep the pre-activation for the backward."""
    return act not in ("none", "relu")


def _compute(dtype: DataType) -> DataType | None:
    return DataType.FLOAT if dtype in (DataType.HALF, DataType.BFLOAT16) else None


def _graph(name: str, dtype: DataType) -> Graph:
    return Graph(name, io_data_type=dtype, intermediate_data_type=dtype, compute_data_type=_compute(dtype))


def _input(g: Graph, name: str, s: TSpec) -> TensorAttr:
    return g.tensor(name, list(s.shape), list(s.stride), s.dtype)


def _out(t: TensorAttr | None, name: str) -> None:
    assert t is not None
    t.set_output(True).set_name(name)


def _activate(g: Graph, z: TensorAttr, act: str) -> TensorAttr:
    mode = ACTIVATIONS[act][0]
    return z if mode is None else g.pointwise(z, mode=mode)


def _dact(g: Graph, dy: TensorAttr, saved: TensorAttr | None, act: str) -> TensorAttr:
    mode = ACTIVATIONS[act][1]
    if act == "none":
        return dy
    if mode is None:
        raise NotImplementedError(f"no backward mode for activation '{act}' in the op table")
    assert saved is not None
    return g.pointwise(dy, saved, mode=mode)


# ---- convolution + bias + activation -------------------------------------------------------------
@dataclass(frozen=True)
class ConvSig:
    x: TSpec
    w: TSpec
    bias: bool
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    act: str


def conv_forward(sig: ConvSig) -> Graph:
    """y = act(conv(x, w) + b); also ``z`` (the pre-activation) where the backward needs it."""
    g = _graph("torch.conv_bias_act", sig.x.dtype)
    x, w = _input(g, "x", sig.x), _input(g, "w", sig.w)
    z = g.conv_fprop(x, w, padding=list(sig.padding), stride=list(sig.stride), dilation=list(sig.dilation))
    if sig.bias:
        k = sig.w.shape[0]
        z = g.add(z, g.tensor("b", [1, k] + [1] * (len(sig.x.shape) - 2), None, sig.x.dtype))
    y = _activate(g, z, sig.act)
    _out(y, "y")
    if saves_preactivation(sig.act):
        _out(z, "z")
    return g.validate()


def conv_backward(sig: ConvSig, dy: TSpec, saved: TSpec, needs: tuple[bool, bool, bool]) -> Graph:
    """(dx, dw, db) from dy and what the forward saved (z, or y for ReLU); only those
    ``needs`` asks for."""
    g = _graph("torch.conv_bias_act.backward", sig.x.dtype)
    grad = _input(g, "dy", dy)
    s = _input(g, "saved", saved) if sig.act != "none" else None
    dz = _dact(g, grad, s, sig.act)
    pads, strides, dil = list(sig.padding), list(sig.stride), list(sig.dilation)
    if needs[0]:
        dx = g.conv_dgrad(dz, _input(g, "w", sig.w), padding=pads, stride=strides, dilation=dil)
        dx.set_dim(list(sig.x.shape))
        _out(dx, "dx")
    if needs[1]:
        dw = g.conv_wgrad(_input(g, "x", sig.x), dz, padding=pads, stride=strides, dilation=dil)
        dw.set_dim(list(sig.w.shape))
        _out(dw, "dw")
    if needs[2] and sig.bias:
        k = sig.w.shape[0]
        _out(g.reduction(dz, ReductionMode.SUM, [1, k] + [1] * (len(sig.x.shape) - 2)), "db")
    return g.validate()


# ---- linear + bias + activation ----------------------------------------------------------------------
@dataclass(frozen=True)
class LinearSig:
    x: TSpec  # [M, K]
    w: TSpec  # [N, K], as nn.Linear keeps it
    bias: bool
    act: str


def _wt(s: TSpec) -> TSpec:
    """The [N, K] weight read as the [K, N] operand (a transposed view, no copy)."""
    return TSpec((s.shape[1], s.shape[0]), (s.stride[1], s.stride[0]), s.dtype)


def linear_forward(sig: LinearSig) -> Graph:
    g = _graph("torch.linear_bias_act", sig.x.dtype)
    z = g.matmul(_input(g, "x", sig.x), _input(g, "wt", _wt(sig.w)))
    if sig.bias:
        z = g.add(z, g.tensor("b", [1, sig.w.shape[0]], None, sig.x.dtype))
    _out(_activate(g, z, sig.act), "y")
    if saves_preactivation(sig.act):
        _out(z, "z")
    return g.validate()


def linear_backward(sig: LinearSig, dy: TSpec, saved: TSpec, needs: tuple[bool, bool, bool]) -> Graph:
    g = _graph("torch.linear_bias_act.backward", sig.x.dtype)
    grad = _input(g, "dy", dy)
    s = _input(g, "saved", saved) if sig.act != "none" else None
    dz = _dact(g, grad, s, sig.act)
    if needs[0]:
        _out(g.matmul(dz, _input(g, "w", sig.w)), "dx")
    if needs[1]:
        _out(g.matmul(g.transpose(dz, [1, 0]), _input(g, "x", sig.x)), "dw")
    if needs[2] and sig.bias:
        _out(g.reduction(dz, ReductionMode.SUM, [1, sig.w.shape[0]]), "db")
    return g.validate()


# ---- layernorm / rmsnorm ------------------------------------------------------------------------------
@dataclass(frozen=True)
class NormSig:
    kind: str  # "layernorm" | "rmsnorm"
    x: TSpec  # [rows, features]
    eps: float
    bias: bool  # rmsnorm only: layernorm always has one (ones/zeros where the module has none)


def norm_forward(sig: NormSig) -> Graph:
    """(y, mean, inv_var) for layernorm, (y, inv_rms) for rmsnorm: the training form,
    whose statistics the backward reads."""
    g = _graph(f"torch.{sig.kind}", sig.x.dtype)
    f = sig.x.shape[1]
    x = _input(g, "x", sig.x)
    scale = g.tensor("scale", [1, f], None, sig.x.dtype)
    if sig.kind == "layernorm":
        y, mean, inv = g.layernorm(x, scale, g.tensor("bias", [1, f], None, sig.x.dtype), sig.eps,
                                   NormFwdPhase.TRAINING)
        _out(mean, "mean")
    else:
        bias = g.tensor("bias", [1, f], None, sig.x.dtype) if sig.bias else None
        y, inv = g.rmsnorm(x, scale, sig.eps, NormFwdPhase.TRAINING, bias=bias)
    _out(y, "y")
    _out(inv, "inv")
    return g.validate()


def norm_backward(sig: NormSig, dy: TSpec, stats: TSpec) -> Graph:
    g = _graph(f"torch.{sig.kind}.backward", sig.x.dtype)
    f = sig.x.shape[1]
    grad, x = _input(g, "dy", dy), _input(g, "x", sig.x)
    scale = g.tensor("scale", [1, f], None, sig.x.dtype)
    inv = _input(g, "inv", stats)
    dbias: TensorAttr | None
    if sig.kind == "layernorm":
        dx, dscale, dbias = g.layernorm_backward(grad, x, scale, _input(g, "mean", stats), inv)
    else:
        dx, dscale, dbias = g.rmsnorm_backward(grad, x, scale, inv, has_dbias=sig.bias)
    _out(dx, "dx")
    _out(dscale, "dscale")
    if dbias is not None:
        _out(dbias, "dbias")
    return g.validate()


# ---- attention --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionSig:
    q: TSpec  # [batch, heads, seq, dim]
    k: TSpec
    v: TSpec
    scale: float
    causal: bool


def attention_forward(sig: AttentionSig) -> Graph:
    g = _graph("torch.attention", sig.q.dtype)
    o, stats = g.sdpa(_input(g, "q", sig.q), _input(g, "k", sig.k), _input(g, "v", sig.v), sig.scale, sig.causal,
                      generate_stats=True)
    _out(o, "o")
    _out(stats, "stats")
    return g.validate()


def attention_backward(sig: AttentionSig, o: TSpec, do: TSpec, stats: TSpec) -> Graph:
    g = _graph("torch.attention.backward", sig.q.dtype)
    dq, dk, dv = g.sdpa_backward(
        _input(g, "q", sig.q), _input(g, "k", sig.k), _input(g, "v", sig.v), _input(g, "o", o),
        _input(g, "do", do), _input(g, "stats", stats), sig.scale, sig.causal,
    )
    _out(dq, "dq")
    _out(dk, "dk")
    _out(dv, "dv")
    return g.validate()
