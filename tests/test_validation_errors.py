"""Malformed graphs: each raises its specific typed error, naming the tensor or node at fault.

Every case builds a small graph with one mistake and states which error class it expects
and which names the message must contain (and, where the error carries them, the
``.node`` / ``.tensor`` attributes). Variant-pack mistakes are in test_variant_pack.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

import fusegraph as fg
from fusegraph import DataType, FusegraphError, PointwiseMode, ReductionMode, ValidationError

F16, F32, I32, BOOL = DataType.HALF, DataType.FLOAT, DataType.INT32, DataType.BOOLEAN


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[], object]  # raises
    names: tuple[str, ...]  # each must appear in the message
    node: str | None = None  # expected exc.node, when the error is about a node
    tensor: str | None = None  # expected exc.tensor, when it is about a tensor
    error: type[FusegraphError] = ValidationError


def graph() -> fg.Graph:
    return fg.Graph(name="bad", io_data_type=F32)


# ---- convolutions ------------------------------------------------------------------------------
def channel_mismatch() -> None:
    g = graph()
    x, w = g.tensor("img", [1, 6, 5, 5]), g.tensor("filt", [4, 4, 3, 3])
    g.conv_fprop(x, w, name="conv").set_output(True)
    g.validate()


def group_mismatch() -> None:
    g = graph()
    x, w = g.tensor("img", [1, 4, 5, 5]), g.tensor("filt", [3, 2, 3, 3])  # 2 groups, 3 outputs
    g.conv_fprop(x, w, name="conv").set_output(True)
    g.validate()


def conv_window_too_large() -> None:
    g = graph()
    x, w = g.tensor("img", [1, 2, 3, 3]), g.tensor("filt", [2, 2, 5, 5])
    g.conv_fprop(x, w, name="conv").set_output(True)
    g.validate()


def conv_padding_count() -> None:
    g = graph()
    x, w = g.tensor("img", [1, 2, 5, 5]), g.tensor("filt", [2, 2, 3, 3])
    g.conv_fprop(x, w, padding=[1], name="conv").set_output(True)
    g.validate()


def conv_zero_stride() -> None:
    g = graph()
    x, w = g.tensor("img", [1, 2, 5, 5]), g.tensor("filt", [2, 2, 3, 3])
    g.conv_fprop(x, w, stride=[0, 1], name="conv").set_output(True)
    g.validate()


def conv_rank_mismatch() -> None:
    g = graph()
    x, w = g.tensor("img", [1, 2, 5, 5]), g.tensor("filt", [2, 2, 3])
    g.conv_fprop(x, w, padding=[0, 0], name="conv").set_output(True)
    g.validate()


def conv_dtype_mismatch() -> None:
    g = graph()
    x, w = g.tensor("img", [1, 2, 5, 5], data_type=F16), g.tensor("filt", [2, 2, 3, 3], data_type=F32)
    g.conv_fprop(x, w, name="conv").set_output(True)
    g.validate()


def dgrad_without_set_dim() -> None:
    g = graph()
    dy, w = g.tensor("dy", [1, 2, 3, 3]), g.tensor("filt", [2, 2, 3, 3])
    g.conv_dgrad(dy, w, name="dgrad").set_output(True)
    g.validate()


def wgrad_without_set_dim() -> None:
    g = graph()
    x, dy = g.tensor("img", [1, 2, 5, 5]), g.tensor("dy", [1, 2, 3, 3])
    g.conv_wgrad(x, dy, name="wgrad").set_output(True)
    g.validate()


def dgrad_wrong_dims() -> None:
    g = graph()
    dy, w = g.tensor("dy", [1, 2, 3, 3]), g.tensor("filt", [2, 2, 3, 3])
    g.conv_dgrad(dy, w, name="dgrad").set_dim([1, 2, 6, 6]).set_output(True)  # forward gives 4x4
    g.validate()


# ---- strides, dims, names ------------------------------------------------------------------------
def overlapping_strides() -> None:
    """An intermediate may not overlap itself (a graph input may: issue 16, tests/test_parity.py)."""
    g = graph()
    x = g.tensor("x", [2, 3, 4])
    h = g.relu(x, name="act").set_stride([4, 1, 1])
    g.exp(h).set_output(True)
    g.validate()


def negative_strides() -> None:
    g = graph()
    x = g.tensor("x", [2, 3], [3, -1])
    g.relu(x).set_output(True)
    g.validate()


def wrong_stride_count() -> None:
    g = graph()
    x = g.tensor("x", [2, 3, 4], [12, 1])
    g.relu(x).set_output(True)
    g.validate()


def zero_dim() -> None:
    g = graph()
    x = g.tensor("x", [2, 0, 4])
    g.relu(x).set_output(True)
    g.validate()


def float_dims() -> None:
    graph().tensor("x", [2, 2.5])


def bool_stride() -> None:
    graph().tensor("x", [2, 2]).set_stride([True, 1])


def unknown_data_type() -> None:
    graph().tensor("x", [2, 2], data_type="complex-ish")


def no_data_type() -> None:
    g = fg.Graph(name="bad")  # no io_data_type and none given
    x = g.tensor("x", [2, 2])
    g.relu(x).set_output(True)
    g.validate()


def output_broadcast_strides() -> None:
    g = graph()
    x = g.tensor("x", [2, 3])
    g.relu(x, name="act").set_output(True).set_stride([0, 1])
    g.validate()


def output_overlapping_strides() -> None:
    g = graph()
    x = g.tensor("x", [2, 3])
    g.relu(x, name="act").set_output(True).set_stride([1, 1])
    g.validate()


def duplicate_tensor_name() -> None:
    g = graph()
    a, b = g.tensor("twin", [2, 2]), g.tensor("twin", [2, 2])
    g.add(a, b).set_output(True)
    g.validate()


def duplicate_node_name() -> None:
    g = graph()
    x = g.tensor("x", [2, 2])
    g.relu(x, name="act")
    g.tanh(x, name="act").set_output(True)
    g.validate()


def no_output() -> None:
    g = graph()
    g.relu(g.tensor("x", [2, 2]))
    g.validate()


def output_is_a_graph_input() -> None:
    g = graph()
    x = g.tensor("x", [2, 2])
    g.relu(x).set_output(True)
    x.set_output(True)
    g.validate()


def output_dims_contradict_inference() -> None:
    g = graph()
    x = g.tensor("x", [2, 3])
    g.relu(x, name="act").set_dim([3, 2]).set_output(True)
    g.validate()


def operand_of_another_graph() -> None:
    g1, g2 = graph(), graph()
    foreign = g1.tensor("foreign", [2, 2])
    g2.add(g2.tensor("x", [2, 2]), foreign)


def operand_not_a_tensor() -> None:
    g = graph()
    g.add(g.tensor("x", [2, 2]), np.ones((2, 2)), name="plus")  # type: ignore[arg-type]


# ---- pointwise ---------------------------------------------------------------------------------------
def non_broadcastable() -> None:
    g = graph()
    a, b = g.tensor("a", [2, 3]), g.tensor("b", [4])
    g.add(a, b, name="plus").set_output(True)
    g.validate()


def pointwise_dtype_family_mismatch() -> None:
    g = graph()
    a, b = g.tensor("a", [2, 3]), g.tensor("b", [2, 3], data_type=I32)
    g.add(a, b, name="plus").set_output(True)
    g.validate()


def unknown_pointwise_param() -> None:
    g = graph()
    g.pointwise(g.tensor("x", [2]), mode=PointwiseMode.ELU_FWD, alpha=0.5)  # it is elu_alpha


def non_numeric_pointwise_param() -> None:
    g = graph()
    g.relu(g.tensor("x", [2]), negative_slope="steep")  # type: ignore[arg-type]


def pointwise_wrong_arity() -> None:
    g = graph()
    a, b = g.tensor("a", [2]), g.tensor("b", [2])
    g.pointwise(a, b, mode=PointwiseMode.EXP, name="exp2").set_output(True)
    g.validate()


def binary_op_missing_operand() -> None:
    g = graph()
    g.pointwise(g.tensor("a", [2]), mode=PointwiseMode.ADD, name="half_add").set_output(True)
    g.validate()


def logical_op_on_floats() -> None:
    g = graph()
    a, b = g.tensor("a", [2]), g.tensor("b", [2])
    g.logical_and(a, b, name="and").set_output(True)
    g.validate()


def transcendental_on_ints() -> None:
    g = graph()
    g.exp(g.tensor("counts", [2], data_type=I32), name="e").set_output(True)
    g.validate()


def select_condition_not_bool() -> None:
    g = graph()
    a, b, c = g.tensor("a", [2]), g.tensor("b", [2]), g.tensor("cond", [2])
    g.binary_select(a, b, c, name="sel").set_output(True)
    g.validate()


# ---- other ops -------------------------------------------------------------------------------------------
def matmul_inner_mismatch() -> None:
    g = graph()
    a, b = g.tensor("A", [2, 3]), g.tensor("B", [4, 5])
    g.matmul(a, b, name="mm").set_output(True)
    g.validate()


def matmul_batch_mismatch() -> None:
    g = graph()
    a, b = g.tensor("A", [2, 2, 3]), g.tensor("B", [3, 3, 5])
    g.matmul(a, b, name="mm").set_output(True)
    g.validate()


def matmul_dtype_mismatch() -> None:
    g = graph()
    a, b = g.tensor("A", [2, 3], data_type=F32), g.tensor("B", [3, 5], data_type=F16)
    g.matmul(a, b, name="mm").set_output(True)
    g.validate()


def reduction_bad_dim() -> None:
    g = graph()
    g.reduction(g.tensor("x", [2, 3]), ReductionMode.SUM, dim=[2, 2], name="red").set_output(True)
    g.validate()


def reduction_without_dims() -> None:
    g = graph()
    g.reduction(g.tensor("x", [2, 3]), ReductionMode.SUM, name="red").set_output(True)
    g.validate()


def reduction_axis_out_of_range() -> None:
    g = graph()
    g.reduction(g.tensor("x", [2, 3]), ReductionMode.SUM, axes=[2], name="red")


def layernorm_bad_scale() -> None:
    g = graph()
    x = g.tensor("x", [2, 3, 4])
    y, _, _ = g.layernorm(x, g.tensor("gamma", [5]), g.tensor("beta", [1, 3, 4]), name="ln")
    y.set_output(True)
    g.validate()


def batchnorm_bad_channel_param() -> None:
    g = graph()
    x = g.tensor("x", [2, 3, 4, 4])
    ps = [g.tensor(n, [3]) for n in ("s", "b", "m")]
    g.batchnorm_inference(x, *ps, g.tensor("running_var", [4]), name="bn").set_output(True)
    g.validate()


def epsilon_not_scalar() -> None:
    g = graph()
    x = g.tensor("x", [2, 3])
    s, b = g.tensor("s", [1, 3]), g.tensor("b", [1, 3])
    y, _, _ = g.layernorm(x, s, b, epsilon=g.tensor("eps", [2]), name="ln")
    y.set_output(True)
    g.validate()


def pooling_padding_too_large() -> None:
    g = graph()
    g.pooling(g.tensor("x", [1, 1, 6, 6]), window=[2, 2], padding=[2, 2], name="pool").set_output(True)
    g.validate()


def sdpa_head_mismatch() -> None:
    g = graph()
    q, k, v = g.tensor("q", [1, 4, 5, 8]), g.tensor("k", [1, 3, 5, 8]), g.tensor("v", [1, 3, 5, 8])
    g.sdpa(q, k, v, name="attn").set_output(True)
    g.validate()


def sdpa_bad_mask() -> None:
    g = graph()
    q, k, v = g.tensor("q", [1, 2, 5, 8]), g.tensor("k", [1, 2, 6, 8]), g.tensor("v", [1, 2, 6, 8])
    g.sdpa(q, k, v, mask=g.tensor("mask", [1, 1, 5, 5]), name="attn").set_output(True)
    g.validate()


def sdpa_scale_nan() -> None:
    g = graph()
    q, k, v = g.tensor("q", [1, 2, 5, 8]), g.tensor("k", [1, 2, 5, 8]), g.tensor("v", [1, 2, 5, 8])
    g.sdpa(q, k, v, attn_scale=float("nan"), name="attn").set_output(True)
    g.validate()


def scalar_beyond_int8() -> None:
    g = graph()
    g.scalar(300, DataType.INT8)


def pointwise_param_infinite() -> None:
    g = graph()
    g.elu(g.tensor("x", [2, 2]), alpha=float("inf"), name="elu").set_output(True)
    g.validate()


def softplus_beta_zero() -> None:
    g = graph()
    g.softplus(g.tensor("x", [2, 2]), beta=0.0, name="sp").set_output(True)
    g.validate()


def int_conv_float_compute() -> None:
    g = fg.Graph(name="bad", io_data_type=DataType.INT8)
    x, w = g.tensor("img", [1, 4, 5, 5]), g.tensor("filt", [4, 4, 3, 3])
    g.conv_fprop(x, w, padding=[0, 0], stride=[1, 1], dilation=[1, 1], compute_data_type=F32, name="conv").set_output(True)
    g.validate()


def softmax_bad_axis() -> None:
    g = graph()
    g.softmax(g.tensor("x", [2, 3]), axis=2, name="sm").set_output(True)
    g.validate()


def transpose_bad_permutation() -> None:
    g = graph()
    g.transpose(g.tensor("x", [2, 3, 4]), [0, 0, 1], name="tr").set_output(True)
    g.validate()


def reshape_count_mismatch() -> None:
    g = graph()
    g.reshape(g.tensor("x", [2, 3]), [4, 2], name="rs").set_output(True)
    g.validate()


def concat_mismatch() -> None:
    g = graph()
    a, b = g.tensor("a", [2, 3]), g.tensor("b", [3, 3])
    g.concatenate([a, b], axis=1, name="cat").set_output(True)
    g.validate()


def slice_empty() -> None:
    g = graph()
    g.slice(g.tensor("x", [4, 4]), [3], [1], name="sl").set_output(True)
    g.validate()


def slice_bad_axis() -> None:
    g = graph()
    g.slice(g.tensor("x", [4, 4]), [0], [2], axes=[2], name="sl")


# ---- JSON ------------------------------------------------------------------------------------------------
def _json_of_chain() -> dict[str, object]:
    g = graph()
    x = g.tensor("x", [2, 2])
    g.tanh(g.relu(x, name="first"), name="second").set_output(True)
    g.validate()
    return json.loads(g.to_json())  # type: ignore[no-any-return]


def cycle_via_json() -> None:
    d = _json_of_chain()
    nodes = d["nodes"]
    assert isinstance(nodes, list)
    nodes[0]["inputs"]["a"] = nodes[1]["outputs"]["y"]  # first reads what second writes
    fg.Graph.from_json(json.dumps(d)).validate()


def self_loop_via_json() -> None:
    d = _json_of_chain()
    nodes = d["nodes"]
    assert isinstance(nodes, list)
    nodes[1]["inputs"]["a"] = nodes[1]["outputs"]["y"]
    fg.Graph.from_json(json.dumps(d)).validate()


def json_unknown_tensor() -> None:
    d = _json_of_chain()
    nodes = d["nodes"]
    assert isinstance(nodes, list)
    nodes[0]["inputs"]["a"] = "ghost"
    fg.Graph.from_json(json.dumps(d))


def json_unknown_op() -> None:
    d = _json_of_chain()
    nodes = d["nodes"]
    assert isinstance(nodes, list)
    nodes[1]["op"] = "teleport"
    fg.Graph.from_json(json.dumps(d))


def json_unknown_port() -> None:
    d = _json_of_chain()
    nodes = d["nodes"]
    assert isinstance(nodes, list)
    nodes[1]["inputs"] = {"q": "x"}
    fg.Graph.from_json(json.dumps(d))


def json_two_writers() -> None:
    d = _json_of_chain()
    nodes = d["nodes"]
    assert isinstance(nodes, list)
    nodes[1]["outputs"]["y"] = nodes[0]["outputs"]["y"]
    fg.Graph.from_json(json.dumps(d))


def json_bad_attribute() -> None:
    d = _json_of_chain()
    nodes = d["nodes"]
    assert isinstance(nodes, list)
    nodes[0]["attrs"]["mode"] = "relu_sideways"
    fg.Graph.from_json(json.dumps(d))


def json_bad_data_type() -> None:
    d = _json_of_chain()
    tensors = d["tensors"]
    assert isinstance(tensors, list)
    tensors[0]["data_type"] = "float7"
    fg.Graph.from_json(json.dumps(d))


def json_virtual_input_without_producer() -> None:
    d = _json_of_chain()
    tensors = d["tensors"]
    assert isinstance(tensors, list)
    tensors[0]["is_virtual"] = True
    fg.Graph.from_json(json.dumps(d)).validate()


CASES = [
    Case("channel_mismatch", channel_mismatch, ("conv", "filt", "6"), node="conv", tensor="filt"),
    Case("group_mismatch", group_mismatch, ("conv", "filt", "group"), node="conv", tensor="filt"),
    Case("conv_window_too_large", conv_window_too_large, ("conv",), node="conv"),
    Case("conv_padding_count", conv_padding_count, ("conv", "padding"), node="conv"),
    Case("conv_zero_stride", conv_zero_stride, ("conv", "stride"), node="conv"),
    Case("conv_rank_mismatch", conv_rank_mismatch, ("conv", "filt"), node="conv", tensor="filt"),
    Case("conv_dtype_mismatch", conv_dtype_mismatch, ("conv", "filt", "img"), node="conv", tensor="filt"),
    Case("dgrad_without_set_dim", dgrad_without_set_dim, ("dgrad", "set_dim"), node="dgrad", tensor="dgrad::dx"),
    Case("wgrad_without_set_dim", wgrad_without_set_dim, ("wgrad", "set_dim"), node="wgrad", tensor="wgrad::dw"),
    Case("dgrad_wrong_dims", dgrad_wrong_dims, ("dgrad", "dy"), node="dgrad", tensor="dy"),
    Case("overlapping_strides", overlapping_strides, ("act::y", "overlap"), tensor="act::y"),
    Case("negative_strides", negative_strides, ("'x'", "negative"), tensor="x"),
    Case("wrong_stride_count", wrong_stride_count, ("'x'", "2 strides for 3 dims"), tensor="x"),
    Case("zero_dim", zero_dim, ("'x'", ">= 1"), tensor="x"),
    Case("float_dims", float_dims, ("'x'", "2.5"), tensor="x"),
    Case("bool_stride", bool_stride, ("'x'", "True"), tensor="x"),
    Case("unknown_data_type", unknown_data_type, ("'x'", "complex-ish"), tensor="x"),
    Case("no_data_type", no_data_type, ("'x'", "data type"), tensor="x"),
    Case("output_broadcast_strides", output_broadcast_strides, ("act::y", "broadcast"), tensor="act::y"),
    Case("output_overlapping_strides", output_overlapping_strides, ("act::y", "overlap"), tensor="act::y"),
    Case("duplicate_tensor_name", duplicate_tensor_name, ("twin", "duplicate"), tensor="twin"),
    Case("duplicate_node_name", duplicate_node_name, ("act", "duplicate node"), node="act"),
    Case("no_output", no_output, ("'bad'", "no output", "set_output")),
    Case("output_is_a_graph_input", output_is_a_graph_input, ("'x'", "not produced"), tensor="x"),
    Case("output_dims_contradict", output_dims_contradict_inference, ("act", "[3, 2]", "[2, 3]"), node="act", tensor="act::y"),
    Case("operand_of_another_graph", operand_of_another_graph, ("foreign", "another graph"), tensor="foreign"),
    Case("operand_not_a_tensor", operand_not_a_tensor, ("plus", "ndarray"), node="plus"),
    Case("non_broadcastable", non_broadcastable, ("plus", "'a' [2, 3]", "'b' [4]"), node="plus"),
    Case("pointwise_dtype_family", pointwise_dtype_family_mismatch, ("plus", "'b'", "INT32"), node="plus", tensor="b"),
    Case("unknown_pointwise_param", unknown_pointwise_param, ("'x'", "alpha", "elu_alpha"), tensor="x"),
    Case("non_numeric_pointwise_param", non_numeric_pointwise_param, ("'x'", "steep"), tensor="x"),
    Case("pointwise_wrong_arity", pointwise_wrong_arity, ("exp2", "1 input"), node="exp2"),
    Case("binary_op_missing_operand", binary_op_missing_operand, ("half_add", "2 input"), node="half_add"),
    Case("logical_op_on_floats", logical_op_on_floats, ("and", "BOOLEAN"), node="and"),
    Case("transcendental_on_ints", transcendental_on_ints, ("'e'", "counts"), node="e", tensor="counts"),
    Case("select_condition_not_bool", select_condition_not_bool, ("sel", "cond"), node="sel", tensor="cond"),
    Case("matmul_inner_mismatch", matmul_inner_mismatch, ("mm", "K=3", "K=4"), node="mm", tensor="B"),
    Case("matmul_batch_mismatch", matmul_batch_mismatch, ("mm", "broadcast"), node="mm", tensor="B"),
    Case("matmul_dtype_mismatch", matmul_dtype_mismatch, ("mm", "'B'", "'A'"), node="mm", tensor="B"),
    Case("reduction_bad_dim", reduction_bad_dim, ("red", "red::y"), node="red", tensor="red::y"),
    Case("reduction_without_dims", reduction_without_dims, ("red", "dim"), node="red", tensor="red::y"),
    Case("reduction_axis_out_of_range", reduction_axis_out_of_range, ("red", "'x'", "[2]"), node="red", tensor="x"),
    Case("layernorm_bad_scale", layernorm_bad_scale, ("ln", "gamma"), node="ln", tensor="gamma"),
    Case("batchnorm_bad_channel", batchnorm_bad_channel_param, ("bn", "running_var"), node="bn", tensor="running_var"),
    Case("epsilon_not_scalar", epsilon_not_scalar, ("ln", "eps"), node="ln", tensor="eps"),
    Case("pooling_padding_too_large", pooling_padding_too_large, ("pool", "padding"), node="pool"),
    Case("sdpa_head_mismatch", sdpa_head_mismatch, ("attn", "'k'"), node="attn", tensor="k"),
    Case("sdpa_bad_mask", sdpa_bad_mask, ("attn", "mask"), node="attn", tensor="mask"),
    Case("sdpa_scale_nan", sdpa_scale_nan, ("attn", "attn_scale"), node="attn"),
    Case("scalar_beyond_int8", scalar_beyond_int8, ("300", "INT8"), tensor="scalar_0"),
    Case("pointwise_param_infinite", pointwise_param_infinite, ("elu", "elu_alpha", "finite"), node="elu"),
    Case("softplus_beta_zero", softplus_beta_zero, ("sp", "softplus_beta"), node="sp"),
    Case("int_conv_float_compute", int_conv_float_compute, ("conv", "INT32", "FLOAT"), node="conv"),
    Case("softmax_bad_axis", softmax_bad_axis, ("sm", "axis 2"), node="sm"),
    Case("transpose_bad_permutation", transpose_bad_permutation, ("tr", "[0, 0, 1]"), node="tr", tensor="x"),
    Case("reshape_count_mismatch", reshape_count_mismatch, ("rs", "[4, 2]"), node="rs", tensor="rs::y"),
    Case("concat_mismatch", concat_mismatch, ("cat", "'b'"), node="cat", tensor="b"),
    Case("slice_empty", slice_empty, ("sl", "empty"), node="sl", tensor="x"),
    Case("slice_bad_axis", slice_bad_axis, ("sl", "'x'", "axes"), node="sl", tensor="x"),
    Case("cycle_via_json", cycle_via_json, ("cycle", "first"), node="first"),
    Case("self_loop_via_json", self_loop_via_json, ("cycle", "second"), node="second"),
    Case("json_unknown_tensor", json_unknown_tensor, ("first", "ghost"), node="first", tensor="ghost"),
    Case("json_unknown_op", json_unknown_op, ("second", "teleport"), node="second"),
    Case("json_unknown_port", json_unknown_port, ("second", "'q'"), node="second"),
    Case("json_two_writers", json_two_writers, ("second", "first::y", "two nodes"), node="second", tensor="first::y"),
    Case("json_bad_attribute", json_bad_attribute, ("first", "relu_sideways"), node="first"),
    Case("json_bad_data_type", json_bad_data_type, ("'x'", "float7"), tensor="x"),
    Case("json_virtual_input", json_virtual_input_without_producer, ("first", "'x'"), node="first", tensor="x"),
]


def test_there_are_at_least_25_distinct_cases() -> None:
    assert len(CASES) >= 25
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_graph_raises_typed_error_naming_the_culprit(case: Case) -> None:
    with pytest.raises(case.error) as info:
        case.build()
    exc = info.value
    assert type(exc) is case.error, f"expected {case.error.__name__}, got {type(exc).__name__}: {exc}"
    msg = str(exc)
    for name in case.names:
        assert name in msg, f"message does not mention {name!r}: {msg}"
    if case.node is not None:
        assert exc.node == case.node, msg
    if case.tensor is not None:
        assert exc.tensor == case.tensor, msg


def test_validation_error_is_a_fusegraph_error() -> None:
    assert issubclass(fg.ValidationError, fg.FusegraphError)
    assert issubclass(fg.VariantPackError, fg.FusegraphError)
    exc = fg.ValidationError("broken", node="n", tensor="t")
    assert str(exc) == "node 'n', tensor 't': broken" and exc.detail == "broken"


def test_a_fixed_graph_validates_after_an_error() -> None:
    """An error leaves the graph usable: fix the cause and validate again."""
    g = graph()
    dx_dims = [1, 2, 5, 5]
    dy, w = g.tensor("dy", [1, 2, 3, 3]), g.tensor("filt", [2, 2, 3, 3])
    dx = g.conv_dgrad(dy, w, name="dgrad").set_output(True)
    with pytest.raises(ValidationError, match="set_dim"):
        g.validate()
    dx.set_dim(dx_dims)
    g.validate()
    assert dx.dim == dx_dims and dx.data_type == F32
