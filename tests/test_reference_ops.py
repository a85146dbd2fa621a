"""Every op of the float64 reference engine against an independent computation.

The independent side is ONNX Runtime where it has the op (tiny models built with
``onnx.helper``), PyTorch in float64 otherwise (conv gradients, attention, activation
backward), with fresh random data from the ``rng`` fixture. Narrow inputs (f16, bf16) are
widened exactly to float32 before ONNX Runtime sees them, so the only error measured on
fusegraph's side is its final rounding to the output type.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import NodeProto, TensorProto, helper, numpy_helper

import fusegraph as fg
from fusegraph import DataType, NormFwdPhase, OpKind, PoolingMode, ReductionMode
from fusegraph import PointwiseMode as PM
from fusegraph.graph.ops import BACKWARD, INDEXING

F16, BF16, F32, F64 = DataType.HALF, DataType.BFLOAT16, DataType.FLOAT, DataType.DOUBLE
I8, I32, I64, BOOL = DataType.INT8, DataType.INT32, DataType.INT64, DataType.BOOLEAN
FLOATS = (F32, F16, BF16)

# ---- tolerances: one table --------------------------------------------------------------
# Bounds on ||out - ref|| / ||ref||. The reference computes in float64 and rounds once to
# the output type, so the narrow-type bounds are a few units of that type's rounding
# (f16: 2^-11, bf16: 2^-8); f32 is bounded by ONNX Runtime's own float32 arithmetic.
# Integer and boolean results must be exact.
DEFAULT_TOL: dict[DataType, float] = {
    F64: 1e-12,
    F32: 1e-5,
    F16: 2e-3,
    BF16: 1e-2,
    I8: 0.0,
    I32: 0.0,
    I64: 0.0,
    BOOL: 0.0,
}
TOL: dict[str, dict[DataType, float]] = {
    # Normalizations divide by a computed deviation: ORT's float32 statistics lose a
    # little more than one rounding (the project's norms budget: 1e-4 for f32).
    "norm": {F32: 1e-4, F16: 2e-3, BF16: 1e-2},
    # ORT evaluates erf (and so exact GELU) with a float32 polynomial: ~1e-6 relative.
    "erf": {F32: 2e-5},
    # Attention compares against PyTorch in float64: only fusegraph's final rounding.
    "sdpa": {F64: 1e-12, F32: 1e-6, F16: 2e-3, BF16: 1e-2},
}


def tol(op: str, dt: DataType) -> float:
    return TOL.get(op, {}).get(dt, DEFAULT_TOL[dt])


def assert_close(out: np.ndarray, ref: np.ndarray, dt: DataType, op: str = "") -> None:
    """Relative Frobenius error and max-abs error; NaN never passes."""
    bound = tol(op, dt)
    assert out.shape == ref.shape, f"{op}: shape {out.shape} != {ref.shape}"
    if bound == 0.0:
        assert np.array_equal(np.asarray(out), np.asarray(ref)), f"{op} {dt.name}: not exact"
        return
    o = np.asarray(out, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    assert np.isfinite(r).all(), f"{op}: the independent result itself is not finite"
    assert np.isfinite(o).all(), f"{op} {dt.name}: non-finite output"
    denom = max(float(np.linalg.norm(r)), 1e-30)
    rel = float(np.linalg.norm(o - r)) / denom
    max_abs = float(np.max(np.abs(o - r))) if o.size else 0.0
    assert rel <= bound, f"{op} {dt.name}: relative error {rel:.3e} > {bound:.0e} (max abs {max_abs:.3e})"


# ---- data ----------------------------------------------------------------------------------
def rand(
    rng: np.random.Generator,
    shape: Sequence[int],
    dt: DataType,
    low: float = -2.0,
    high: float = 2.0,
) -> np.ndarray:
    """Fresh random values of ``dt`` (integers in [low, high], booleans fair coins)."""
    if dt == BOOL:
        return rng.random(shape) < 0.5
    if dt.is_integer:
        return rng.integers(int(low), int(high) + 1, size=shape).astype(dt.numpy)
    return rng.uniform(low, high, size=shape).astype(dt.numpy)


def away_from_zero(rng: np.random.Generator, shape: Sequence[int], dt: DataType) -> np.ndarray:
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)
    if dt.is_integer:
        return (sign * rng.integers(1, 6, size=shape)).astype(dt.numpy)
    return (sign * rng.uniform(0.5, 2.0, size=shape)).astype(dt.numpy)


# Memory order (outermost first) of the logical axes, written out by hand so that the
# layouts here do not come from fusegraph's own helpers.
ORDERS: dict[str, tuple[int, ...]] = {
    "NCH": (0, 1, 2),
    "NHC": (0, 2, 1),
    "NCHW": (0, 1, 2, 3),
    "NHWC": (0, 2, 3, 1),
    "NCDHW": (0, 1, 2, 3, 4),
    "NDHWC": (0, 2, 3, 4, 1),
    "CN": (1, 0),
}


def in_layout(arr: np.ndarray, name: str) -> np.ndarray:
    """The same logical array, stored in memory in the named layout."""
    order = ORDERS[name]
    return np.ascontiguousarray(arr.transpose(order)).transpose(np.argsort(order))


def channels_last(rank: int) -> str:
    return {3: "NHC", 4: "NHWC", 5: "NDHWC"}[rank]


def channels_first(rank: int) -> str:
    return {3: "NCH", 4: "NCHW", 5: "NCDHW"}[rank]


def run(g: fg.Graph, feeds: dict[fg.TensorAttr, np.ndarray], outs: Sequence[fg.TensorAttr]) -> list[np.ndarray]:
    """Executes on the reference engine; checks the returned arrays' type and layout."""
    res = g.execute(feeds, engine="reference")
    arrays = []
    for t in outs:
        arr = res[t.name]
        assert arr.dtype == t.dtype.numpy, f"{t.name}: dtype {arr.dtype} != {t.dtype.numpy}"
        assert tuple(arr.shape) == t.shape
        elem = tuple(s // arr.itemsize for s in arr.strides)
        assert all(d == 1 or e == s for d, e, s in zip(t.shape, elem, t.strides, strict=True)), (
            f"{t.name}: returned strides {elem} != declared {t.stride}"
        )
        arrays.append(arr)
    return arrays


# ---- ONNX Runtime ------------------------------------------------------------------------------
_ONNX_TYPE = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float64): TensorProto.DOUBLE,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.bool_): TensorProto.BOOL,
}


def widen(a: np.ndarray, to: type = np.float32) -> np.ndarray:
    """Exact widening of narrow floats to float32, or of all floats to float64 (ORT lacks
    most bf16/f16 kernels)."""
    if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
        return np.ascontiguousarray(a, dtype=to) if a.itemsize < np.dtype(to).itemsize else np.ascontiguousarray(a)
    return np.ascontiguousarray(a)


def ort_run(
    nodes: Sequence[NodeProto],
    feeds: dict[str, np.ndarray],
    outputs: Sequence[tuple[str, np.dtype[Any] | type]],
    *,
    consts: dict[str, np.ndarray] | None = None,
    opset: int = 20,
    wide: type = np.float32,
) -> list[np.ndarray]:
    """Runs a one-off ONNX model on ORT's CPU provider; float inputs are widened first
    (to float64 with ``wide=np.float64``, where ORT has double kernels)."""
    feeds = {k: widen(v, wide) for k, v in feeds.items()}
    graph = helper.make_graph(
        list(nodes),
        "check",
        [helper.make_tensor_value_info(k, _ONNX_TYPE[v.dtype], v.shape) for k, v in feeds.items()],
        [helper.make_tensor_value_info(k, _ONNX_TYPE[np.dtype(t)], None) for k, t in outputs],
        initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in (consts or {}).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return list(sess.run(None, feeds))


def ort_dtype(dt: DataType) -> type:
    """The type ORT computes in for fusegraph's ``dt`` (narrow floats widened)."""
    if dt.is_float:
        return np.float32 if dt != F64 else np.float64
    return dt.numpy.type  # type: ignore[no-any-return]


def torch_mod() -> Any:
    return pytest.importorskip("torch", reason="PyTorch (the test extra) is the independent side here")


# =========================== convolutions ==========================================================
# (name, N, C, K, spatial, kernel, stride, dilation, pre_pad, post_pad); groups = C / filter C.
CONV_CASES = [
    ("2d_basic", 2, 3, 4, (6, 5), (3, 3), (1, 1), (1, 1), (1, 1), (1, 1), 1),
    ("2d_groups_dil_asym", 1, 4, 6, (9, 8), (3, 2), (2, 1), (2, 1), (1, 0), (0, 2), 2),
    ("2d_depthwise", 2, 4, 4, (5, 5), (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), 4),
    ("1d_asym", 2, 3, 5, (11,), (4,), (2,), (2,), (2,), (1,), 1),
    ("3d_groups", 1, 4, 4, (5, 4, 6), (3, 2, 3), (1, 2, 2), (1, 1, 2), (1, 0, 2), (1, 1, 0), 2),
]
CONV_IDS = [c[0] for c in CONV_CASES]


def conv_torch(x: np.ndarray, w: np.ndarray, stride: Sequence[int], dil: Sequence[int],
               pre: Sequence[int], post: Sequence[int], groups: int) -> Any:
    """float64 convolution with asymmetric padding (explicit pad, then an unpadded conv)."""
    torch = torch_mod()
    f = torch.nn.functional
    pads: list[int] = []
    for a, b in zip(reversed(pre), reversed(post), strict=True):
        pads += [a, b]
    conv = {3: f.conv1d, 4: f.conv2d, 5: f.conv3d}[x.ndim]
    xt = x if hasattr(x, "requires_grad") else torch.from_numpy(np.asarray(x, dtype=np.float64))
    wt = w if hasattr(w, "requires_grad") else torch.from_numpy(np.asarray(w, dtype=np.float64))
    return conv(f.pad(xt, pads), wt, stride=tuple(stride), dilation=tuple(dil), groups=groups)


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("dt", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("case", CONV_CASES, ids=CONV_IDS)
def test_conv_fprop_vs_onnxruntime(case: tuple[Any, ...], dt: DataType, layout: str, rng: np.random.Generator) -> None:
    _, n, c, k, sp, ker, st, dil, pre, post, groups = case
    rank = 2 + len(sp)
    lay = channels_first(rank) if layout == "channels_first" else channels_last(rank)
    x = in_layout(rand(rng, (n, c, *sp), dt), lay)
    w = in_layout(rand(rng, (k, c // groups, *ker), dt), lay)
    g = fg.Graph()
    xt, wt = g.tensor_like(x, "x"), g.tensor_like(w, "w")
    y = g.conv_fprop(xt, wt, stride=st, dilation=dil, pre_padding=pre, post_padding=post).set_output(True)
    (out,) = run(g, {xt: x, wt: w}, [y])
    assert y.dtype == dt
    node = helper.make_node(
        "Conv", ["x", "w"], ["y"], strides=list(st), dilations=list(dil),
        pads=list(pre) + list(post), group=groups, kernel_shape=list(ker),
    )
    (ref,) = ort_run([node], {"x": x, "w": w}, [("y", np.float32)])
    assert_close(out, ref, dt, "conv_fprop")


@pytest.mark.parametrize("dt", (F32, F16, F64), ids=lambda d: d.name)
@pytest.mark.parametrize("case", CONV_CASES, ids=CONV_IDS)
def test_conv_dgrad_vs_torch_autograd(case: tuple[Any, ...], dt: DataType, rng: np.random.Generator) -> None:
    torch = torch_mod()
    _, n, c, k, sp, ker, st, dil, pre, post, groups = case
    rank = 2 + len(sp)
    x_shape = (n, c, *sp)
    w = in_layout(rand(rng, (k, c // groups, *ker), dt), channels_last(rank))
    xt = torch.zeros(x_shape, dtype=torch.float64, requires_grad=True)
    y_ref = conv_torch(xt, torch.from_numpy(w.astype(np.float64)), st, dil, pre, post, groups)
    dy = in_layout(rand(rng, tuple(y_ref.shape), dt), channels_last(rank))
    (dx_ref,) = torch.autograd.grad(y_ref, xt, torch.from_numpy(dy.astype(np.float64)))

    g = fg.Graph()
    dyt, wt = g.tensor_like(dy, "dy"), g.tensor_like(w, "w")
    dx = g.conv_dgrad(dyt, wt, stride=st, dilation=dil, pre_padding=pre, post_padding=post)
    dx.set_dim(x_shape).set_output(True)
    (out,) = run(g, {dyt: dy, wt: w}, [dx])
    assert_close(out, dx_ref.numpy(), dt, "conv_dgrad")


@pytest.mark.parametrize("dt", (F32, F16, F64), ids=lambda d: d.name)
@pytest.mark.parametrize("case", CONV_CASES, ids=CONV_IDS)
def test_conv_wgrad_vs_torch_autograd(case: tuple[Any, ...], dt: DataType, rng: np.random.Generator) -> None:
    torch = torch_mod()
    _, n, c, k, sp, ker, st, dil, pre, post, groups = case
    rank = 2 + len(sp)
    w_shape = (k, c // groups, *ker)
    x = in_layout(rand(rng, (n, c, *sp), dt), channels_last(rank))
    wt64 = torch.zeros(w_shape, dtype=torch.float64, requires_grad=True)
    y_ref = conv_torch(torch.from_numpy(x.astype(np.float64)), wt64, st, dil, pre, post, groups)
    dy = rand(rng, tuple(y_ref.shape), dt)
    (dw_ref,) = torch.autograd.grad(y_ref, wt64, torch.from_numpy(dy.astype(np.float64)))

    g = fg.Graph()
    xt, dyt = g.tensor_like(x, "x"), g.tensor_like(dy, "dy")
    dw = g.conv_wgrad(xt, dyt, stride=st, dilation=dil, pre_padding=pre, post_padding=post)
    dw.set_dim(w_shape).set_stride(fg.strides_for(w_shape, channels_last(rank))).set_output(True)
    (out,) = run(g, {xt: x, dyt: dy}, [dw])
    assert_close(out, dw_ref.numpy(), dt, "conv_wgrad")


@pytest.mark.parametrize("dt", (F32, F16), ids=lambda d: d.name)
def test_conv_dgrad_vs_onnxruntime_conv_transpose(dt: DataType, rng: np.random.Generator) -> None:
    """dgrad is ConvTranspose with the same filter; output_shape pins the remainder rows."""
    n, c, k, groups = 2, 4, 6, 2
    x_shape, ker, st, dil, pad = (n, c, 9, 8), (3, 3), (2, 2), (1, 2), (1, 1)
    out_sp = [(x + 2 * p - d * (kk - 1) - 1) // s + 1 for x, kk, s, d, p in zip(x_shape[2:], ker, st, dil, pad, strict=True)]
    dy = rand(rng, (n, k, *out_sp), dt)
    w = rand(rng, (k, c // groups, *ker), dt)
    g = fg.Graph()
    dyt, wt = g.tensor_like(dy, "dy"), g.tensor_like(w, "w")
    dx = g.conv_dgrad(dyt, wt, padding=pad, stride=st, dilation=dil).set_dim(x_shape).set_output(True)
    (out,) = run(g, {dyt: dy, wt: w}, [dx])
    # ConvTranspose's weight is (C_in=K, C_out/groups, ...): exactly the conv filter.
    node = helper.make_node(
        "ConvTranspose", ["dy", "w"], ["dx"], strides=list(st), dilations=list(dil),
        pads=list(pad) * 2, group=groups, output_shape=list(x_shape[2:]), kernel_shape=list(ker),
    )
    (ref,) = ort_run([node], {"dy": dy, "w": w}, [("dx", np.float32)])
    assert_close(out, ref, dt, "conv_dgrad")


# =========================== matmul ==================================================================
@pytest.mark.parametrize("dt", (F32, F16, BF16, I32), ids=lambda d: d.name)
@pytest.mark.parametrize(
    "a_shape,b_shape,trans_a,trans_b",
    [
        ((3, 5), (5, 4), False, False),
        ((2, 1, 3, 5), (4, 5, 6), False, False),  # batch dims broadcast
        ((3, 5), (2, 5, 4), False, True),  # B transposed through strides
        ((2, 3, 5), (5, 4), True, False),  # A transposed through strides
        ((1, 4, 7), (3, 7, 2), True, True),
    ],
)
def test_matmul_vs_onnxruntime(
    a_shape: tuple[int, ...], b_shape: tuple[int, ...], trans_a: bool, trans_b: bool, dt: DataType, rng: np.random.Generator
) -> None:
    a = rand(rng, a_shape, dt, -3, 3)
    b = rand(rng, b_shape, dt, -3, 3)
    # A "transposed" operand is stored K-major: its last two axes swapped in memory.
    if trans_a:
        a = np.ascontiguousarray(np.swapaxes(a, -1, -2)).swapaxes(-1, -2)
    if trans_b:
        b = np.ascontiguousarray(np.swapaxes(b, -1, -2)).swapaxes(-1, -2)
    g = fg.Graph()
    at, bt = g.tensor_like(a, "A"), g.tensor_like(b, "B")
    assert (at.stride[-2] == 1) == trans_a and (bt.stride[-2] == 1) == trans_b
    c = g.matmul(at, bt).set_output(True)
    (out,) = run(g, {at: a, bt: b}, [c])
    (ref,) = ort_run([helper.make_node("MatMul", ["a", "b"], ["c"])], {"a": a, "b": b}, [("c", ort_dtype(dt))])
    assert_close(out, ref, dt, "matmul")


def test_matmul_stride0_broadcast_operand(rng: np.random.Generator) -> None:
    """A bias-like operand shared over the batch, declared with a zero batch stride."""
    a = rand(rng, (4, 3, 5), F32)
    b_small = rand(rng, (5, 2), F32)
    b = np.broadcast_to(b_small, (4, 5, 2))
    g = fg.Graph()
    at, bt = g.tensor_like(a, "A"), g.tensor_like(b, "B")
    assert bt.stride == [0, 2, 1]
    c = g.matmul(at, bt).set_output(True)
    (out,) = run(g, {at: a, bt: b}, [c])
    (ref,) = ort_run([helper.make_node("MatMul", ["a", "b"], ["c"])], {"a": a, "b": b_small}, [("c", np.float32)])
    assert_close(out, ref, F32, "matmul")


# =========================== pointwise ==============================================================
def _nodes(*specs: tuple[str, list[str], str, dict[str, Any]]) -> list[NodeProto]:
    return [helper.make_node(op, ins, [out], **attrs) for op, ins, out, attrs in specs]


def onnx_op(op: str, **attrs: Any) -> Callable[[list[str]], list[NodeProto]]:
    return lambda ins: _nodes((op, ins, "y", attrs))


class Pw:
    """One pointwise case: the mode, its ONNX equivalent and the inputs it is defined on."""

    def __init__(
        self,
        mode: PM,
        onnx: Callable[[list[str]], list[NodeProto]],
        dtypes: Sequence[DataType] = FLOATS,
        domains: Sequence[str] = ("any",),
        params: dict[str, float] | None = None,
        consts: dict[str, np.ndarray] | None = None,
        opset: int = 20,
        op: str = "",
        id: str = "",
    ) -> None:
        self.mode, self.onnx, self.dtypes, self.domains = mode, onnx, tuple(dtypes), tuple(domains)
        self.params, self.consts, self.opset, self.op = params or {}, consts or {}, opset, op
        self.id = id or mode.name


NUM = (F32, F16, BF16, I32)
CMP = (F32, F16, I32, I8)
f32c = np.float32
PW_CASES = [
    Pw(PM.ADD, onnx_op("Add"), NUM, ("any", "any")),
    Pw(PM.SUB, onnx_op("Sub"), NUM, ("any", "any")),
    Pw(PM.MUL, onnx_op("Mul"), NUM, ("any", "any")),
    Pw(PM.DIV, onnx_op("Div"), NUM, ("any", "nonzero")),
    Pw(PM.MAX, onnx_op("Max"), NUM, ("any", "any")),
    Pw(PM.MIN, onnx_op("Min"), NUM, ("any", "any")),
    Pw(PM.POW, onnx_op("Pow"), FLOATS, ("pos", "any")),
    Pw(PM.ABS, onnx_op("Abs"), NUM),
    Pw(PM.NEG, onnx_op("Neg"), NUM),
    Pw(PM.EXP, onnx_op("Exp")),
    Pw(PM.LOG, onnx_op("Log"), domains=("pos",)),
    Pw(PM.SQRT, onnx_op("Sqrt"), domains=("pos",)),
    Pw(PM.RSQRT, lambda i: _nodes(("Sqrt", i, "s", {}), ("Reciprocal", ["s"], "y", {})), domains=("pos",)),
    Pw(PM.RECIPROCAL, onnx_op("Reciprocal"), domains=("nonzero",)),
    Pw(PM.SIN, onnx_op("Sin")),
    Pw(PM.COS, onnx_op("Cos")),
    Pw(PM.ERF, onnx_op("Erf"), op="erf"),
    Pw(PM.FLOOR, onnx_op("Floor")),
    Pw(PM.CEIL, onnx_op("Ceil")),
    Pw(PM.IDENTITY, onnx_op("Identity"), (F32, F16, BF16, I32, BOOL)),
    Pw(PM.RELU_FWD, onnx_op("Relu"), (F32, F16, BF16, I32)),
    Pw(PM.RELU_FWD, onnx_op("LeakyRelu", alpha=0.125), params={"relu_lower_clip_slope": 0.125}, id="RELU_FWD_leaky"),
    Pw(
        PM.RELU_FWD, lambda i: _nodes(("Clip", [i[0], "lo", "hi"], "y", {})),
        params={"relu_lower_clip": -0.5, "relu_upper_clip": 1.25},
        consts={"lo": f32c(-0.5), "hi": f32c(1.25)}, id="RELU_FWD_clipped",
    ),
    Pw(PM.TANH_FWD, onnx_op("Tanh")),
    Pw(PM.SIGMOID_FWD, onnx_op("Sigmoid")),
    Pw(PM.GELU_FWD, onnx_op("Gelu"), op="erf"),
    Pw(PM.GELU_APPROX_TANH_FWD, onnx_op("Gelu", approximate="tanh")),
    Pw(PM.ELU_FWD, onnx_op("Elu")),
    Pw(PM.ELU_FWD, onnx_op("Elu", alpha=0.7), params={"elu_alpha": 0.7}, id="ELU_FWD_alpha"),
    Pw(PM.SWISH_FWD, onnx_op("Swish"), opset=24),
    Pw(PM.SWISH_FWD, onnx_op("Swish", alpha=1.75), params={"swish_beta": 1.75}, opset=24, id="SWISH_FWD_beta"),
    Pw(PM.SOFTPLUS_FWD, onnx_op("Softplus")),
    Pw(
        PM.SOFTPLUS_FWD,
        lambda i: _nodes(("Mul", [i[0], "beta"], "t", {}), ("Softplus", ["t"], "s", {}), ("Div", ["s", "beta"], "y", {})),
        params={"softplus_beta": 2.5}, consts={"beta": f32c(2.5)}, id="SOFTPLUS_FWD_beta",
    ),
    Pw(PM.CMP_EQ, onnx_op("Equal"), CMP, ("any", "tie")),
    Pw(PM.CMP_NEQ, lambda i: _nodes(("Equal", i, "e", {}), ("Not", ["e"], "y", {})), CMP, ("any", "tie")),
    Pw(PM.CMP_GT, onnx_op("Greater"), CMP, ("any", "tie")),
    Pw(PM.CMP_GE, onnx_op("GreaterOrEqual"), CMP, ("any", "tie")),
    Pw(PM.CMP_LT, onnx_op("Less"), CMP, ("any", "tie")),
    Pw(PM.CMP_LE, onnx_op("LessOrEqual"), CMP, ("any", "tie")),
    Pw(PM.LOGICAL_AND, onnx_op("And"), (BOOL,), ("any", "any")),
    Pw(PM.LOGICAL_OR, onnx_op("Or"), (BOOL,), ("any", "any")),
    Pw(PM.LOGICAL_NOT, onnx_op("Not"), (BOOL,)),
    Pw(PM.BINARY_SELECT, lambda i: _nodes(("Where", [i[2], i[0], i[1]], "y", {})), (F32, F16, I32, I64), ("any", "any", "bool")),
]
PW_PARAMS = [pytest.param(c, dt, id=f"{c.id}-{dt.name}") for c in PW_CASES for dt in c.dtypes]


def pw_input(rng: np.random.Generator, shape: Sequence[int], dt: DataType, domain: str, first: np.ndarray | None) -> np.ndarray:
    if domain == "bool":
        return rand(rng, shape, BOOL)
    if domain == "pos":
        return rand(rng, shape, dt, 0.1, 3.0)
    if domain == "nonzero":
        return away_from_zero(rng, shape, dt)
    arr = rand(rng, shape, dt, -4 if dt.is_integer else -2.5, 4 if dt.is_integer else 2.5)
    if domain == "tie" and first is not None and first.shape == arr.shape:
        arr = np.where(rng.random(shape) < 0.4, first, arr)  # make equal pairs common
    return arr


def _check_pointwise(
    case: Pw, dt: DataType, shapes: Sequence[Sequence[int]], rng: np.random.Generator,
    layout: str | None = None, broadcast_stride0: bool = False,
) -> None:
    arrays: list[np.ndarray] = []
    for shape, domain in zip(shapes, case.domains, strict=True):
        arrays.append(pw_input(rng, shape, dt, domain, arrays[0] if arrays else None))
    full = np.broadcast_shapes(*(a.shape for a in arrays))
    ort_feeds = {f"i{j}": a for j, a in enumerate(arrays)}
    if layout is not None:
        arrays = [in_layout(a, layout) for a in arrays]
    if broadcast_stride0:  # declare the operands at full size with zero strides
        arrays = [np.broadcast_to(a, full) for a in arrays]
    g = fg.Graph()
    ts = [g.tensor_like(a, f"in{j}") for j, a in enumerate(arrays)]
    y = g.pointwise(*ts, mode=case.mode, **case.params).set_output(True)
    (out,) = run(g, dict(zip(ts, arrays, strict=True)), [y])
    out_dt = BOOL if case.mode.name.startswith(("CMP_", "LOGICAL_")) else dt
    assert y.dtype == out_dt
    (ref,) = ort_run(
        case.onnx(list(ort_feeds)), ort_feeds, [("y", ort_dtype(out_dt))],
        consts=case.consts, opset=case.opset,
    )
    assert_close(out, ref, out_dt, case.op or case.mode.name)


@pytest.mark.parametrize("case,dt", PW_PARAMS)
def test_pointwise_vs_onnxruntime(case: Pw, dt: DataType, rng: np.random.Generator) -> None:
    shape = (2, 3, 4, 5)
    _check_pointwise(case, dt, [shape] * len(case.domains), rng)


@pytest.mark.parametrize("case", [c for c in PW_CASES if len(c.domains) > 1], ids=lambda c: c.id)
def test_pointwise_broadcasting_vs_onnxruntime(case: Pw, rng: np.random.Generator) -> None:
    """NumPy broadcasting across ranks: [2,3,4,5] with [3,1,5] (and [4,1] for the third)."""
    dt = case.dtypes[0]
    shapes = [(2, 3, 4, 5), (3, 1, 5), (4, 1)][: len(case.domains)]
    _check_pointwise(case, dt, shapes, rng)
    _check_pointwise(case, dt, shapes[::-1] if len(shapes) == 2 else shapes, rng)


@pytest.mark.parametrize("case", [c for c in PW_CASES if len(c.domains) > 1], ids=lambda c: c.id)
def test_pointwise_stride0_inputs_vs_onnxruntime(case: Pw, rng: np.random.Generator) -> None:
    """Operands declared at full size with zero (broadcast) strides, as np.broadcast_to makes."""
    dt = case.dtypes[0]
    shapes = [(1, 3, 4, 5), (2, 3, 1, 5), (2, 1, 4, 1)][: len(case.domains)]
    _check_pointwise(case, dt, shapes, rng, broadcast_stride0=True)


@pytest.mark.parametrize("case", [c for c in PW_CASES if c.dtypes != (BOOL,)], ids=lambda c: c.id)
def test_pointwise_nhwc_layout_vs_onnxruntime(case: Pw, rng: np.random.Generator) -> None:
    dt = case.dtypes[0]
    _check_pointwise(case, dt, [(2, 3, 4, 5)] * len(case.domains), rng, layout="NHWC")


@pytest.mark.parametrize("dt", (F32, F16, I32), ids=lambda d: d.name)
@pytest.mark.parametrize("mode,onnx_name", [(PM.ADD, "Add"), (PM.MUL, "Mul"), (PM.SUB, "Sub"), (PM.MAX, "Max")])
def test_pointwise_with_inlined_scalar(mode: PM, onnx_name: str, dt: DataType, rng: np.random.Generator) -> None:
    """g.scalar constants are weakly typed: they never widen the tensor's type."""
    x = rand(rng, (3, 4), dt)
    value = int(rng.integers(-3, 4)) if dt.is_integer else float(rng.uniform(-2, 2))
    g = fg.Graph()
    xt = g.tensor_like(x, "x")
    y = g.pointwise(xt, g.scalar(value), mode=mode).set_output(True)
    (out,) = run(g, {xt: x}, [y])
    assert y.dtype == dt
    const = np.array([value], dtype=np.int32 if dt.is_integer else np.float32)
    (ref,) = ort_run(onnx_op(onnx_name)(["x", "s"]), {"x": x}, [("y", ort_dtype(dt))], consts={"s": const})
    assert_close(out, ref, dt, mode.name)


BWD = {
    PM.RELU_BWD: "relu",
    PM.GELU_BWD: "gelu",
    PM.TANH_BWD: "tanh",
    PM.SIGMOID_BWD: "sigmoid",
}


@pytest.mark.parametrize("dt", (F64, F32, F16, BF16), ids=lambda d: d.name)
@pytest.mark.parametrize("mode", list(BWD), ids=lambda m: m.name)
def test_activation_backward_vs_torch_autograd(mode: PM, dt: DataType, rng: np.random.Generator) -> None:
    torch = torch_mod()
    dy, x = rand(rng, (3, 4, 5), dt), rand(rng, (3, 4, 5), dt, -3, 3)
    g = fg.Graph()
    dyt, xt = g.tensor_like(dy, "dy"), g.tensor_like(x, "x")
    dx = g.pointwise(dyt, xt, mode=mode).set_output(True)
    (out,) = run(g, {dyt: dy, xt: x}, [dx])
    xx = torch.tensor(x.astype(np.float64), requires_grad=True)
    fwd = getattr(torch, BWD[mode], None) or getattr(torch.nn.functional, BWD[mode])
    (ref,) = torch.autograd.grad(fwd(xx), xx, torch.tensor(dy.astype(np.float64)))
    assert_close(out, ref.numpy(), dt, mode.name)


def test_every_pointwise_mode_is_tested() -> None:
    # the activation backward modes with parameters: tests/test_backward_ops.py (against torch.autograd)
    elsewhere = {PM.ELU_BWD, PM.GELU_APPROX_TANH_BWD, PM.SOFTPLUS_BWD, PM.SWISH_BWD}
    tested = {c.mode for c in PW_CASES} | set(BWD) | elsewhere
    assert tested == set(PM), f"untested pointwise modes: {sorted(m.name for m in set(PM) - tested)}"


def test_leaky_relu_and_convenience_methods_vs_onnxruntime(rng: np.random.Generator) -> None:
    """The cuDNN-style helpers build the modes and parameters they are named after."""
    x = rand(rng, (4, 6), F32, -3, 3)
    g = fg.Graph()
    xt = g.tensor_like(x, "x")
    outs = {
        "leaky": g.leaky_relu(xt, 0.2),
        "relu6": g.relu(xt, upper_clip=6.0, negative_slope=0.0),
        "elu": g.elu(xt, alpha=0.3),
        "swish": g.swish(xt, beta=0.5),
        "softplus": g.softplus(xt, beta=3.0),
        "gelu": g.gelu(xt),
        "sigmoid": g.sigmoid(xt),
        "tanh": g.tanh(xt),
    }
    for t in outs.values():
        t.set_output(True)
    res = run(g, {xt: x}, list(outs.values()))
    nodes = [
        ("LeakyRelu", ["x"], "leaky", {"alpha": 0.2}),
        ("Clip", ["x", "zero", "six"], "relu6", {}),
        ("Elu", ["x"], "elu", {"alpha": 0.3}),
        ("Swish", ["x"], "swish", {"alpha": 0.5}),
        ("Mul", ["x", "three"], "x3", {}),
        ("Softplus", ["x3"], "sp3", {}),
        ("Div", ["sp3", "three"], "softplus", {}),
        ("Gelu", ["x"], "gelu", {}),
        ("Sigmoid", ["x"], "sigmoid", {}),
        ("Tanh", ["x"], "tanh", {}),
    ]
    consts = {"zero": f32c(0), "six": f32c(6), "three": f32c(3)}
    refs = ort_run(_nodes(*nodes), {"x": x}, [(k, np.float32) for k in outs], consts=consts, opset=24)
    for (name, _), out, ref in zip(outs.items(), res, refs, strict=True):
        assert_close(out, ref, F32, "erf" if name == "gelu" else name)


# =========================== reductions ================================================================
REDUCE_ONNX: dict[ReductionMode, Callable[[str, str], list[NodeProto]]] = {
    ReductionMode.SUM: lambda x, ax: _nodes(("ReduceSum", [x, ax], "y", {"keepdims": 1})),
    ReductionMode.MIN: lambda x, ax: _nodes(("ReduceMin", [x, ax], "y", {"keepdims": 1})),
    ReductionMode.MAX: lambda x, ax: _nodes(("ReduceMax", [x, ax], "y", {"keepdims": 1})),
    ReductionMode.AMAX: lambda x, ax: _nodes(("Abs", [x], "a", {}), ("ReduceMax", ["a", ax], "y", {"keepdims": 1})),
    ReductionMode.AVG: lambda x, ax: _nodes(("ReduceMean", [x, ax], "y", {"keepdims": 1})),
    ReductionMode.MUL: lambda x, ax: _nodes(("ReduceProd", [x, ax], "y", {"keepdims": 1})),
    ReductionMode.NORM1: lambda x, ax: _nodes(("ReduceL1", [x, ax], "y", {"keepdims": 1})),
    ReductionMode.NORM2: lambda x, ax: _nodes(("ReduceL2", [x, ax], "y", {"keepdims": 1})),
}
# Integer reductions whose result is an integer by definition (ORT has integer kernels too).
INT_REDUCTIONS = {ReductionMode.SUM, ReductionMode.MIN, ReductionMode.MAX, ReductionMode.MUL, ReductionMode.AMAX}
REDUCE_PARAMS = [
    pytest.param(m, dt, id=f"{m.name}-{dt.name}")
    for m in ReductionMode
    for dt in (F32, F16, BF16, I32)
    if not dt.is_integer or m in INT_REDUCTIONS
]


def test_every_reduction_mode_is_tested() -> None:
    assert set(REDUCE_ONNX) == set(ReductionMode)


@pytest.mark.parametrize("axes", [(1,), (0, 2), (0, 1, 2, 3), (3,)], ids=str)
@pytest.mark.parametrize("mode,dt", REDUCE_PARAMS)
def test_reduction_vs_onnxruntime(mode: ReductionMode, dt: DataType, axes: tuple[int, ...], rng: np.random.Generator) -> None:
    shape = (2, 3, 4, 3)
    # Products of many values under/overflow narrow types: keep magnitudes near one there.
    lo, hi = (0.7, 1.3) if mode == ReductionMode.MUL and not dt.is_integer else (-3, 3)
    x = in_layout(rand(rng, shape, dt, lo, hi), "NHWC")
    g = fg.Graph()
    xt = g.tensor_like(x, "x")
    dims = [1 if i in axes else d for i, d in enumerate(shape)]
    y = g.reduction(xt, mode, dim=dims).set_output(True)
    (out,) = run(g, {xt: x}, [y])
    assert y.dim == dims and y.dtype == dt
    # In float64: a float32 sum that cancels to near zero would be far off relatively.
    (ref,) = ort_run(
        REDUCE_ONNX[mode]("x", "axes"), {"x": x}, [("y", np.float64 if dt.is_float else dt.numpy.type)],
        consts={"axes": np.array(axes, dtype=np.int64)}, opset=18, wide=np.float64,
    )
    assert_close(out, ref, dt, mode.name)


def test_reduction_axes_argument_matches_dim_argument(rng: np.random.Generator) -> None:
    x = rand(rng, (2, 3, 4), F32)
    g = fg.Graph()
    xt = g.tensor_like(x, "x")
    a = g.reduction(xt, ReductionMode.SUM, axes=[-1, 0]).set_output(True)
    b = g.reduction(xt, ReductionMode.SUM, dim=[1, 3, 1]).set_output(True)
    out_a, out_b = run(g, {xt: x}, [a, b])
    assert a.dim == [1, 3, 1]
    assert_close(out_a, x.astype(np.float64).sum(axis=(0, 2), keepdims=True), F32, "sum")
    np.testing.assert_array_equal(out_a, out_b)


# =========================== normalizations ================================================================
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dt", FLOATS, ids=lambda d: d.name)
def test_batchnorm_inference_vs_onnxruntime(dt: DataType, layout: str, rng: np.random.Generator) -> None:
    n, c, h, w = 2, 5, 4, 3
    x = in_layout(rand(rng, (n, c, h, w), dt), layout)
    scale, bias, mean = rand(rng, (c,), dt), rand(rng, (c,), dt), rand(rng, (c,), dt)
    var = rand(rng, (c,), dt, 0.2, 2.0)
    g = fg.Graph()
    ts = [g.tensor_like(a, nm) for a, nm in ((x, "x"), (scale, "s"), (bias, "b"), (mean, "m"), (var, "v"))]
    y = g.batchnorm_inference(*ts, epsilon=1e-3).set_output(True)
    (out,) = run(g, dict(zip(ts, (x, scale, bias, mean, var), strict=True)), [y])
    node = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], epsilon=1e-3)
    (ref,) = ort_run([node], {"x": x, "s": scale, "b": bias, "m": mean, "v": var}, [("y", np.float32)], opset=15)
    assert_close(out, ref, dt, "norm")


@pytest.mark.parametrize("shape", [(4, 3), (3, 4, 5), (2, 3, 4, 5), (2, 3, 2, 3, 2)], ids=str)
@pytest.mark.parametrize("dt", FLOATS, ids=lambda d: d.name)
def test_batchnorm_training_vs_torch(dt: DataType, shape: tuple[int, ...], rng: np.random.Generator) -> None:
    torch = torch_mod()
    c = shape[1]
    x = rand(rng, shape, dt) * 3 + 1
    scale, bias = rand(rng, (1, c) + (1,) * (len(shape) - 2), dt), rand(rng, (c,), dt)
    g = fg.Graph()
    xt, st, bt = g.tensor_like(x, "x"), g.tensor_like(scale, "scale"), g.tensor_like(bias, "bias")
    eps = g.scalar(1e-4)
    y, mean, inv_var = g.batchnorm(xt, st, bt, epsilon=eps)
    for t in (y, mean, inv_var):
        t.set_output(True)
    out_y, out_m, out_iv = run(g, {xt: x, st: scale, bt: bias}, [y, mean, inv_var])
    stats_dims = [1, c] + [1] * (len(shape) - 2)
    assert mean.dim == stats_dims and inv_var.dim == stats_dims
    assert mean.dtype == F32  # statistics are kept in float32 for narrow inputs
    x64 = torch.tensor(x.astype(np.float64))
    ref_y = torch.nn.functional.batch_norm(
        x64, None, None, torch.tensor(scale.astype(np.float64).reshape(-1)),
        torch.tensor(bias.astype(np.float64)), training=True, eps=1e-4,
    )
    axes = [0, *range(2, len(shape))]
    var, m = torch.var_mean(x64, dim=axes, keepdim=True, correction=0)
    assert_close(out_y, ref_y.numpy(), dt, "norm")
    assert_close(out_m, m.numpy(), F32, "norm")
    assert_close(out_iv, (1.0 / torch.sqrt(var + 1e-4)).numpy(), F32, "norm")


@pytest.mark.parametrize("phase", list(NormFwdPhase), ids=lambda p: p.name)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dt", FLOATS, ids=lambda d: d.name)
def test_layernorm_vs_onnxruntime(dt: DataType, layout: str, phase: NormFwdPhase, rng: np.random.Generator) -> None:
    n, c, h, w = 3, 4, 2, 5
    x = in_layout(rand(rng, (n, c, h, w), dt) * 2 + 0.5, layout)
    scale, bias = rand(rng, (1, c, h, w), dt), rand(rng, (c, h, w), dt)
    g = fg.Graph()
    xt, st, bt = g.tensor_like(x, "x"), g.tensor_like(scale, "scale"), g.tensor_like(bias, "bias")
    y, mean, inv_var = g.layernorm(xt, st, bt, epsilon=1e-5, phase=phase)
    if phase == NormFwdPhase.INFERENCE:
        assert mean is None and inv_var is None
        outs = [y.set_output(True)]
    else:
        assert mean is not None and inv_var is not None
        outs = [t.set_output(True) for t in (y, mean, inv_var)]
    res = run(g, {xt: x, st: scale, bt: bias}, outs)
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv"], axis=1, epsilon=1e-5)
    refs = ort_run(
        [node], {"x": x, "s": scale.reshape(c, h, w), "b": bias},
        [("y", np.float32), ("mean", np.float32), ("inv", np.float32)], opset=17,
    )
    assert_close(res[0], refs[0], dt, "norm")
    if phase == NormFwdPhase.TRAINING:
        assert mean is not None and mean.dim == [n, 1, 1, 1]
        assert_close(res[1], refs[1], F32, "norm")
        assert_close(res[2], refs[2], F32, "norm")


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("phase", list(NormFwdPhase), ids=lambda p: p.name)
@pytest.mark.parametrize("dt", FLOATS, ids=lambda d: d.name)
def test_rmsnorm_vs_onnxruntime(dt: DataType, phase: NormFwdPhase, with_bias: bool, rng: np.random.Generator) -> None:
    n, s, d = 3, 4, 8
    x = rand(rng, (n, s, d), dt)
    scale = rand(rng, (d,), dt)  # broadcast over the sequence axis
    bias = rand(rng, (s, d), dt)
    g = fg.Graph()
    xt, st = g.tensor_like(x, "x"), g.tensor_like(scale, "scale")
    bt = g.tensor_like(bias, "bias") if with_bias else None
    y, inv_rms = g.rmsnorm(xt, st, epsilon=1e-6, phase=phase, bias=bt)
    outs = [y.set_output(True)]
    if phase == NormFwdPhase.TRAINING:
        assert inv_rms is not None
        outs.append(inv_rms.set_output(True))
    else:
        assert inv_rms is None
    feeds = {xt: x, st: scale} | ({bt: bias} if bt is not None else {})
    res = run(g, feeds, outs)
    nodes = _nodes(("RMSNormalization", ["x", "s"], "r", {"axis": 1, "epsilon": 1e-6}))
    nodes += _nodes(("Add", ["r", "b"], "y", {})) if with_bias else _nodes(("Identity", ["r"], "y", {}))
    # inv_rms = 1 / sqrt(mean(x^2) + eps), over every axis but the first.
    nodes += _nodes(
        ("Mul", ["x", "x"], "sq", {}),
        ("ReduceMean", ["sq", "axes"], "ms", {"keepdims": 1}),
        ("Add", ["ms", "eps"], "mse", {}),
        ("Sqrt", ["mse"], "rms", {}),
        ("Reciprocal", ["rms"], "inv", {}),
    )
    feeds_ort = {"x": x, "s": np.broadcast_to(scale, (s, d))} | ({"b": bias} if with_bias else {})
    consts = {"axes": np.array([1, 2], dtype=np.int64), "eps": f32c(1e-6)}
    ref_y, ref_inv = ort_run(nodes, feeds_ort, [("y", np.float32), ("inv", np.float32)], consts=consts, opset=23)
    assert_close(res[0], ref_y, dt, "norm")
    if phase == NormFwdPhase.TRAINING:
        assert_close(res[1], ref_inv, F32, "norm")


def test_epsilon_as_a_scalar_tensor_vs_float(rng: np.random.Generator) -> None:
    """epsilon may be a float or a scalar tensor; a large epsilon makes the difference visible."""
    x = rand(rng, (2, 6), F32, -0.3, 0.3)
    scale, bias = rand(rng, (1, 6), F32), rand(rng, (1, 6), F32)
    g = fg.Graph()
    xt, st, bt = g.tensor_like(x, "x"), g.tensor_like(scale, "s"), g.tensor_like(bias, "b")
    y1, _, _ = g.layernorm(xt, st, bt, epsilon=0.25)
    y2, _, _ = g.layernorm(xt, st, bt, epsilon=g.scalar(0.25, np.float32))
    out1, out2 = run(g, {xt: x, st: scale, bt: bias}, [y1.set_output(True), y2.set_output(True)])
    x64 = x.astype(np.float64)
    ref = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 0.25) * scale + bias
    assert_close(out1, ref, F32, "norm")
    np.testing.assert_array_equal(out1, out2)


# =========================== pooling ==========================================================================
POOL_CASES = [
    ("1d", (2, 3, 9), (3,), (2,), (1,), (1,)),
    ("2d", (2, 3, 7, 6), (3, 2), (2, 1), (1, 0), (1, 1)),
    ("2d_overlap", (1, 2, 5, 5), (3, 3), (1, 1), (1, 1), (1, 1)),
    ("3d", (1, 2, 5, 4, 6), (2, 3, 2), (1, 1, 2), (1, 1, 0), (0, 1, 1)),
]
POOL_ONNX = {
    PoolingMode.MAX: ("MaxPool", {}),
    PoolingMode.AVG_INCLUDE_PAD: ("AveragePool", {"count_include_pad": 1}),
    PoolingMode.AVG_EXCLUDE_PAD: ("AveragePool", {"count_include_pad": 0}),
}


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("dt", (F32, F16), ids=lambda d: d.name)
@pytest.mark.parametrize("mode", list(PoolingMode), ids=lambda m: m.name)
@pytest.mark.parametrize("case", POOL_CASES, ids=[c[0] for c in POOL_CASES])
def test_pooling_vs_onnxruntime(case: tuple[Any, ...], mode: PoolingMode, dt: DataType, layout: str, rng: np.random.Generator) -> None:
    _, shape, window, stride, pre, post = case
    lay = channels_first(len(shape)) if layout == "channels_first" else channels_last(len(shape))
    x = in_layout(rand(rng, shape, dt), lay)
    g = fg.Graph()
    xt = g.tensor_like(x, "x")
    y = g.pooling(xt, mode, window=window, stride=stride, pre_padding=pre, post_padding=post).set_output(True)
    (out,) = run(g, {xt: x}, [y])
    assert y.stride == list(fg.strides_for(y.dim, lay)), "pooling keeps its input's layout"
    op, attrs = POOL_ONNX[mode]
    node = helper.make_node(op, ["x"], ["y"], kernel_shape=list(window), strides=list(stride), pads=list(pre) + list(post), **attrs)
    (ref,) = ort_run([node], {"x": x}, [("y", np.float32)])
    assert_close(out, ref, dt, mode.name)


# =========================== attention, softmax ================================================================
SDPA_CASES = [
    # (id, batch, q heads, kv heads, q len, kv len, head dim, v dim, causal, mask, scale)
    ("plain", 2, 2, 2, 5, 5, 8, 8, False, None, None),
    ("scale_vdim", 1, 3, 3, 4, 6, 8, 5, False, None, 0.3),
    ("causal", 2, 2, 2, 6, 6, 4, 4, True, None, None),
    ("causal_rect", 1, 2, 2, 3, 5, 4, 4, True, None, None),
    ("bool_mask", 2, 2, 2, 4, 5, 4, 4, False, "bool", None),
    ("float_mask", 2, 2, 2, 4, 5, 4, 4, False, "float", None),
    ("gqa", 2, 4, 2, 5, 7, 8, 8, False, None, None),
    ("gqa_causal_mask", 1, 6, 2, 5, 5, 4, 4, True, "float", 0.5),
]


@pytest.mark.parametrize("dt", (F64, F32, F16, BF16), ids=lambda d: d.name)
@pytest.mark.parametrize("case", SDPA_CASES, ids=[c[0] for c in SDPA_CASES])
def test_sdpa_vs_torch(case: tuple[Any, ...], dt: DataType, rng: np.random.Generator) -> None:
    torch = torch_mod()
    _, b, hq, hkv, sq, skv, d, dv, causal, mask_kind, scale = case
    q, k, v = rand(rng, (b, hq, sq, d), dt), rand(rng, (b, hkv, skv, d), dt), rand(rng, (b, hkv, skv, dv), dt)
    # A transposed-in-memory K (seq-minor), as a [b, h, d, s] buffer viewed logically.
    k = np.ascontiguousarray(k.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    mask = None
    if mask_kind == "bool":
        mask = rng.random((b, 1, sq, skv)) < 0.7
        mask[..., 0] = True  # no row fully masked
    elif mask_kind == "float":
        mask = rand(rng, (1, 1, sq, skv), dt)
    g = fg.Graph()
    qt, kt, vt = g.tensor_like(q, "q"), g.tensor_like(k, "k"), g.tensor_like(v, "v")
    mt = g.tensor_like(mask, "mask") if mask is not None else None
    o = g.sdpa(qt, kt, vt, attn_scale=scale, causal=causal, mask=mt).set_output(True)
    feeds = {qt: q, kt: k, vt: v} | ({mt: mask} if mt is not None else {})
    (out,) = run(g, feeds, [o])
    t64 = [torch.tensor(np.asarray(a, dtype=np.float64)) for a in (q, k, v)]
    attn_mask = None
    if mask is not None:
        attn_mask = torch.tensor(mask) if mask.dtype == np.bool_ else torch.tensor(mask.astype(np.float64))
    if causal and attn_mask is not None:  # torch takes one or the other: fold causal into the mask
        tri = torch.ones(sq, skv, dtype=torch.bool).tril()
        attn_mask = attn_mask.masked_fill(~tri, float("-inf")) if attn_mask.dtype != torch.bool else attn_mask & tri
        causal = False
    ref = torch.nn.functional.scaled_dot_product_attention(
        *t64, attn_mask=attn_mask, is_causal=causal, scale=scale, enable_gqa=hq != hkv
    )
    assert_close(out, ref.numpy(), dt, "sdpa")


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("axis", [-1, 1, 0])
@pytest.mark.parametrize("dt", FLOATS, ids=lambda d: d.name)
def test_softmax_vs_onnxruntime(dt: DataType, axis: int, log: bool, rng: np.random.Generator) -> None:
    x = in_layout(rand(rng, (3, 4, 5, 2), dt, -4, 4), "NHWC")
    g = fg.Graph()
    xt = g.tensor_like(x, "x")
    y = g.softmax(xt, axis=axis, log=log).set_output(True)
    (out,) = run(g, {xt: x}, [y])
    node = helper.make_node("LogSoftmax" if log else "Softmax", ["x"], ["y"], axis=axis)
    (ref,) = ort_run([node], {"x": x}, [("y", np.float32)], opset=13)
    assert_close(out, ref, dt, "softmax")


# =========================== data movement =====================================================================
MOVE_DTYPES = (F32, F16, I32, BOOL)


@pytest.mark.parametrize("dt", MOVE_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("new", [(6, 4), (2, -1, 2), (24,), (1, 4, 3, 2)], ids=str)
def test_reshape_vs_onnxruntime(new: tuple[int, ...], dt: DataType, rng: np.random.Generator) -> None:
    """A reshape is of the logical (row-major) order, whatever the input's memory layout."""
    x = in_layout(rand(rng, (2, 3, 2, 2), dt), "NHWC")
    g = fg.Graph()
    xt = g.tensor_like(x, "x")
    y = g.reshape(xt, new).set_output(True)
    (out,) = run(g, {xt: x}, [y])
    (ref,) = ort_run([helper.make_node("Reshape", ["x", "shape"], ["y"])], {"x": x}, [("y", ort_dtype(dt))],
                     consts={"shape": np.array(new, dtype=np.int64)})
    assert_close(out, ref, dt, "reshape")


@pytest.mark.parametrize("dt", MOVE_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("perm", [(1, 0, 2), (2, 0, 1), (0, 2, 1), (0, 1, 2)], ids=str)
def test_transpose_vs_onnxruntime(perm: tuple[int, ...], dt: DataType, rng: np.random.Generator) -> None:
    x = in_layout(rand(rng, (2, 3, 4), dt), "NHC")
    g = fg.Graph()
    xt = g.tensor_like(x, "x")
    y = g.transpose(xt, perm).set_output(True)
    (out,) = run(g, {xt: x}, [y])
    (ref,) = ort_run([helper.make_node("Transpose", ["x"], ["y"], perm=list(perm))], {"x": x}, [("y", ort_dtype(dt))])
    assert_close(out, ref, dt, "transpose")


@pytest.mark.parametrize("dt", MOVE_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concatenate_vs_onnxruntime(axis: int, dt: DataType, rng: np.random.Generator) -> None:
    base = [2, 3, 4]
    arrays = []
    for j, extra in enumerate((1, 3, 2)):
        shape = list(base)
        shape[axis] = extra
        a = rand(rng, shape, dt)
        arrays.append(in_layout(a, "NHC") if j == 1 else a)  # mixed layouts
    g = fg.Graph()
    ts = [g.tensor_like(a, f"x{j}") for j, a in enumerate(arrays)]
    y = g.concatenate(ts, axis=axis).set_output(True)
    (out,) = run(g, dict(zip(ts, arrays, strict=True)), [y])
    feeds = {f"x{j}": a for j, a in enumerate(arrays)}
    (ref,) = ort_run([helper.make_node("Concat", list(feeds), ["y"], axis=axis)], feeds, [("y", ort_dtype(dt))])
    assert_close(out, ref, dt, "concatenate")


SLICES = [
    ((0, 1), (2, 3), None, None),
    ((1,), (-1,), (2,), (2,)),
    ((-3, 0), (100, -1), (-1, 0), (1, 2)),
    ((1, 0, -2), (100, 5, 3), (1, 2, 0), (2, 1, 1)),  # axes out of order
]


@pytest.mark.parametrize("dt", MOVE_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("spec", SLICES, ids=str)
def test_slice_vs_onnxruntime(spec: tuple[Any, ...], dt: DataType, rng: np.random.Generator) -> None:
    starts, ends, axes, steps = spec
    x = in_layout(rand(rng, (3, 5, 6), dt), "NHC")
    g = fg.Graph()
    xt = g.tensor_like(x, "x")
    y = g.slice(xt, starts, ends, steps=steps, axes=axes).set_output(True)
    (out,) = run(g, {xt: x}, [y])
    ax = axes if axes is not None else list(range(len(starts)))
    consts = {
        "starts": np.array(starts, dtype=np.int64), "ends": np.array(ends, dtype=np.int64),
        "axes": np.array(ax, dtype=np.int64), "steps": np.array(steps or [1] * len(starts), dtype=np.int64),
    }
    node = helper.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["y"])
    (ref,) = ort_run([node], {"x": x}, [("y", ort_dtype(dt))], consts=consts)
    assert_close(out, ref, dt, "slice")


def test_every_op_kind_is_tested() -> None:
    """Each OpKind has a test above that runs it against an independent implementation."""
    tested = {
        OpKind.CONV_FPROP: test_conv_fprop_vs_onnxruntime,
        OpKind.CONV_DGRAD: test_conv_dgrad_vs_torch_autograd,
        OpKind.CONV_WGRAD: test_conv_wgrad_vs_torch_autograd,
        OpKind.MATMUL: test_matmul_vs_onnxruntime,
        OpKind.POINTWISE: test_pointwise_vs_onnxruntime,
        OpKind.REDUCTION: test_reduction_vs_onnxruntime,
        OpKind.BATCHNORM_INFERENCE: test_batchnorm_inference_vs_onnxruntime,
        OpKind.BATCHNORM: test_batchnorm_training_vs_torch,
        OpKind.LAYERNORM: test_layernorm_vs_onnxruntime,
        OpKind.RMSNORM: test_rmsnorm_vs_onnxruntime,
        OpKind.POOLING: test_pooling_vs_onnxruntime,
        OpKind.SDPA: test_sdpa_vs_torch,
        OpKind.SOFTMAX: test_softmax_vs_onnxruntime,
        OpKind.RESHAPE: test_reshape_vs_onnxruntime,
        OpKind.TRANSPOSE: test_transpose_vs_onnxruntime,
        OpKind.CONCATENATE: test_concatenate_vs_onnxruntime,
        OpKind.SLICE: test_slice_vs_onnxruntime,
        **dict.fromkeys(BACKWARD, "tests/test_backward_ops.py (against torch.autograd)"),
        **dict.fromkeys(INDEXING, "tests/test_gather.py (against numpy.take / np.add.at and torch)"),
        OpKind.POOLING_BACKWARD: "tests/test_pooling_backward.py (against torch.autograd)",
    }
    assert set(tested) == set(OpKind), f"untested: {set(OpKind) - set(tested)}"
    assert set(POOL_ONNX) == set(PoolingMode)


# =========================== the acceptance cases ===========================================
# Built with exactly the public names; each against PyTorch in float64, within 1e-5 (f32)
# and 1e-2 (f16) relative error.
ACCEPT = {F32: 1e-5, F16: 1e-2}


def rel_err(out: np.ndarray, ref: Any) -> float:
    o, r = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert np.isfinite(o).all(), "non-finite output"
    return float(np.linalg.norm(o - r) / np.linalg.norm(r))


def test_acceptance_conv_bias_relu_nhwc_f16_f32_compute(rng: np.random.Generator) -> None:
    torch = torch_mod()
    n, c, h, w, k = 2, 8, 9, 7, 16
    graph = fg.Graph(
        name="conv_bias_relu",
        io_data_type=fg.DataType.HALF,
        intermediate_data_type=fg.DataType.FLOAT,
        compute_data_type=fg.DataType.FLOAT,
    )
    x = graph.tensor("x", [n, c, h, w], fg.strides_for([n, c, h, w], "NHWC"))
    wt = graph.tensor("w", [k, c, 3, 3], fg.strides_for([k, c, 3, 3], "KRSC"))
    b = graph.tensor("b", [1, k, 1, 1])
    conv = graph.conv_fprop(x, wt, padding=[1, 1], stride=[1, 1], dilation=[1, 1], name="conv")
    y = graph.relu(graph.bias(conv, b, name="bias"), name="relu").set_output(True)
    graph.validate()
    assert y.dim == [n, k, h, w] and y.data_type == fg.DataType.HALF
    assert conv.data_type == fg.DataType.FLOAT  # intermediate type
    assert y.stride == list(fg.strides_for([n, k, h, w], "NHWC"))  # follows its input's layout

    xa = in_layout(rand(rng, (n, c, h, w), F16), "NHWC")
    wa = in_layout(rand(rng, (k, c, 3, 3), F16), "NHWC")
    ba = rand(rng, (1, k, 1, 1), F16)
    ya = in_layout(np.zeros((n, k, h, w), np.float16), "NHWC")
    assert graph.execute({x: xa, wt: wa, b: ba, y: ya}, engine="reference") == {}  # written in place
    ref = torch.relu(
        torch.nn.functional.conv2d(torch.tensor(xa.astype(np.float64)), torch.tensor(wa.astype(np.float64)), padding=1)
        + torch.tensor(ba.astype(np.float64))
    )
    assert rel_err(ya, ref.numpy()) <= ACCEPT[F16]


@pytest.mark.parametrize("dt", (F32, F16), ids=lambda d: d.name)
def test_acceptance_batched_broadcasting_matmul(dt: DataType, rng: np.random.Generator) -> None:
    torch = torch_mod()
    graph = fg.Graph(io_data_type=dt)
    a = graph.tensor("A", [3, 1, 4, 6])
    b = graph.tensor("B", [5, 6, 7], [42, 1, 6])  # each [6, 7] matrix stored transposed
    c = graph.matmul(a, b, name="mm").set_output(True)
    graph.validate()
    assert c.dim == [3, 5, 4, 7]
    aa = rand(rng, (3, 1, 4, 6), dt)
    ba = np.ascontiguousarray(rand(rng, (5, 7, 6), dt)).transpose(0, 2, 1)
    out = graph.execute({"A": aa, "B": ba}, engine="reference")["mm::c"]
    ref = torch.matmul(torch.tensor(aa.astype(np.float64)), torch.tensor(ba.astype(np.float64)))
    assert rel_err(out, ref.numpy()) <= ACCEPT[dt]


@pytest.mark.parametrize("dt", (F32, F16), ids=lambda d: d.name)
def test_acceptance_layernorm(dt: DataType, rng: np.random.Generator) -> None:
    torch = torch_mod()
    graph = fg.Graph(io_data_type=dt)
    x = graph.tensor("x", [4, 6, 10])
    scale = graph.tensor("scale", [1, 6, 10])
    bias = graph.tensor("bias", [1, 6, 10])
    y, mean, inv_var = graph.layernorm(x, scale, bias, epsilon=1e-5, phase=fg.NormFwdPhase.TRAINING)
    assert mean is not None and inv_var is not None
    y.set_output(True)
    # Statistics are I/O tensors too; without a type of their own they take io_data_type.
    mean.set_output(True).set_data_type(fg.DataType.FLOAT)
    inv_var.set_output(True).set_data_type(np.float32)
    xa, sa, ba = rand(rng, (4, 6, 10), dt) * 3 + 1, rand(rng, (1, 6, 10), dt), rand(rng, (1, 6, 10), dt)
    res = graph.execute({x: xa, scale: sa, bias: ba}, engine="reference")
    x64 = torch.tensor(xa.astype(np.float64))
    ref = torch.nn.functional.layer_norm(
        x64, (6, 10), torch.tensor(sa.astype(np.float64)[0]), torch.tensor(ba.astype(np.float64)[0]), eps=1e-5
    )
    var, m = torch.var_mean(x64, dim=(1, 2), keepdim=True, correction=0)
    assert rel_err(res[y.name], ref.numpy()) <= ACCEPT[dt]
    assert rel_err(res[mean.name], m.numpy()) <= ACCEPT[F32]
    assert rel_err(res[inv_var.name], (1 / torch.sqrt(var + 1e-5)).numpy()) <= ACCEPT[F32]


@pytest.mark.parametrize("dt", (F32, F16), ids=lambda d: d.name)
def test_acceptance_grouped_3d_conv_fprop_dgrad_wgrad(dt: DataType, rng: np.random.Generator) -> None:
    torch = torch_mod()
    n, c, k, groups = 2, 6, 4, 2
    x_dims, w_dims = [n, c, 5, 6, 4], [k, c // groups, 3, 2, 3]
    pad, stride, dil = [1, 0, 1], [2, 1, 1], [1, 2, 1]
    graph = fg.Graph(io_data_type=dt, compute_data_type=fg.DataType.FLOAT)
    x = graph.tensor("x", x_dims, fg.strides_for(x_dims, "NDHWC"))
    w = graph.tensor("w", w_dims, fg.strides_for(w_dims, "KTRSC"))
    y = graph.conv_fprop(x, w, padding=pad, stride=stride, dilation=dil, name="fprop").set_output(True)
    graph.validate()
    y_dims = y.dim
    dy = graph.tensor("dy", y_dims, fg.strides_for(y_dims, "NDHWC"))
    dx = graph.conv_dgrad(dy, w, padding=pad, stride=stride, dilation=dil, name="dgrad")
    dx.set_dim(x_dims).set_output(True)
    dw = graph.conv_wgrad(x, dy, padding=pad, stride=stride, dilation=dil, name="wgrad")
    dw.set_dim(w_dims).set_output(True)
    graph.validate()

    xa = in_layout(rand(rng, x_dims, dt), "NDHWC")
    wa = in_layout(rand(rng, w_dims, dt), "NDHWC")
    dya = in_layout(rand(rng, y_dims, dt), "NDHWC")
    res = graph.execute({x: xa, w: wa, dy: dya}, engine="reference")

    xt = torch.tensor(xa.astype(np.float64), requires_grad=True)
    wt = torch.tensor(wa.astype(np.float64), requires_grad=True)
    yt = torch.nn.functional.conv3d(xt, wt, stride=stride, padding=pad, dilation=dil, groups=groups)
    yt.backward(torch.tensor(dya.astype(np.float64)))
    assert list(yt.shape) == y_dims
    assert rel_err(res[y.name], yt.detach().numpy()) <= ACCEPT[dt]
    assert rel_err(res[dx.name], xt.grad.numpy()) <= ACCEPT[dt]
    assert rel_err(res[dw.name], wt.grad.numpy()) <= ACCEPT[dt]
