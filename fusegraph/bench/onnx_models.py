"""Each family's computation as an ONNX model, for the ONNX Runtime baseline.

Inputs carry the fusegraph graph's input names and logical (N, C, ...) order; ONNX has no
strides, so a channels-last fusegraph input reaches ONNX Runtime as the same values in
NCHW order (ONNX Runtime picks its own internal layout). Attention and RMS norm are written
out from their definitions (MatMul, Softmax; ReduceMean, Sqrt), as exporters emit them for
an opset without a fused operator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fusegraph.dtypes import DataType

if TYPE_CHECKING:
    from fusegraph.bench.cases import ConvShape
    from fusegraph.graph.graph import Graph

OPSET = 20  # Gelu and LayerNormalization are standard operators from here


def _onnx_type(dt: DataType) -> int:
    from onnx import TensorProto

    table = {DataType.FLOAT: TensorProto.FLOAT, DataType.HALF: TensorProto.FLOAT16,
             DataType.BFLOAT16: TensorProto.BFLOAT16, DataType.BOOLEAN: TensorProto.BOOL,
             DataType.DOUBLE: TensorProto.DOUBLE}
    if dt not in table:
        raise ValueError(f"no ONNX type for {dt}")
    return table[dt]


def _model(nodes: list[Any], name: str, inputs: list[tuple[str, DataType, list[int]]],
           output: tuple[str, DataType, list[int]], inits: list[Any] | None = None) -> Any:
    from onnx import helper

    graph = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info(n, _onnx_type(dt), dims) for n, dt, dims in inputs],
        [helper.make_tensor_value_info(output[0], _onnx_type(output[1]), output[2])],
        inits or [],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=9)


def _activation(act: str, x: str, y: str) -> list[Any]:
    """Nodes computing y = act(x)."""
    from onnx import helper

    simple = {"relu": "Relu", "tanh": "Tanh", "sigmoid": "Sigmoid", "elu": "Elu", "leaky_relu": "LeakyRelu"}
    if act == "none":
        return [helper.make_node("Identity", [x], [y])]
    if act in simple:
        return [helper.make_node(simple[act], [x], [y])]
    if act == "gelu":
        return [helper.make_node("Gelu", [x], [y])]
    if act == "gelu_tanh":
        return [helper.make_node("Gelu", [x], [y], approximate="tanh")]
    if act == "silu":
        return [helper.make_node("Sigmoid", [x], [f"{y}_sig"]), helper.make_node("Mul", [x, f"{y}_sig"], [y])]
    raise ValueError(f"no ONNX form of activation {act!r}")


def conv_model(s: ConvShape, direction: str, dt: DataType, bias: bool, act: str) -> Any:
    from onnx import helper

    attrs: dict[str, Any] = {"pads": list(s.pad) * 2, "strides": list(s.stride), "dilations": list(s.dilation), "group": s.groups}
    if direction == "fwd":
        ins = ["x", "w"] + (["b_flat"] if bias else [])
        nodes = []
        inputs = [("x", dt, s.x_dims), ("w", dt, s.w_dims)]
        if bias:
            inputs.append(("b", dt, [1, s.k] + [1] * len(s.spatial)))
            shape = helper.make_tensor("b_shape", 7, [1], [s.k])  # INT64
            nodes.append(helper.make_node("Reshape", ["b", "b_shape"], ["b_flat"]))
            inits = [shape]
        else:
            inits = []
        nodes.append(helper.make_node("Conv", ins, ["c"], **attrs))
        nodes += _activation(act, "c", "y")
        return _model(nodes, "conv_fwd", inputs, ("y", dt, s.y_dims), inits)
    # data gradient: the transposed convolution of dy with the same filter [K, C/g, ...]
    out_pad = [xi - ((yi - 1) * st - 2 * p + d * (f - 1) + 1)
               for xi, yi, st, p, d, f in zip(s.spatial, s.out_spatial, s.stride, s.pad, s.dilation, s.filt, strict=True)]
    node = helper.make_node("ConvTranspose", ["dy", "w"], ["dx"], output_padding=out_pad, **attrs)
    return _model([node], "conv_bwd", [("dy", dt, s.y_dims), ("w", dt, s.w_dims)], ("dx", dt, s.x_dims))


def conv_transpose_model(x_dims: list[int], w_dims: list[int], y_dims: list[int], pad: tuple[int, ...],
                         stride: tuple[int, ...], dil: tuple[int, ...], opad: tuple[int, ...], groups: int,
                         dt: DataType, bias: bool, act: str) -> Any:
    from onnx import helper

    inputs = [("x", dt, x_dims), ("w", dt, w_dims)]
    ins, nodes, inits = ["x", "w"], [], []
    if bias:
        k = y_dims[1]
        inputs.append(("b", dt, [1, k] + [1] * (len(y_dims) - 2)))
        inits.append(helper.make_tensor("b_shape", 7, [1], [k]))
        nodes.append(helper.make_node("Reshape", ["b", "b_shape"], ["b_flat"]))
        ins.append("b_flat")
    nodes.append(helper.make_node("ConvTranspose", ins, ["c"], pads=list(pad) * 2, strides=list(stride),
                                  dilations=list(dil), output_padding=list(opad), group=groups))
    nodes += _activation(act, "c", "y")
    return _model(nodes, "conv_trans", inputs, ("y", dt, y_dims), inits)


def matmul_model(g: Graph, bias: bool, act: str) -> Any:
    from onnx import helper

    a, b = g.tensor_by_name("a"), g.tensor_by_name("b")
    y = g.outputs()[0]
    nodes = [helper.make_node("MatMul", ["a", "b"], ["mm"])]
    inputs = [("a", a.dtype, list(a.shape)), ("b", b.dtype, list(b.shape))]
    last = "mm"
    if bias:
        bt = g.tensor_by_name("bias")
        inputs.append(("bias", bt.dtype, list(bt.shape)))
        nodes.append(helper.make_node("Add", ["mm", "bias"], ["biased"]))
        last = "biased"
    nodes += _activation(act, last, "y")
    return _model(nodes, "matmul", inputs, ("y", y.dtype, list(y.shape)))


def norm_model(kind: str, rows: int, cols: int, dt: DataType, eps: float, act: str) -> Any:
    from onnx import helper

    inputs = [("x", dt, [rows, cols]), ("scale", dt, [1, cols])]
    if kind == "layernorm":
        inputs.append(("bias", dt, [1, cols]))
        nodes = [helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["n"], axis=-1, epsilon=eps)]
    else:  # y = x / sqrt(mean(x^2) + eps) * scale, in f32
        f32 = 1  # TensorProto.FLOAT
        nodes = [
            helper.make_node("Cast", ["x"], ["xf"], to=f32),
            helper.make_node("Mul", ["xf", "xf"], ["sq"]),
            helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),  # opset 18+: axes is an input
            helper.make_node("Add", ["ms", "eps"], ["mse"]),
            helper.make_node("Sqrt", ["mse"], ["rms"]),
            helper.make_node("Div", ["xf", "rms"], ["nf"]),
            helper.make_node("Cast", ["nf"], ["nd"], to=_onnx_type(dt)),
            helper.make_node("Mul", ["nd", "scale"], ["n"]),
        ]
        inits = [helper.make_tensor("eps", f32, [], [eps]), helper.make_tensor("axes", 7, [1], [-1])]
        return _model(nodes + _activation(act, "n", "y"), kind, inputs, ("y", dt, [rows, cols]), inits)
    return _model(nodes + _activation(act, "n", "y"), kind, inputs, ("y", dt, [rows, cols]))


def softmax_model(dims: list[int], axis: int, log: bool, dt: DataType) -> Any:
    from onnx import helper

    node = helper.make_node("LogSoftmax" if log else "Softmax", ["x"], ["y"], axis=axis)
    return _model([node], "softmax", [("x", dt, dims)], ("y", dt, dims))


def sdpa_model(g: Graph, causal: bool, scale: float | None, mask_kind: str) -> Any:
    import math

    import numpy as np
    from onnx import helper, numpy_helper

    q, k = g.tensor_by_name("q"), g.tensor_by_name("k")
    o = g.outputs()[0]
    b, h, sq, d = q.shape
    skv = k.shape[2]
    dt = q.dtype
    f32 = 1
    sc = scale if scale is not None else 1.0 / math.sqrt(d)
    inputs = [(n, dt, list(g.tensor_by_name(n).shape)) for n in ("q", "k", "v")]
    nodes = [
        helper.make_node("Cast", ["q"], ["qf"], to=f32),
        helper.make_node("Cast", ["k"], ["kf"], to=f32),
        helper.make_node("Cast", ["v"], ["vf"], to=f32),
        helper.make_node("Transpose", ["kf"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["qf", "kt"], ["s0"]),
        helper.make_node("Mul", ["s0", "scale"], ["s1"]),
    ]
    inits = [numpy_helper.from_array(np.array(sc, np.float32), "scale")]
    last = "s1"
    if causal:  # upper-left aligned, as fusegraph's reference
        tri = np.triu(np.full((sq, skv), -np.inf, np.float32), k=1)
        inits.append(numpy_helper.from_array(tri, "causal"))
        nodes.append(helper.make_node("Add", [last, "causal"], ["s2"]))
        last = "s2"
    if mask_kind == "bool":
        inputs.append(("mask", DataType.BOOLEAN, [1, 1, sq, skv]))
        inits.append(numpy_helper.from_array(np.array(-np.inf, np.float32), "neg"))
        nodes.append(helper.make_node("Where", ["mask", last, "neg"], ["s3"]))
        last = "s3"
    elif mask_kind == "additive":
        inputs.append(("mask", dt, [1, 1, sq, skv]))
        nodes += [helper.make_node("Cast", ["mask"], ["mf"], to=f32), helper.make_node("Add", [last, "mf"], ["s3"])]
        last = "s3"
    nodes += [
        helper.make_node("Softmax", [last], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "vf"], ["of"]),
        helper.make_node("Cast", ["of"], ["o"], to=_onnx_type(dt)),
    ]
    return _model(nodes, "sdpa", inputs, ("o", o.dtype, [b, h, sq, d]), inits)
