"""The graph builder: tensors, setters, names, dtype/shape/layout inference, op helpers.

Shape inference is checked property-style against independent shape rules: PyTorch's
convolution and pooling, numpy's broadcasting, slicing and matmul.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import fusegraph as fg
from fusegraph import DataType, NormFwdPhase, OpKind, PointwiseMode, ValidationError

F16, F32, I32, I64, BOOL = DataType.HALF, DataType.FLOAT, DataType.INT32, DataType.INT64, DataType.BOOLEAN
torch = pytest.importorskip("torch", reason="PyTorch (the test extra) gives the independent conv/pool shapes")


# ---- tensors ---------------------------------------------------------------------------------------
def test_tensor_defaults_and_attributes() -> None:
    g = fg.Graph(io_data_type=F16)
    x = g.tensor("x", [2, 3, 4])
    assert (x.name, x.dim, x.stride, x.data_type) == ("x", [2, 3, 4], [12, 4, 1], F16)
    assert not x.is_virtual and not x.is_output
    y = g.tensor("y", (2, 3), stride=(1, 2), data_type="float")
    assert y.stride == [1, 2] and y.data_type == F32
    # dims and strides are copies: mutating them does not touch the tensor
    x.dim.append(9)
    assert x.dim == [2, 3, 4]


def test_setters_chain_and_return_the_same_tensor() -> None:
    g = fg.Graph()
    x = g.tensor("x", [4])
    same = x.set_name("x2").set_dim([2, 3]).set_stride([1, 2]).set_data_type(np.float16).set_output(True)
    assert same is x
    assert (x.name, x.dim, x.stride, x.data_type, x.is_output) == ("x2", [2, 3], [1, 2], F16, True)
    assert g.tensor_by_name("x2") is x


def test_set_output_makes_a_virtual_tensor_real() -> None:
    g = fg.Graph(io_data_type=F32)
    y = g.relu(g.tensor("x", [2]))
    assert y.is_virtual and not y.is_output
    y.set_output(True)
    assert y.is_output and not y.is_virtual


def test_setters_invalidate_validation_and_the_key() -> None:
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [2, 3])
    y = g.relu(x).set_output(True)
    g.validate()
    assert g.is_validated
    k1 = g.key()
    y.set_data_type(F16)
    assert not g.is_validated
    assert g.key() != k1 and g.is_validated


@pytest.mark.parametrize("layout_name", ["NCHW", "NHWC"])
@pytest.mark.parametrize("np_type", [np.float32, np.float16, ml_dtypes.bfloat16, np.int8, np.bool_])
def test_tensor_like_takes_dims_strides_and_dtype(np_type: Any, layout_name: str) -> None:
    dims = (2, 3, 4, 5)
    order = (0, 1, 2, 3) if layout_name == "NCHW" else (0, 2, 3, 1)
    arr = np.zeros([dims[a] for a in order], np_type).transpose(np.argsort(order))
    g = fg.Graph()
    t = g.tensor_like(arr, "a")
    assert t.dim == list(dims)
    assert t.stride == list(fg.strides_for(dims, layout_name))
    assert t.data_type == fg.as_data_type(np_type)


def test_tensor_like_broadcast_view_and_auto_names() -> None:
    g = fg.Graph()
    a = g.tensor_like(np.broadcast_to(np.zeros(3, np.float32), (4, 3)))
    b = g.tensor_like(np.zeros(3, np.float32))
    assert a.stride == [0, 1]
    assert a.name != b.name


def test_tensor_like_rejects_strides_that_are_not_whole_elements() -> None:
    packed = np.zeros(4, dtype=[("a", np.float32), ("b", np.int8)])["a"]  # 5-byte steps
    with pytest.raises(ValidationError, match="whole elements"):
        fg.Graph().tensor_like(packed, "odd")


@pytest.mark.parametrize(
    "value,dtype,expected_type,expected_value",
    [
        (0.5, None, F32, 0.5),
        (3, None, I64, 3),
        (True, None, BOOL, True),
        (3, F16, F16, 3.0),
        (2.9, np.int32, I32, 2),
        (np.float32(1.5), None, F32, 1.5),
    ],
)
def test_scalar(value: Any, dtype: Any, expected_type: DataType, expected_value: Any) -> None:
    g = fg.Graph()
    s = g.scalar(value, dtype)
    assert s.is_scalar and s.data_type == expected_type and s.dim == [1]
    assert s.value == expected_value and type(s.value) is type(expected_value)
    assert g.scalar(value, dtype).name != s.name


def test_auto_names_are_unique_and_avoid_user_names() -> None:
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("pointwise_0", [2])  # collides with the first auto name
    a, b = g.relu(x), g.relu(x)
    names = [t.name for t in g.tensors] + [n.name for n in g.nodes]
    assert len(names) == len(set(names))
    assert a.name != b.name and g.nodes[0].name != "pointwise_0"


def test_named_ops_name_their_node_and_outputs() -> None:
    g = fg.Graph(io_data_type=F32)
    y = g.relu(g.tensor("x", [2]), name="act")
    assert g.node_by_name("act").outputs["y"] is y and y.name == "act::y"


# ---- ops and their helpers ------------------------------------------------------------------------------
HELPERS: list[tuple[str, PointwiseMode, int]] = [
    ("add", PointwiseMode.ADD, 2), ("bias", PointwiseMode.ADD, 2), ("sub", PointwiseMode.SUB, 2),
    ("mul", PointwiseMode.MUL, 2), ("scale", PointwiseMode.MUL, 2), ("div", PointwiseMode.DIV, 2),
    ("max", PointwiseMode.MAX, 2), ("min", PointwiseMode.MIN, 2), ("pow", PointwiseMode.POW, 2),
    ("abs", PointwiseMode.ABS, 1), ("neg", PointwiseMode.NEG, 1), ("exp", PointwiseMode.EXP, 1),
    ("log", PointwiseMode.LOG, 1), ("sqrt", PointwiseMode.SQRT, 1), ("rsqrt", PointwiseMode.RSQRT, 1),
    ("reciprocal", PointwiseMode.RECIPROCAL, 1), ("sin", PointwiseMode.SIN, 1), ("cos", PointwiseMode.COS, 1),
    ("erf", PointwiseMode.ERF, 1), ("floor", PointwiseMode.FLOOR, 1), ("ceil", PointwiseMode.CEIL, 1),
    ("identity", PointwiseMode.IDENTITY, 1), ("relu", PointwiseMode.RELU_FWD, 1),
    ("leaky_relu", PointwiseMode.RELU_FWD, 1), ("tanh", PointwiseMode.TANH_FWD, 1),
    ("sigmoid", PointwiseMode.SIGMOID_FWD, 1), ("gelu", PointwiseMode.GELU_FWD, 1),
    ("gelu_approx_tanh", PointwiseMode.GELU_APPROX_TANH_FWD, 1), ("elu", PointwiseMode.ELU_FWD, 1),
    ("swish", PointwiseMode.SWISH_FWD, 1), ("softplus", PointwiseMode.SOFTPLUS_FWD, 1),
    ("cmp_eq", PointwiseMode.CMP_EQ, 2), ("cmp_neq", PointwiseMode.CMP_NEQ, 2), ("cmp_gt", PointwiseMode.CMP_GT, 2),
    ("cmp_ge", PointwiseMode.CMP_GE, 2), ("cmp_lt", PointwiseMode.CMP_LT, 2), ("cmp_le", PointwiseMode.CMP_LE, 2),
    ("logical_and", PointwiseMode.LOGICAL_AND, 2), ("logical_or", PointwiseMode.LOGICAL_OR, 2),
    ("logical_not", PointwiseMode.LOGICAL_NOT, 1), ("binary_select", PointwiseMode.BINARY_SELECT, 3),
    ("relu_backward", PointwiseMode.RELU_BWD, 2), ("gelu_backward", PointwiseMode.GELU_BWD, 2),
    ("tanh_backward", PointwiseMode.TANH_BWD, 2), ("sigmoid_backward", PointwiseMode.SIGMOID_BWD, 2),
]


@pytest.mark.parametrize("method,mode,arity", HELPERS, ids=[h[0] for h in HELPERS])
def test_convenience_methods_build_their_mode(method: str, mode: PointwiseMode, arity: int) -> None:
    g = fg.Graph(io_data_type=F32)
    dt = BOOL if mode.name.startswith("LOGICAL") else F32
    ins = [g.tensor(f"in{i}", [2, 3], data_type=BOOL if i == 2 else dt) for i in range(arity)]
    y = getattr(g, method)(*ins, name="n").set_output(True)
    node = g.node_by_name("n")
    assert node.kind == OpKind.POINTWISE and node.attrs.mode == mode  # type: ignore[union-attr]
    assert list(node.inputs.values()) == ins
    g.validate()
    assert y.dim == [2, 3]


def test_relu_helper_parameters() -> None:
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [2])
    g.relu(x, negative_slope=0.1, lower_clip=-1.0, upper_clip=6.0, name="r")
    g.leaky_relu(x, 0.3, name="l")
    attrs = g.node_by_name("r").attrs
    assert attrs.param("relu_lower_clip_slope") == 0.1  # type: ignore[union-attr]
    assert attrs.param("relu_lower_clip") == -1.0 and attrs.param("relu_upper_clip") == 6.0  # type: ignore[union-attr]
    assert g.node_by_name("l").attrs.param("relu_lower_clip_slope") == 0.3  # type: ignore[union-attr]


def test_norm_ops_return_tuples_by_phase() -> None:
    g = fg.Graph(io_data_type=F32)
    x, s, b = g.tensor("x", [2, 3, 4]), g.tensor("s", [1, 3, 4]), g.tensor("b", [1, 3, 4])
    y, m, v = g.layernorm(x, s, b, 1e-5, NormFwdPhase.INFERENCE)
    assert isinstance(y, fg.TensorAttr) and m is None and v is None
    y, m, v = g.layernorm(x, s, b, 1e-5, NormFwdPhase.TRAINING)
    assert m is not None and v is not None and m.dim == [2, 1, 1]
    y2, inv = g.rmsnorm(x, s, 1e-5, NormFwdPhase.TRAINING)
    assert y2.dim == [2, 3, 4]
    assert inv is not None and inv.dim == [2, 1, 1]
    cs, cb = g.tensor("cs", [3]), g.tensor("cb", [3])
    yb, mean, iv = g.batchnorm(x, cs, cb)
    assert yb.dim == [2, 3, 4] and mean.dim == [1, 3, 1] and iv.dim == [1, 3, 1]


def test_dtype_inference_with_graph_types() -> None:
    g = fg.Graph(io_data_type=F16, intermediate_data_type=F32)
    x, w = g.tensor("x", [1, 4, 5, 5]), g.tensor("w", [4, 4, 3, 3])
    w2 = g.tensor("w2", [4, 4, 1, 1])
    h = g.relu(g.conv_fprop(x, w, padding=[1, 1]))
    y = g.conv_fprop(h, w2).set_output(True)  # FLOAT intermediate meets HALF filter: fine
    mask = g.cmp_gt(y, g.scalar(0.0)).set_output(True)
    g.validate()
    assert h.data_type == F32 and y.data_type == F16 and mask.data_type == BOOL


def test_integer_and_boolean_inference() -> None:
    g = fg.Graph()
    a, b = g.tensor("a", [3], data_type=np.int8), g.tensor("b", [3], data_type=np.int32)
    s = g.add(a, b).set_output(True)
    t = g.mul(a, g.scalar(2)).set_output(True)  # int64 scalar does not widen int8
    c = g.logical_not(g.cmp_eq(a, b)).set_output(True)
    g.validate()
    assert (s.data_type, t.data_type, c.data_type) == (I32, DataType.INT8, BOOL)


def test_outputs_follow_their_inputs_layout() -> None:
    g = fg.Graph(io_data_type=F32)
    dims = [2, 3, 4, 5]
    x = g.tensor("x", dims, fg.strides_for(dims, "NHWC"))
    y = g.relu(x).set_output(True)
    p = g.pooling(x, window=[2, 2]).set_output(True)
    r = g.reshape(x, [2, 60]).set_output(True)
    g.validate()
    assert y.stride == list(fg.strides_for(dims, "NHWC"))
    assert p.stride == list(fg.strides_for([2, 3, 2, 2], "NHWC"))
    assert r.stride == [60, 1]  # a reshape is row-major by definition


def test_conv_after_dgrad_infers_the_spatial_rank_from_the_filter() -> None:
    g = fg.Graph(io_data_type=F32)
    dy, w = g.tensor("dy", [1, 2, 5, 5]), g.tensor("w", [2, 2, 3, 3])
    dx = g.conv_dgrad(dy, w, padding=[1, 1])  # dims unknown until set_dim
    y = g.conv_fprop(dx, w).set_output(True)
    dx.set_dim([1, 2, 5, 5])
    g.validate()
    assert y.dim == [1, 2, 3, 3]


def test_validate_returns_the_graph_and_lists_inputs_outputs() -> None:
    g = fg.Graph(io_data_type=F32)
    x, unused = g.tensor("x", [2]), g.tensor("unused", [2])
    y = g.exp(x).set_output(True)
    assert g.validate() is g
    assert g.inputs() == [x] and g.outputs() == [y] and unused not in g.inputs()
    assert [n.name for n in g.topological_order()] == ["pointwise_0"]


# ---- shape inference, property-style ------------------------------------------------------------------
@st.composite
def conv_problem(draw: st.DrawFn) -> dict[str, Any]:
    nsp = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    return {
        "groups": groups,
        "c": groups * draw(st.integers(1, 2)),
        "k": groups * draw(st.integers(1, 2)),
        "spatial": draw(st.lists(st.integers(1, 9), min_size=nsp, max_size=nsp)),
        "kernel": draw(st.lists(st.integers(1, 4), min_size=nsp, max_size=nsp)),
        "stride": draw(st.lists(st.integers(1, 3), min_size=nsp, max_size=nsp)),
        "dilation": draw(st.lists(st.integers(1, 3), min_size=nsp, max_size=nsp)),
        "pre": draw(st.lists(st.integers(0, 3), min_size=nsp, max_size=nsp)),
        "post": draw(st.lists(st.integers(0, 3), min_size=nsp, max_size=nsp)),
    }


def torch_conv_shape(p: dict[str, Any]) -> tuple[int, ...] | None:
    f = torch.nn.functional
    nsp = len(p["spatial"])
    x = torch.zeros((1, p["c"], *p["spatial"]))
    w = torch.zeros((p["k"], p["c"] // p["groups"], *p["kernel"]))
    pads: list[int] = []
    for a, b in zip(reversed(p["pre"]), reversed(p["post"]), strict=True):
        pads += [a, b]
    conv = {1: f.conv1d, 2: f.conv2d, 3: f.conv3d}[nsp]
    try:
        y = conv(f.pad(x, pads), w, stride=p["stride"], dilation=p["dilation"], groups=p["groups"])
    except RuntimeError:
        return None  # the window does not fit
    return tuple(y.shape)


@settings(max_examples=80, deadline=None)
@given(conv_problem())
def test_conv_fprop_dims_match_torch(p: dict[str, Any]) -> None:
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [1, p["c"], *p["spatial"]])
    w = g.tensor("w", [p["k"], p["c"] // p["groups"], *p["kernel"]])
    y = g.conv_fprop(x, w, stride=p["stride"], dilation=p["dilation"], pre_padding=p["pre"], post_padding=p["post"])
    y.set_output(True)
    expected = torch_conv_shape(p)
    if expected is None or 0 in expected:
        with pytest.raises(ValidationError, match="conv_fprop_0"):
            g.validate()
    else:
        g.validate()
        assert tuple(y.dim) == expected


@settings(max_examples=40, deadline=None)
@given(conv_problem())
def test_conv_dgrad_and_wgrad_accept_exactly_the_forward_dims(p: dict[str, Any]) -> None:
    expected = torch_conv_shape(p)
    assume(expected is not None and 0 not in expected)
    assert expected is not None
    x_dims = [1, p["c"], *p["spatial"]]
    w_dims = [p["k"], p["c"] // p["groups"], *p["kernel"]]
    kw = {"stride": p["stride"], "dilation": p["dilation"], "pre_padding": p["pre"], "post_padding": p["post"]}
    g = fg.Graph(io_data_type=F32)
    dy, w, x = g.tensor("dy", expected), g.tensor("w", w_dims), g.tensor("x", x_dims)
    g.conv_dgrad(dy, w, **kw).set_dim(x_dims).set_output(True)
    g.conv_wgrad(x, dy, **kw).set_dim(w_dims).set_output(True)
    g.validate()
    bad = fg.Graph(io_data_type=F32)
    dy2 = bad.tensor("dy", [1, p["k"], *(d + 1 for d in expected[2:])])
    bad.conv_dgrad(dy2, bad.tensor("w", w_dims), **kw).set_dim(x_dims).set_output(True)
    with pytest.raises(ValidationError, match="'dy'"):
        bad.validate()


shape_st = st.lists(st.integers(1, 4), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(st.lists(shape_st, min_size=2, max_size=3))
def test_pointwise_broadcasting_matches_numpy(shapes: list[list[int]]) -> None:
    g = fg.Graph(io_data_type=F32)
    ins = [g.tensor(f"t{i}", s, data_type=BOOL if i == 2 else F32) for i, s in enumerate(shapes)]
    mode = PointwiseMode.BINARY_SELECT if len(ins) == 3 else PointwiseMode.ADD
    y = g.pointwise(*ins, mode=mode, name="pw").set_output(True)
    try:
        expected = np.broadcast_shapes(*(tuple(s) for s in shapes))
    except ValueError:
        with pytest.raises(ValidationError, match="pw"):
            g.validate()
        return
    g.validate()
    assert tuple(y.dim) == expected


@settings(max_examples=100, deadline=None)
@given(shape_st, shape_st, st.integers(1, 4), st.integers(1, 4), st.integers(1, 4))
def test_matmul_dims_match_numpy(batch_a: list[int], batch_b: list[int], m: int, k: int, n: int) -> None:
    batch_a, batch_b = batch_a[:2], batch_b[:2]
    g = fg.Graph(io_data_type=F32)
    a, b = g.tensor("a", [*batch_a, m, k]), g.tensor("b", [*batch_b, k, n])
    c = g.matmul(a, b, name="mm").set_output(True)
    try:
        expected = np.matmul(np.zeros([*batch_a, m, k]), np.zeros([*batch_b, k, n])).shape
    except ValueError:
        with pytest.raises(ValidationError, match="mm"):
            g.validate()
        return
    g.validate()
    assert tuple(c.dim) == expected


index_st = st.integers(-7, 7)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 6), min_size=1, max_size=3),
    st.lists(st.tuples(index_st, index_st, st.integers(1, 3)), min_size=1, max_size=3),
    st.booleans(),
)
def test_slice_dims_match_numpy(dims: list[int], spec: list[tuple[int, int, int]], reverse_axes: bool) -> None:
    spec = spec[: len(dims)]
    axes = list(range(len(spec)))
    if reverse_axes:
        axes = [len(dims) - 1 - a for a in axes]
    idx = [slice(None)] * len(dims)
    for a, (s, e, k) in zip(axes, spec, strict=True):
        idx[a] = slice(s, e, k)
    expected = np.empty(dims)[tuple(idx)].shape
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", dims)
    y = g.slice(x, [s for s, _, _ in spec], [e for _, e, _ in spec], [k for _, _, k in spec], axes, name="sl")
    y.set_output(True)
    if 0 in expected:
        with pytest.raises(ValidationError, match="sl"):
            g.validate()
        return
    g.validate()
    assert tuple(y.dim) == expected


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_reshape_transpose_concat_dims(dims: list[int], data: st.DataObject) -> None:
    perm = data.draw(st.permutations(list(range(len(dims)))))
    axis = data.draw(st.integers(-len(dims), len(dims) - 1))
    extra = data.draw(st.integers(1, 3))
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", dims)
    other_dims = list(dims)
    other_dims[axis] = extra
    t = g.transpose(x, perm).set_output(True)
    r = g.reshape(x, [-1, dims[-1]]).set_output(True)
    c = g.concatenate([x, g.tensor("o", other_dims)], axis=axis).set_output(True)
    g.validate()
    arr = np.empty(dims)
    assert tuple(t.dim) == np.transpose(arr, perm).shape
    assert tuple(r.dim) == arr.reshape(-1, dims[-1]).shape
    assert tuple(c.dim) == np.concatenate([arr, np.empty(other_dims)], axis=axis).shape


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 3).flatmap(
        lambda nsp: st.tuples(
            st.lists(st.integers(1, 8), min_size=nsp, max_size=nsp),
            st.lists(st.integers(1, 3), min_size=nsp, max_size=nsp),
            st.lists(st.integers(1, 3), min_size=nsp, max_size=nsp),
            st.lists(st.integers(0, 1), min_size=nsp, max_size=nsp),
        )
    )
)
def test_pooling_dims_match_torch(p: tuple[list[int], list[int], list[int], list[int]]) -> None:
    spatial, window, stride, pad = p
    assume(all(pd <= w // 2 for pd, w in zip(pad, window, strict=True)))  # torch's own limit
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [1, 2, *spatial])
    y = g.pooling(x, fg.PoolingMode.MAX, window=window, stride=stride, padding=pad, name="pool").set_output(True)
    pool = {1: torch.nn.functional.max_pool1d, 2: torch.nn.functional.max_pool2d, 3: torch.nn.functional.max_pool3d}
    try:
        expected = tuple(pool[len(spatial)](torch.zeros(1, 2, *spatial), window, stride, pad).shape)
    except RuntimeError:
        expected = None
    if expected is None or 0 in expected:
        with pytest.raises(ValidationError, match="pool"):
            g.validate()
        return
    g.validate()
    assert tuple(y.dim) == expected


def test_reduction_dims_by_axes() -> None:
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [2, 3, 4, 5])
    assert g.reduction(x, fg.ReductionMode.MAX, axes=[1, -1]).dim == [2, 1, 4, 1]
    assert g.reduction(x, fg.ReductionMode.MAX, dim=[1, 1, 1, 1]).dim == [1, 1, 1, 1]
    assert math.prod(g.reduction(x, fg.ReductionMode.AVG, axes=[0, 1, 2, 3]).dim) == 1


def test_the_user_guide_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/graph_api.md's first code block is runnable and prints what it says."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "graph_api.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert code is not None
    exec(compile(code.group(1), "graph_api.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "TensorAttr('y', dim=[2, 32, 16, 16], stride=[8192, 1, 512, 32], HALF, output)" in printed
