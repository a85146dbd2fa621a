"""A validated fusegraph Graph as one cuDNN frontend graph (``cudnn.pygraph``), built from
its binding (rules.py) tensor by tensor with the exact types the fusegraph graph declares
(I/O, intermediate and compute types).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from fusegraph.dtypes import DataType
from fusegraph.engines.cudnn.lower_backward import (
    BACKWARD_LOWER,
)
from fusegraph.engines.cudnn.rules import (
    DATA_TYPE,
    POINTWISE_METHOD,
    REDUCTION_MODE,
    Binding,
    Prep,
)
from fusegraph.graph.graph import Graph
from fusegraph.graph.node import Node
from fusegraph.graph.ops import (
    ConvAttrs,
    NormFwdPhase,
    OpKind,
    PointwiseAttrs,
    PointwiseMode,
    ReductionAttrs,
    SdpaAttrs,
)
from fusegraph.graph.tensor import TensorAttr

M = PointwiseMode

# ---- building the cuDNN graph ---------------------------------------------------------------
def compute_type(node: Node, graph: Graph) -> DataType:
    cd = getattr(node.attrs, "compute_data_type", None) or graph.compute_data_type
    if cd is not None:
        return cd  # type: ignore[no-any-return]
    types = [t.dtype for t in node.inputs.values() if not t.is_scalar]
    if any(t.is_float for t in types) or not types:
        return DataType.DOUBLE if all(t == DataType.DOUBLE for t in types) and types else DataType.FLOAT
    return DataType.INT32


def _strided_packed(dims: tuple[int, ...], order_like: tuple[int, ...]) -> tuple[int, ...]:
    """Packed strides for ``dims`` in the memory order of ``order_like`` (strides)."""
    order = sorted(range(len(dims)), key=lambda a: (-order_like[a], a))
    out = [0] * len(dims)
    step = 1
    for a in reversed(order):
        out[a] = step
        step *= dims[a]
    return tuple(out)


class _Builder:
    """Walks the fusegraph nodes in topological order, adding each to the cuDNN graph."""

    def __init__(self, graph: Graph, b: Binding, cudnn: Any, handle: Any) -> None:
        self.graph, self.b, self.cudnn = graph, b, cudnn
        io = graph.io_data_type or next((t.dtype for t in graph.inputs() if t.dtype.is_float), DataType.FLOAT)
        inter = graph.intermediate_data_type or DataType.FLOAT
        comp = graph.compute_data_type or DataType.FLOAT
        self.g = cudnn.pygraph(
            name=_safe(graph.name),
            io_data_type=self.dt(io),
            intermediate_data_type=self.dt(inter),
            compute_data_type=self.dt(comp),
            handle=handle,
        )
        self.t: dict[str, Any] = {}  # fusegraph tensor name -> cuDNN tensor

    def dt(self, d: DataType) -> Any:
        return getattr(self.cudnn.data_type, DATA_TYPE[d])

    def compute(self, node: Node) -> Any:
        """The node's compute type, as cuDNN's enum."""
        return _cdt(self, node)

    @staticmethod
    def name(node: Node) -> str:
        return _safe(node.name)

    def tensor(self, t: TensorAttr) -> Any:
        got = self.t.get(t.name)
        if got is not None:
            return got
        if t.is_scalar:
            uid = self.b.scalar_uid[t.name]
            r = self.b.rank
            got = self.g.tensor(dim=[1] * r, stride=[1] * r, data_type=self.dt(t.dtype), is_pass_by_value=True,
                                name=_safe(t.name), uid=uid)
        else:
            d = self.b.described[t.name]
            got = self.g.tensor(dim=list(d.dims), stride=list(d.strides), data_type=self.dt(t.dtype),
                                name=_safe(t.name), uid=self.b.uids[t.name])
        self.t[t.name] = got
        return got

    def prep_tensor(self, uid: int, dims: tuple[int, ...], name: str) -> Any:
        strides = _strided_packed(dims, tuple(range(len(dims), 0, -1)))
        return self.g.tensor(dim=list(dims), stride=list(strides), data_type=self.dt(DataType.FLOAT), name=name, uid=uid)

    def output(self, t: TensorAttr, cud: Any) -> None:
        d = self.b.described[t.name]
        cud.set_dim(list(d.dims)).set_stride(list(d.strides)).set_data_type(self.dt(t.dtype))
        if t.is_output:
            cud.set_output(True)
            cud.set_uid(self.b.uids[t.name])
        self.t[t.name] = cud

    def build(self) -> Any:
        preps = {p.node: p for p in self.b.preps}
        for node in self.graph.topological_order():
            fn = LOWER[node.kind]
            outs = fn(self, node, preps.get(node.name))
            for port, cud in outs.items():
                self.output(node.outputs[port], cud)
        return self.g


def _safe(name: str) -> str:
    return name.replace("::", "__")


def _cdt(bld: _Builder, node: Node) -> Any:
    return bld.dt(compute_type(node, bld.graph))


def _conv_kw(bld: _Builder, node: Node) -> dict[str, Any]:
    a = node.attrs
    assert isinstance(a, ConvAttrs)
    return {"pre_padding": list(a.pre_padding), "post_padding": list(a.post_padding), "stride": list(a.stride),
            "dilation": list(a.dilation), "compute_data_type": _cdt(bld, node), "name": _safe(node.name)}


def _conv_fprop(bld: _Builder, node: Node, prep: Prep | None) -> dict[str, Any]:
    y = bld.g.conv_fprop(bld.tensor(node.inputs["x"]), bld.tensor(node.inputs["w"]), **_conv_kw(bld, node))
    return {"y": y}


def _conv_dgrad(bld: _Builder, node: Node, prep: Prep | None) -> dict[str, Any]:
    dims = list(bld.b.described[node.outputs["dx"].name].dims)
    dx = bld.g.conv_dgrad(bld.tensor(node.inputs["dy"]), bld.tensor(node.inputs["w"]), out_dims=dims, **_conv_kw(bld, node))
    return {"dx": dx}


def _conv_wgrad(bld: _Builder, node: Node, prep: Prep | None) -> dict[str, Any]:
    dims = list(bld.b.described[node.outputs["dw"].name].dims)
    dw = bld.g.conv_wgrad(bld.tensor(node.inputs["x"]), bld.tensor(node.inputs["dy"]), out_dims=dims, **_conv_kw(bld, node))
    return {"dw": dw}


def _matmul(bld: _Builder, node: Node, prep: Prep | None) -> dict[str, Any]:
    c = bld.g.matmul(bld.tensor(node.inputs["a"]), bld.tensor(node.inputs["b"]), compute_data_type=_cdt(bld, node),
                     name=_safe(node.name))
    return {"c": c}


def _pointwise(bld: _Builder, node: Node, prep: Prep | None) -> dict[str, Any]:
    a = node.attrs
    assert isinstance(a, PointwiseAttrs)
    args = [bld.tensor(node.inputs[p]) for p in ("a", "b", "c") if p in node.inputs]
    kw: dict[str, Any] = {"compute_data_type": _cdt(bld, node), "name": _safe(node.name)}
    if a.mode == M.RELU_FWD:
        lower, upper, slope = a.param("relu_lower_clip"), a.param("relu_upper_clip"), a.param("relu_lower_clip_slope")
        if lower != 0.0:
            kw["lower_clip"] = lower
        if math.isfinite(upper):
            kw["upper_clip"] = upper
        if slope != 0.0:
            kw["negative_slope"] = slope
    elif a.mode == M.RELU_BWD and a.param("relu_lower_clip") != 0.0:
        kw["lower_clip"] = a.param("relu_lower_clip")
    elif a.mode == M.SWISH_FWD and a.param("swish_beta") != 1.0:
        kw["swish_beta"] = a.param("swish_beta")
    y = getattr(bld.g, POINTWISE_METHOD[a.mode])(*args, **kw)
    return {"y": y}


def _reduction(bld: _Builder, node: Node, prep: Prep | None) -> dict[str, Any]:
    a = node.attrs
    assert isinstance(a, ReductionAttrs)
    dims = list(bld.b.described[node.outputs["y"].name].dims)
    mode = getattr(bld.cudnn.reduction_mode, REDUCTION_MODE[a.mode])
    y = bld.g.reduction(bld.tensor(node.inputs["x"]), mode=mode, compute_data_type=_cdt(bld, node), name=_safe(node.name),
                        out_dims=dims)
    return {"y": y}


def _bn_inference(bld: _Builder, node: Node, prep: Prep | None) -> dict[str, Any]:
    assert prep is not None
    x = bld.tensor(node.inputs["x"])
    a = bld.prep_tensor(prep.uid_a, prep.dims, _safe(f"{node.name}__a"))
    b = bld.prep_tensor(prep.uid_b, prep.dims, _safe(f"{node.name}__b"))
    cdt = _cdt(bld, node)
    xa = bld.g.mul(x, a, compute_data_type=cdt, name=_safe(f"{node.name}__mul"))
    xa.set_data_type(bld.dt(DataType.FLOAT))
    y = bld.g.add(xa, b, compute_data_type=cdt, name=_safe(f"{node.name}__add"))
    return {"y": y}


def _phase(bld: _Builder, node: Node) -> Any:
    p = getattr(node.attrs, "phase", NormFwdPhase.INFERENCE)
    return bld.cudnn.norm_forward_phase.TRAINING if p == NormFwdPhase.TRAINING else bld.cudnn.norm_forward_phase.INFERENCE


def _layernorm(bld: _Builder, node: Node, prep: Prep | None) -> dict[str, Any]:
    ins = node.inputs
    outs = bld.g.layernorm(bld.tensor(ins["x"]), bld.tensor(ins["scale"]), bld.tensor(ins["bias"]), bld.tensor(ins["epsilon"]),
                           norm_forward_phase=_phase(bld, node), compute_data_type=_cdt(bld, node), name=_safe(node.name))
    y, mean, inv = ([*outs, None, None])[:3] if isinstance(outs, list) else (outs, None, None)
    res = {"y": y}
    if "mean" in node.outputs:
        res["mean"], res["inv_var"] = mean, inv
    return res


def _rmsnorm(bld: _Builder, node: Node, prep: Prep | None) -> dict[str, Any]:
    ins = node.inputs
    bias = bld.tensor(ins["bias"]) if "bias" in ins else None
    outs = bld.g.rmsnorm(bld.tensor(ins["x"]), bld.tensor(ins["scale"]), bias, bld.tensor(ins["epsilon"]),
                         norm_forward_phase=_phase(bld, node), compute_data_type=_cdt(bld, node), name=_safe(node.name))
    y, inv = ([*outs, None])[:2] if isinstance(outs, list) else (outs, None)
    res = {"y": y}
    if "inv_rms" in node.outputs:
        res["inv_rms"] = inv
    return res


def _batchnorm(bld: _Builder, node: Node, prep: Prep | None) -> dict[str, Any]:
    ins = node.inputs
    outs = bld.g.batchnorm(bld.tensor(ins["x"]), bld.tensor(ins["scale"]), bld.tensor(ins["bias"]),
                           epsilon=bld.tensor(ins["epsilon"]), compute_data_type=_cdt(bld, node), name=_safe(node.name))
    y, mean, inv = outs[:3]
    return {"y": y, "mean": mean, "inv_var": inv}


def _sdpa(bld: _Builder, node: Node, prep: Prep | None) -> dict[str, Any]:
    a = node.attrs
    assert isinstance(a, SdpaAttrs)
    q = node.inputs["q"]
    scale = a.attn_scale if a.attn_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    stats = "stats" in node.outputs  # the log-sum-exp sdpa_backward reads (cuDNN's Stats, float32)
    kw: dict[str, Any] = {"attn_scale": float(scale), "generate_stats": stats, "use_causal_mask": bool(a.causal),
                          "compute_data_type": _cdt(bld, node), "name": _safe(node.name)}
    if "mask" in node.inputs:
        kw["bias"] = bld.tensor(node.inputs["mask"])
    outs = bld.g.sdpa(bld.tensor(q), bld.tensor(node.inputs["k"]), bld.tensor(node.inputs["v"]), **kw)
    o = outs[0] if isinstance(outs, list | tuple) else outs
    return {"o": o, "stats": outs[1]} if stats else {"o": o}


Lowering = Callable[[_Builder, Node, Prep | None], dict[str, Any]]
LOWER: dict[OpKind, Lowering] = {
    OpKind.CONV_FPROP: _conv_fprop,
    OpKind.CONV_DGRAD: _conv_dgrad,
    OpKind.CONV_WGRAD: _conv_wgrad,
    OpKind.MATMUL: _matmul,
    OpKind.POINTWISE: _pointwise,
    OpKind.REDUCTION: _reduction,
    OpKind.BATCHNORM_INFERENCE: _bn_inference,
    OpKind.BATCHNORM: _batchnorm,
    OpKind.LAYERNORM: _layernorm,
    OpKind.RMSNORM: _rmsnorm,
    OpKind.SDPA: _sdpa,
    **BACKWARD_LOWER,
}


def lower(graph: Graph, b: Binding, cudnn: Any, handle: Any) -> Any:
    """The cuDNN pygraph of ``graph`` (not validated or planned yet)."""
    return _Builder(graph, b, cudnn, handle).build()
