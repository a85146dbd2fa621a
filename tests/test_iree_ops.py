"""Every op x dtype x layout, emitted, compiled for the host CPU by IREE and run, against
the float64 reference engine on fresh random data.

Each test builds one graph holding many nodes of one op family (one compile serves many
checks). The harness below talks to iree.compiler / iree.runtime directly so that these
tests exercise the emitter alone (EmitOptions included), independent of the engine's
cache and plan code, which have their own tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import fusegraph as fg
from fusegraph import NormFwdPhase, PointwiseMode, PoolingMode, ReductionMode
from fusegraph.dtypes import DataType
from fusegraph.engines.iree.emit import EmitOptions, emit_mlir
from fusegraph.graph import layout

ic = pytest.importorskip("iree.compiler", reason="IREE's compiler wheel is a hard dependency")
rt = pytest.importorskip("iree.runtime", reason="IREE's runtime wheel is a hard dependency")

F32, F16, BF16 = DataType.FLOAT, DataType.HALF, DataType.BFLOAT16
FLOATS = [F32, F16, BF16]
LAYOUTS = ["NCHW", "NHWC"]
# ||out - ref|| / ||ref|| bounds per dtype (norm-like ops get NORM_TOL at f32).
TOL = {F32: 1e-5, F16: 1e-2, BF16: 2e-2}
NORM_TOL = {F32: 1e-4, F16: 1e-2, BF16: 2e-2}
# f64 tensors stay f64 at the boundary only with demotion off (IREE demotes by default).
CPU_FLAGS = ["--iree-llvmcpu-target-cpu=host", "--iree-input-demote-f64-to-f32=false"]


# ---- harness -------------------------------------------------------------------------------
class IreeCpu:
    """Compiles an emitted module for llvm-cpu and runs it on local-task."""

    def __init__(self) -> None:
        self.config = rt.Config("local-task")
        self.compiles = 0

    def _upload(self, arr: np.ndarray, dt: DataType) -> Any:
        dev = self.config.device
        if dt == BF16:  # numpy knows no bf16: hand IREE the bits with the right element type
            return dev.allocator.allocate_buffer_copy(
                memory_type=rt.MemoryType.DEVICE_LOCAL,
                allowed_usage=rt.BufferUsage.DEFAULT,
                device=dev,
                buffer=np.ascontiguousarray(arr).view(np.uint16),
                element_type=rt.HalElementType.BFLOAT_16,
            )
        return rt.asdevicearray(dev, np.ascontiguousarray(arr))

    @staticmethod
    def _download(result: Any, shape: tuple[int, ...], dt: DataType) -> np.ndarray:
        view = result._buffer_view if hasattr(result, "_buffer_view") else result
        storage = np.dtype(np.uint16) if dt == BF16 else dt.numpy
        host = np.array(view.map().asarray(list(shape), storage), copy=True)
        return host.view(ml_dtypes.bfloat16) if dt == BF16 else host

    def run(self, g: fg.Graph, pack: dict[str, np.ndarray], options: EmitOptions | None = None) -> dict[str, np.ndarray]:
        m = emit_mlir(g, options=options)
        vmfb = ic.compile_str(m.text, target_backends=["llvm-cpu"], input_type="torch", extra_args=CPU_FLAGS)
        self.compiles += 1
        ctx = rt.SystemContext(config=self.config)
        ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb))
        fn = ctx.modules.module[m.func_name]
        args = []
        for name, shape in zip(m.inputs, m.input_shapes, strict=True):
            t = g.tensor_by_name(name)
            phys = layout.to_physical(pack[name], t.shape, t.strides)
            assert phys.shape == shape
            args.append(self._upload(phys, t.dtype))
        res = fn(*args)
        if not isinstance(res, tuple | list):
            res = (res,)
        out = {}
        for name, shape, r in zip(m.outputs, m.output_shapes, res, strict=True):
            t = g.tensor_by_name(name)
            out[name] = layout.from_physical(self._download(r, shape, t.dtype), t.shape, t.strides)
        return out


@pytest.fixture(scope="module")
def iree_cpu() -> IreeCpu:
    return IreeCpu()


def strides(dims: list[int], lay: str) -> tuple[int, ...]:
    """Channels-last strides for NHWC on image-like ranks (3-5), row-major otherwise."""
    if lay == "NHWC" and 3 <= len(dims) <= 5:
        return fg.strides_for(dims, {3: "NHC", 4: "NHWC", 5: "NDHWC"}[len(dims)])
    return fg.strides_for(dims, "row_major")


def make_input(t: fg.TensorAttr, rng: np.random.Generator, kind: str = "normal") -> np.ndarray:
    """Random data in the tensor's declared layout (stride-0 axes as np.broadcast_to)."""
    base_shape = tuple(1 if s == 0 else d for d, s in zip(t.shape, t.strides, strict=True))
    if t.dtype == DataType.BOOLEAN:
        vals: np.ndarray = rng.random(base_shape) > 0.4
    elif t.dtype.is_integer:
        vals = rng.integers(-20, 21, base_shape)
        if kind == "nonzero":
            vals = np.where(vals == 0, 7, vals)
    else:
        vals = rng.standard_normal(base_shape)
        if kind == "positive":
            vals = np.abs(vals) + 0.25
        elif kind == "nonzero":
            vals = np.where(np.abs(vals) < 0.25, 0.5, vals)
    if base_shape != t.shape:
        return np.broadcast_to(vals.astype(t.dtype.numpy), t.shape)
    arr = layout.empty_strided(t.shape, t.strides, t.dtype.numpy)
    arr[...] = vals
    return arr


def assert_close(name: str, got: np.ndarray, ref: np.ndarray, tol: float) -> None:
    assert got.shape == ref.shape, f"{name}: shape {got.shape} != {ref.shape}"
    if ref.dtype == np.bool_ or np.issubdtype(ref.dtype, np.integer):
        bad = np.count_nonzero(np.asarray(got) != np.asarray(ref))
        assert bad == 0, f"{name}: {bad} of {ref.size} elements differ"
        return
    g64, r64 = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    nan_ref = np.isnan(r64)
    assert np.array_equal(np.isnan(g64), nan_ref), f"{name}: NaN where the reference has none (or vice versa)"
    g64, r64 = g64[~nan_ref], r64[~nan_ref]
    rel = float(np.linalg.norm(g64 - r64) / max(float(np.linalg.norm(r64)), 1e-30))
    max_abs = float(np.max(np.abs(g64 - r64))) if r64.size else 0.0
    scale = max(1.0, float(np.max(np.abs(r64)))) if r64.size else 1.0
    assert rel <= tol, f"{name}: relative error {rel:.3g} > {tol:.1g} (max abs {max_abs:.3g})"
    assert max_abs <= 16 * tol * scale, f"{name}: max abs error {max_abs:.3g} (relative {rel:.3g})"


Kinds = dict[str, str]


def check(
    iree_cpu: IreeCpu,
    g: fg.Graph,
    rng: np.random.Generator,
    tol: float | dict[str, float],
    *,
    kinds: Kinds | None = None,
    options: EmitOptions | None = None,
    fix: Callable[[dict[str, np.ndarray]], None] | None = None,
) -> dict[str, np.ndarray]:
    g.validate()
    kinds = kinds or {}
    pack = {t.name: make_input(t, rng, kinds.get(t.name, "normal")) for t in g.inputs()}
    if fix is not None:
        fix(pack)
    ref = g.execute(pack, engine="reference")
    got = iree_cpu.run(g, pack, options)
    assert set(got) == set(ref)
    for name in ref:
        t_tol = tol if isinstance(tol, float) else tol.get(name, tol["*"])
        assert_close(name, got[name], ref[name], t_tol)
    return got


# ---- pointwise -------------------------------------------------------------------------------
UNARY_FLOAT = [
    PointwiseMode.ABS, PointwiseMode.NEG, PointwiseMode.EXP, PointwiseMode.SIN, PointwiseMode.COS,
    PointwiseMode.ERF, PointwiseMode.FLOOR, PointwiseMode.CEIL, PointwiseMode.IDENTITY,
    PointwiseMode.TANH_FWD, PointwiseMode.SIGMOID_FWD, PointwiseMode.GELU_FWD,
    PointwiseMode.GELU_APPROX_TANH_FWD, PointwiseMode.RELU_FWD,
]
UNARY_POSITIVE = [PointwiseMode.LOG, PointwiseMode.SQRT, PointwiseMode.RSQRT, PointwiseMode.RECIPROCAL]
PARAM_VARIANTS: list[tuple[PointwiseMode, dict[str, float]]] = [
    (PointwiseMode.RELU_FWD, {"relu_lower_clip_slope": 0.1}),
    (PointwiseMode.RELU_FWD, {"relu_upper_clip": 0.7}),
    (PointwiseMode.RELU_FWD, {"relu_lower_clip": -0.3, "relu_upper_clip": 0.9}),
    (PointwiseMode.RELU_FWD, {"relu_lower_clip": -0.5, "relu_lower_clip_slope": 0.2, "relu_upper_clip": 1.2}),
    (PointwiseMode.RELU_FWD, {"relu_lower_clip": 0.8, "relu_upper_clip": 0.2}),
    (PointwiseMode.ELU_FWD, {}),
    (PointwiseMode.ELU_FWD, {"elu_alpha": 0.4}),
    (PointwiseMode.SWISH_FWD, {}),
    (PointwiseMode.SWISH_FWD, {"swish_beta": 1.7}),
    (PointwiseMode.SOFTPLUS_FWD, {}),
    (PointwiseMode.SOFTPLUS_FWD, {"softplus_beta": 2.5}),
]


@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("dt", FLOATS, ids=str)
def test_pointwise_unary(iree_cpu: IreeCpu, rng: np.random.Generator, dt: DataType, lay: str) -> None:
    g = fg.Graph(io_data_type=dt)
    dims = [2, 5, 3, 4]
    x = g.tensor("x", dims, strides(dims, lay))
    xp = g.tensor("xp", dims, strides(dims, lay))
    for m in UNARY_FLOAT:
        g.pointwise(x, mode=m, name=f"{m.value}").set_output(True)
    for m in UNARY_POSITIVE:
        g.pointwise(xp, mode=m, name=f"{m.value}").set_output(True)
    for i, (m, params) in enumerate(PARAM_VARIANTS):
        g.pointwise(x, mode=m, name=f"{m.value}_{i}", **params).set_output(True)
    check(iree_cpu, g, rng, TOL[dt], kinds={"xp": "positive"})


BINARY = [PointwiseMode.ADD, PointwiseMode.SUB, PointwiseMode.MUL, PointwiseMode.MAX, PointwiseMode.MIN]
COMPARE = [
    PointwiseMode.CMP_EQ, PointwiseMode.CMP_NEQ, PointwiseMode.CMP_GT,
    PointwiseMode.CMP_GE, PointwiseMode.CMP_LT, PointwiseMode.CMP_LE,
]
BACKWARD = [PointwiseMode.RELU_BWD, PointwiseMode.GELU_BWD, PointwiseMode.TANH_BWD, PointwiseMode.SIGMOID_BWD]


@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("dt", FLOATS, ids=str)
def test_pointwise_binary(iree_cpu: IreeCpu, rng: np.random.Generator, dt: DataType, lay: str) -> None:
    g = fg.Graph(io_data_type=dt)
    dims = [2, 6, 3, 4]
    a = g.tensor("a", dims, strides(dims, lay))
    b = g.tensor("b", dims, strides(dims, "NCHW"))  # mixed layouts meet in one op
    bnz = g.tensor("bnz", dims, strides(dims, lay))
    pos = g.tensor("pos", dims, strides(dims, lay))
    chan = g.tensor("chan", [1, 6, 1, 1])  # per-channel broadcast
    row = g.tensor("row", [4])  # NumPy-style lower-rank broadcast
    bcast = g.tensor("bcast", dims, [0, 1, 0, 0])  # a stride-0 broadcast input
    mask = g.tensor("mask", dims, strides(dims, lay), data_type=DataType.BOOLEAN)
    for m in BINARY:
        g.pointwise(a, b, mode=m, name=m.value).set_output(True)
    g.pointwise(a, chan, mode=PointwiseMode.ADD, name="add_chan").set_output(True)
    g.pointwise(row, a, mode=PointwiseMode.SUB, name="sub_row").set_output(True)
    g.pointwise(a, bcast, mode=PointwiseMode.MUL, name="mul_bcast").set_output(True)
    g.pointwise(a, bnz, mode=PointwiseMode.DIV, name="div").set_output(True)
    g.pointwise(pos, a, mode=PointwiseMode.POW, name="pow").set_output(True)
    g.pointwise(a, g.scalar(0.75), mode=PointwiseMode.MUL, name="mul_scalar").set_output(True)
    g.pointwise(g.scalar(2), a, mode=PointwiseMode.SUB, name="sub_int_scalar").set_output(True)
    for m in COMPARE:
        g.pointwise(a, b, mode=m, name=m.value).set_output(True)
    g.pointwise(a, a, mode=PointwiseMode.CMP_EQ, name="eq_self").set_output(True)
    g.binary_select(a, b, mask, name="select").set_output(True)
    for m in BACKWARD:
        g.pointwise(b, a, mode=m, name=m.value).set_output(True)
    g.pointwise(b, a, mode=PointwiseMode.RELU_BWD, name="relu_bwd_clip", relu_lower_clip=0.3).set_output(True)
    check(iree_cpu, g, rng, TOL[dt], kinds={"bnz": "nonzero", "pos": "positive"})


@pytest.mark.parametrize("lay", LAYOUTS)
def test_pointwise_integer(iree_cpu: IreeCpu, rng: np.random.Generator, lay: str) -> None:
    g = fg.Graph(io_data_type=DataType.INT32)
    dims = [2, 3, 4, 5]
    a = g.tensor("a", dims, strides(dims, lay))
    b = g.tensor("b", dims, strides(dims, lay))
    nz = g.tensor("nz", dims, strides(dims, lay))
    for m in [*BINARY, PointwiseMode.ABS, PointwiseMode.NEG, PointwiseMode.IDENTITY, *COMPARE]:
        spec_b = None if m in (PointwiseMode.ABS, PointwiseMode.NEG, PointwiseMode.IDENTITY) else b
        g.pointwise(a, spec_b, mode=m, name=m.value).set_output(True)
    g.div(a, nz, name="div_trunc").set_output(True)  # truncates toward zero
    g.relu(a, negative_slope=0.5, name="leaky").set_output(True)
    g.add(a, g.scalar(3), name="add_scalar").set_output(True)
    wide = g.tensor("wide", dims, strides(dims, lay), data_type=DataType.INT64)
    g.mul(a, wide, name="promote").set_output(True)
    check(iree_cpu, g, rng, 0.0, kinds={"nz": "nonzero"})


def test_pointwise_boolean(iree_cpu: IreeCpu, rng: np.random.Generator) -> None:
    g = fg.Graph(io_data_type=DataType.BOOLEAN)
    p, q = g.tensor("p", [3, 7]), g.tensor("q", [3, 7])
    g.logical_and(p, q).set_output(True)
    g.logical_or(p, q).set_output(True)
    g.logical_not(p).set_output(True)
    g.cmp_eq(p, q).set_output(True)
    g.cmp_neq(p, q).set_output(True)
    g.binary_select(p, q, g.tensor("c", [1, 7])).set_output(True)
    check(iree_cpu, g, rng, 0.0)


def test_dtype_mixing(iree_cpu: IreeCpu, rng: np.random.Generator) -> None:
    """f16 I/O with f32 intermediates and compute; casts through IDENTITY outputs."""
    g = fg.Graph(io_data_type=F16, intermediate_data_type=F32, compute_data_type=F32)
    x = g.tensor("x", [2, 8, 6, 6], fg.strides_for([2, 8, 6, 6], "NHWC"))
    w = g.tensor("w", [4, 8, 3, 3], fg.strides_for([4, 8, 3, 3], "KRSC"))
    bias = g.tensor("b", [1, 4, 1, 1])
    y = g.relu(g.bias(g.conv_fprop(x, w, padding=[1, 1]), bias)).set_name("y").set_output(True)
    y.set_data_type(F16)
    g.identity(x).set_data_type(F32).set_name("to_f32").set_output(True)
    g.identity(g.mul(x, g.scalar(9.0))).set_data_type(DataType.INT32).set_name("to_i32").set_output(True)
    g.identity(x).set_data_type(DataType.BOOLEAN).set_name("to_bool").set_output(True)
    h = g.tensor("h", [5, 5], data_type=BF16)
    g.exp(h).set_data_type(F32).set_name("bf16_to_f32").set_output(True)
    d = g.tensor("d", [5, 5], data_type=DataType.DOUBLE)
    g.sin(d).set_name("sin_f64").set_data_type(DataType.DOUBLE).set_output(True)  # computed in f32
    g.add(d, d).set_name("add_f64_as_f16").set_output(True)  # an io-typed (f16) output
    check(iree_cpu, g, rng, {"*": TOL[F16], "to_f32": 0.0, "bf16_to_f32": 1e-6, "sin_f64": 1e-6})


# ---- matmul ----------------------------------------------------------------------------------
@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("dt", FLOATS, ids=str)
def test_matmul(iree_cpu: IreeCpu, rng: np.random.Generator, dt: DataType, lay: str) -> None:
    g = fg.Graph(io_data_type=dt)
    a = g.tensor("a", [2, 1, 8, 16])
    # "NHWC" here: B stored column-major (a transposed operand).
    b_dims = [3, 16, 5]
    b = g.tensor("b", b_dims, (80, 1, 16) if lay == "NHWC" else fg.strides_for(b_dims, "row_major"))
    g.matmul(a, b, name="batched").set_output(True)
    a2, b2 = g.tensor("a2", [24, 40]), g.tensor("b2", [40, 12], (1, 40) if lay == "NHWC" else (12, 1))
    g.relu(g.matmul(a2, b2), name="mm_relu").set_output(True)
    check(iree_cpu, g, rng, TOL[dt])


# ---- convolutions -----------------------------------------------------------------------------
def _filter_strides(dims: list[int], lay: str) -> tuple[int, ...]:
    return strides(dims, lay)  # KRSC for NHWC users, KCRS otherwise


def _conv2d_graph(dt: DataType, lay: str) -> fg.Graph:
    g = fg.Graph(io_data_type=dt)
    xd = [2, 8, 9, 8]
    x = g.tensor("x", xd, strides(xd, lay))
    w = g.tensor("w", [6, 8, 3, 3], _filter_strides([6, 8, 3, 3], lay))
    bias = g.tensor("bias", [1, 6, 1, 1])
    g.relu(g.bias(g.conv_fprop(x, w, padding=[1, 1]), bias), name="conv_bias_relu").set_output(True)
    g.conv_fprop(
        x, w, stride=[2, 1], dilation=[1, 2], pre_padding=[1, 0], post_padding=[2, 1], name="strided_dilated_asym"
    ).set_output(True)
    wg = g.tensor("wg", [6, 4, 2, 3], _filter_strides([6, 4, 2, 3], lay))  # 2 groups
    g.conv_fprop(x, wg, padding=[0, 1], name="grouped").set_output(True)
    wd = g.tensor("wd", [8, 1, 3, 3], _filter_strides([8, 1, 3, 3], lay))  # depthwise
    g.conv_fprop(x, wd, padding=[1, 1], stride=[2, 2], name="depthwise").set_output(True)
    wm = g.tensor("wm", [16, 1, 3, 3])  # depthwise, channel multiplier 2
    g.conv_fprop(x, wm, padding=[1, 1], name="depthwise_mult").set_output(True)
    w1 = g.tensor("w1", [5, 8, 1, 1], _filter_strides([5, 8, 1, 1], lay))
    g.conv_fprop(x, w1, name="pointwise_1x1").set_output(True)
    return g


@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("dt", FLOATS, ids=str)
def test_conv_fprop_2d(iree_cpu: IreeCpu, rng: np.random.Generator, dt: DataType, lay: str) -> None:
    check(iree_cpu, _conv2d_graph(dt, lay), rng, TOL[dt])


@pytest.mark.parametrize("lay", LAYOUTS)
def test_conv_fprop_nchw_option(iree_cpu: IreeCpu, rng: np.random.Generator, lay: str) -> None:
    """The conv_layout="nchw" knob (torch.aten.convolution on the logical layout)."""
    check(iree_cpu, _conv2d_graph(F32, lay), rng, TOL[F32], options=EmitOptions(conv_layout="nchw"))


@pytest.mark.parametrize("fence", ["optimization_barrier", "none"])
def test_conv_filter_fence_option(iree_cpu: IreeCpu, rng: np.random.Generator, fence: str) -> None:
    check(iree_cpu, _conv2d_graph(F32, "NHWC"), rng, TOL[F32], options=EmitOptions(filter_fence=fence))


@pytest.mark.slow
@pytest.mark.parametrize("dt", [F32, F16], ids=str)
def test_conv_fprop_1d_3d(iree_cpu: IreeCpu, rng: np.random.Generator, dt: DataType) -> None:
    g = fg.Graph(io_data_type=dt)
    x1 = g.tensor("x1", [2, 6, 11], strides([2, 6, 11], "NHWC"))
    g.conv_fprop(x1, g.tensor("w1", [4, 6, 3]), stride=[2], pre_padding=[2], post_padding=[0], name="c1").set_output(True)
    g.conv_fprop(x1, g.tensor("w1g", [6, 2, 3]), dilation=[2], name="c1_grouped").set_output(True)
    x3 = g.tensor("x3", [1, 4, 5, 6, 4], strides([1, 4, 5, 6, 4], "NHWC"))
    g.conv_fprop(x3, g.tensor("w3", [3, 4, 2, 3, 2]), padding=[1, 1, 0], name="c3").set_output(True)
    g.conv_fprop(x3, g.tensor("w3d", [4, 1, 3, 3, 3]), padding=[1, 1, 1], name="c3_depthwise").set_output(True)
    g.conv_fprop(
        x3, g.tensor("w3g", [2, 2, 1, 2, 2]), stride=[1, 2, 1], pre_padding=[0, 1, 1], post_padding=[1, 0, 0],
        name="c3_grouped",
    ).set_output(True)
    check(iree_cpu, g, rng, TOL[dt])


def _grad_graph(dt: DataType, lay: str) -> fg.Graph:
    g = fg.Graph(io_data_type=dt)
    xd, wd_ = [2, 4, 9, 8], [6, 2, 3, 2]  # 2 groups
    kw = {"stride": [2, 1], "dilation": [1, 2], "pre_padding": [1, 0], "post_padding": [2, 1]}
    x = g.tensor("x", xd, strides(xd, lay))
    w = g.tensor("w", wd_, _filter_strides(wd_, lay))
    dy = g.tensor("dy", [2, 6, 5, 7], strides([2, 6, 5, 7], lay))
    g.conv_dgrad(dy, w, name="dgrad", **kw).set_dim(xd).set_stride(strides(xd, lay)).set_output(True)
    g.conv_wgrad(x, dy, name="wgrad", **kw).set_dim(wd_).set_stride(_filter_strides(wd_, lay)).set_output(True)
    w1 = g.tensor("w1", [3, 4, 3, 3], _filter_strides([3, 4, 3, 3], lay))
    dy1 = g.tensor("dy1", [2, 3, 9, 8], strides([2, 3, 9, 8], lay))
    g.conv_dgrad(dy1, w1, padding=[1, 1], name="dgrad_same").set_dim(xd).set_output(True)
    g.conv_wgrad(x, dy1, padding=[1, 1], name="wgrad_same").set_dim([3, 4, 3, 3]).set_output(True)
    return g


@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("dt", FLOATS, ids=str)
def test_conv_dgrad_wgrad(iree_cpu: IreeCpu, rng: np.random.Generator, dt: DataType, lay: str) -> None:
    check(iree_cpu, _grad_graph(dt, lay), rng, TOL[dt])


@pytest.mark.slow
def test_conv_grads_1d_3d(iree_cpu: IreeCpu, rng: np.random.Generator) -> None:
    g = fg.Graph(io_data_type=F32)
    x1, dy1 = g.tensor("x1", [2, 4, 10]), g.tensor("dy1", [2, 6, 4])
    kw1 = {"stride": [2], "pre_padding": [1], "post_padding": [0], "dilation": [2]}
    g.conv_dgrad(dy1, g.tensor("w1", [6, 2, 3]), name="dgrad1", **kw1).set_dim([2, 4, 10]).set_output(True)
    g.conv_wgrad(x1, dy1, name="wgrad1", **kw1).set_dim([6, 2, 3]).set_output(True)
    x3, dy3 = g.tensor("x3", [1, 2, 4, 5, 3]), g.tensor("dy3", [1, 3, 4, 3, 3])
    kw3 = {"stride": [1, 2, 1], "padding": [1, 1, 1]}
    g.conv_dgrad(dy3, g.tensor("w3", [3, 2, 3, 3, 3]), name="dgrad3", **kw3).set_dim([1, 2, 4, 5, 3]).set_output(True)
    g.conv_wgrad(x3, dy3, name="wgrad3", **kw3).set_dim([3, 2, 3, 3, 3]).set_output(True)
    check(iree_cpu, g, rng, TOL[F32])


# ---- reductions, softmax, norms, pooling ---------------------------------------------------------
@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("dt", FLOATS, ids=str)
def test_reduction_softmax(iree_cpu: IreeCpu, rng: np.random.Generator, dt: DataType, lay: str) -> None:
    g = fg.Graph(io_data_type=dt)
    dims = [2, 6, 3, 5]
    x = g.tensor("x", dims, strides(dims, lay))
    xs = g.tensor("xs", [2, 3, 2, 2], strides([2, 3, 2, 2], lay))  # small: MUL stays in range
    for m in ReductionMode:
        src = xs if m == ReductionMode.MUL else x
        g.reduction(src, m, axes=[1, 3], name=f"{m.value}_13").set_output(True)
        g.reduction(src, m, axes=[0, 1, 2, 3], name=f"{m.value}_all").set_output(True)
    g.reduction(x, ReductionMode.SUM, axes=[], name="sum_none").set_output(True)
    g.reduction(x, ReductionMode.NORM2, dim=list(dims), name="norm2_none").set_output(True)
    g.softmax(x, axis=1, name="softmax_c").set_output(True)
    g.softmax(x, axis=-1, name="softmax_w").set_output(True)
    g.softmax(x, axis=2, log=True, name="log_softmax_h").set_output(True)
    check(iree_cpu, g, rng, NORM_TOL[dt])


def test_reduction_integer(iree_cpu: IreeCpu, rng: np.random.Generator) -> None:
    g = fg.Graph(io_data_type=DataType.INT32)
    x = g.tensor("x", [3, 4, 5])
    for m in (ReductionMode.SUM, ReductionMode.MAX, ReductionMode.MIN, ReductionMode.AMAX, ReductionMode.NORM1):
        g.reduction(x, m, axes=[1], name=m.value).set_output(True)
    g.reduction(x, ReductionMode.AVG, axes=[0, 2], name="avg_trunc").set_output(True)
    check(iree_cpu, g, rng, 0.0)


@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("dt", FLOATS, ids=str)
def test_norms(iree_cpu: IreeCpu, rng: np.random.Generator, dt: DataType, lay: str) -> None:
    g = fg.Graph(io_data_type=dt)
    dims = [3, 6, 4, 5]
    x = g.tensor("x", dims, strides(dims, lay))
    s, b, m = g.tensor("s", [6]), g.tensor("b", [1, 6, 1, 1]), g.tensor("m", [6])
    v = g.tensor("v", [6])
    g.batchnorm_inference(x, s, b, m, v, epsilon=1e-3, name="bn_inf").set_output(True)
    for o in g.batchnorm(x, s, b, name="bn_train"):
        o.set_output(True)
    ls, lb = g.tensor("ls", [1, 6, 4, 5], strides([1, 6, 4, 5], lay)), g.tensor("lb", [6, 4, 5])
    for o in g.layernorm(x, ls, lb, phase=NormFwdPhase.TRAINING, name="ln_train"):
        assert o is not None
        o.set_output(True)
    g.layernorm(x, ls, lb, epsilon=g.tensor("eps", [1], data_type=F32), name="ln_inf")[0].set_output(True)
    y, inv = g.rmsnorm(x, ls, phase=NormFwdPhase.TRAINING, bias=lb, name="rms_train")
    y.set_output(True)
    assert inv is not None
    inv.set_output(True)
    g.rmsnorm(x, g.tensor("rs", [5]), name="rms_inf")[0].set_output(True)

    def fix(pack: dict[str, np.ndarray]) -> None:
        pack["v"] = (np.abs(pack["v"].astype(np.float64)) + 0.2).astype(pack["v"].dtype)
        pack["eps"] = np.array([1e-4], np.float32)

    check(iree_cpu, g, rng, NORM_TOL[dt], fix=fix)


@pytest.mark.parametrize("dt", [F32, F16], ids=str)
def test_norm_and_rounding_knobs(iree_cpu: IreeCpu, rng: np.random.Generator, dt: DataType) -> None:
    """norm_variance="one_pass" and round_intermediates=False still match the reference."""
    g = fg.Graph(io_data_type=dt)
    dims = [4, 6, 5, 3]
    x = g.tensor("x", dims, strides(dims, "NHWC"))
    s, b = g.tensor("s", [6]), g.tensor("b", [6])
    for o in g.batchnorm(x, s, b, name="bn"):
        o.set_output(True)
    y, mean, inv = g.layernorm(x, g.tensor("ls", [6, 5, 3]), g.tensor("lb", [6, 5, 3]), phase=NormFwdPhase.TRAINING, name="ln")
    for o in (mean, inv):
        assert o is not None
        o.set_output(True)
    g.tanh(g.mul(g.exp(g.relu(y)), g.scalar(0.3)), name="chain").set_output(True)
    opts = EmitOptions(norm_variance="one_pass", round_intermediates=False)
    check(iree_cpu, g, rng, NORM_TOL[dt], options=opts)


def test_narrow_types(iree_cpu: IreeCpu, rng: np.random.Generator) -> None:
    """fp8 (both kinds), int8, uint8 and int16 tensors through casts, math and a conv."""
    g = fg.Graph()
    for dt in (DataType.FP8_E4M3, DataType.FP8_E5M2):
        a, b = g.tensor(f"a_{dt.value}", [4, 6], data_type=dt), g.tensor(f"b_{dt.value}", [4, 6], data_type=dt)
        g.add(a, b, name=f"add_{dt.value}").set_output(True)
        g.matmul(a, g.tensor(f"c_{dt.value}", [6, 3], data_type=dt), name=f"mm_{dt.value}").set_output(True)
    x8 = g.tensor("x8", [1, 4, 6, 6], fg.strides_for([1, 4, 6, 6], "NHWC"), data_type=DataType.FP8_E4M3)
    w8 = g.tensor("w8", [3, 4, 3, 3], data_type=DataType.FP8_E4M3)
    g.conv_fprop(x8, w8, padding=[1, 1], name="conv_fp8").set_data_type(F32).set_output(True)
    for dt in (DataType.INT8, DataType.UINT8, DataType.INT16):
        a, b = g.tensor(f"i_{dt.value}", [3, 5], data_type=dt), g.tensor(f"j_{dt.value}", [3, 5], data_type=dt)
        g.max(a, b, name=f"max_{dt.value}").set_output(True)
        g.identity(a, name=f"widen_{dt.value}").set_data_type(DataType.INT32).set_output(True)

    def fix(pack: dict[str, np.ndarray]) -> None:
        for k in ("i_uint8", "j_uint8"):
            pack[k] = (np.abs(pack[k].astype(np.int64)) * 5).astype(np.uint8)

    # fp8 math runs in f32 and rounds once, like the reference: results agree exactly
    # except the conv, whose f32 sum order differs.
    check(iree_cpu, g, rng, {"*": 0.0, "conv_fp8::y": TOL[F32]}, fix=fix)


@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("dt", FLOATS, ids=str)
def test_pooling(iree_cpu: IreeCpu, rng: np.random.Generator, dt: DataType, lay: str) -> None:
    g = fg.Graph(io_data_type=dt)
    dims = [2, 3, 9, 8]
    x = g.tensor("x", dims, strides(dims, lay))
    for m in PoolingMode:
        g.pooling(x, m, window=(3, 2), stride=(2, 1), pre_padding=(1, 0), post_padding=(2, 1), name=f"{m.value}_asym").set_output(True)
        g.pooling(x, m, window=(2, 2), name=f"{m.value}_plain").set_output(True)
    g.pooling(x, PoolingMode.MAX, window=(3, 3), stride=(2, 2), padding=(1, 1), name="resnet_maxpool").set_output(True)
    check(iree_cpu, g, rng, TOL[dt])


@pytest.mark.slow
def test_pooling_1d_3d(iree_cpu: IreeCpu, rng: np.random.Generator) -> None:
    g = fg.Graph(io_data_type=F32)
    x1 = g.tensor("x1", [2, 3, 10], strides([2, 3, 10], "NHWC"))
    x3 = g.tensor("x3", [1, 2, 5, 6, 4], strides([1, 2, 5, 6, 4], "NHWC"))
    for m in PoolingMode:
        g.pooling(x1, m, window=(3,), stride=(2,), pre_padding=(1,), post_padding=(2,), name=f"{m.value}_1d").set_output(True)
        g.pooling(x3, m, window=(2, 3, 2), stride=(1, 2, 2), pre_padding=(1, 1, 0), post_padding=(0, 2, 1), name=f"{m.value}_3d").set_output(True)
    check(iree_cpu, g, rng, TOL[F32])


# ---- attention ------------------------------------------------------------------------------------
def _sdpa_graph(dt: DataType) -> tuple[fg.Graph, Callable[[dict[str, np.ndarray]], None]]:
    g = fg.Graph(io_data_type=dt)
    q = g.tensor("q", [2, 4, 5, 8])
    k, v = g.tensor("k", [2, 2, 6, 8]), g.tensor("v", [2, 2, 6, 8])  # GQA: 2 kv heads for 4
    g.sdpa(q, k, v, name="plain").set_output(True)
    g.sdpa(q, k, v, attn_scale=0.3, causal=True, name="causal_scaled").set_output(True)
    mb = g.tensor("mb", [5, 6], data_type=DataType.BOOLEAN)
    g.sdpa(q, k, v, mask=mb, name="bool_mask").set_output(True)
    g.sdpa(q, k, v, mask=g.tensor("mf", [2, 1, 5, 6]), causal=True, name="float_mask_causal").set_output(True)
    g.sdpa(q, k, v, mask=mb, causal=True, name="bool_mask_causal").set_output(True)
    q2 = g.tensor("q2", [1, 2, 7, 16], fg.strides_for([1, 2, 7, 16], "NHWC"))  # a strided q
    g.sdpa(q2, q2, q2, name="self_attention").set_output(True)

    def fix(pack: dict[str, np.ndarray]) -> None:
        pack["mb"][:, 0] = True  # no fully masked row (the reference gives NaN there)

    return g, fix


@pytest.mark.parametrize("dt", FLOATS, ids=str)
def test_sdpa(iree_cpu: IreeCpu, rng: np.random.Generator, dt: DataType) -> None:
    g, fix = _sdpa_graph(dt)
    check(iree_cpu, g, rng, TOL[dt], fix=fix)


@pytest.mark.parametrize("dt", [F32, F16], ids=str)
def test_sdpa_decomposed(iree_cpu: IreeCpu, rng: np.random.Generator, dt: DataType) -> None:
    g, fix = _sdpa_graph(dt)
    check(iree_cpu, g, rng, TOL[dt], fix=fix, options=EmitOptions(attention="decomposed"))


# ---- data movement ----------------------------------------------------------------------------------
@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("dt", [F32, F16, BF16, DataType.INT32], ids=str)
def test_data_movement(iree_cpu: IreeCpu, rng: np.random.Generator, dt: DataType, lay: str) -> None:
    g = fg.Graph(io_data_type=dt)
    dims = [2, 3, 4, 5]
    x = g.tensor("x", dims, strides(dims, lay))
    g.reshape(x, [6, 20], name="reshape").set_output(True)
    g.reshape(x, [2, -1, 5], name="reshape_infer").set_output(True)
    g.transpose(x, [3, 0, 2, 1], name="transpose").set_output(True)
    g.transpose(x, [0, 2, 3, 1], name="to_nhwc_logical").set_output(True)
    g.reshape(g.transpose(x, [1, 0, 2, 3]), [3, 40], name="transpose_reshape").set_output(True)
    y = g.tensor("y", [2, 3, 4, 2], strides([2, 3, 4, 2], "NCHW"))
    g.concatenate([x, y], axis=3, name="concat_w").set_output(True)
    z = g.tensor("z", [2, 1, 4, 5], strides([2, 1, 4, 5], lay))
    g.concatenate([z, x, z], axis=1, name="concat_c").set_output(True)
    g.slice(x, [1, 0, -3], [3, 3, 4], [1, 2, 2], axes=[1, 2, 3], name="slice").set_output(True)
    g.slice(x, [0], [1], name="slice_n").set_output(True)
    check(iree_cpu, g, rng, 0.0)


# ---- a layout-sensitive chain ------------------------------------------------------------------------
def _resnet_graph(dt: DataType, lay: str) -> fg.Graph:
    """conv -> batchnorm -> relu -> conv -> + residual -> relu -> maxpool."""
    g = fg.Graph(io_data_type=dt, compute_data_type=F32)
    xd = [2, 8, 10, 10]
    x = g.tensor("x", xd, strides(xd, lay))

    def bn(t: fg.TensorAttr, tag: str) -> fg.TensorAttr:
        s, b = g.tensor(f"{tag}_s", [8]), g.tensor(f"{tag}_b", [8])
        m, v = g.tensor(f"{tag}_m", [8]), g.tensor(f"{tag}_v", [8])
        return g.batchnorm_inference(t, s, b, m, v)

    w1 = g.tensor("w1", [8, 8, 3, 3], _filter_strides([8, 8, 3, 3], lay))
    w2 = g.tensor("w2", [8, 8, 3, 3], _filter_strides([8, 8, 3, 3], lay))
    h = g.relu(bn(g.conv_fprop(x, w1, padding=[1, 1]), "bn1"))
    h = bn(g.conv_fprop(h, w2, padding=[1, 1]), "bn2")
    h = g.relu(g.add(h, x))
    g.pooling(h, PoolingMode.MAX, window=(3, 3), stride=(2, 2), padding=(1, 1)).set_name("y").set_output(True)
    return g


@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("dt", [F32, F16], ids=str)
def test_resnet_block(iree_cpu: IreeCpu, rng: np.random.Generator, dt: DataType, lay: str) -> None:
    g = _resnet_graph(dt, lay)

    def fix(pack: dict[str, np.ndarray]) -> None:
        for tag in ("bn1", "bn2"):
            v = pack[f"{tag}_v"]
            pack[f"{tag}_v"] = (np.abs(v.astype(np.float64)) + 0.5).astype(v.dtype)

    check(iree_cpu, g, rng, TOL[dt] * (3 if dt != F32 else 10), fix=fix)


# ---- through the engine ------------------------------------------------------------------------------
ENGINE_CASES = {
    "resnet_block_nhwc_f16": lambda: _resnet_graph(F16, "NHWC"),
    "conv_grads_nchw_bf16": lambda: _grad_graph(BF16, "NCHW"),
    "sdpa_f32": lambda: _sdpa_graph(F32)[0],
}


@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
@pytest.mark.parametrize("knobs", [(), (("conv_layout", "nchw"), ("attention", "decomposed"))], ids=["default", "knobs"])
def test_through_the_engine(
    rng: np.random.Generator, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, case: str, knobs: tuple[tuple[str, Any], ...]
) -> None:
    """The emitter behind the IREE engine (plan, runtime, buffers), knobs included."""
    from fusegraph.engines.base import EngineConfig
    from fusegraph.engines.registry import REGISTRY

    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    engine = REGISTRY.get("iree")
    handle = fg.Handle("cpu")
    g = ENGINE_CASES[case]().validate()
    support = engine.supports(g, handle)
    assert support, support.reason
    pack = {t.name: make_input(t, rng, "positive" if t.name.endswith("_v") else "normal") for t in g.inputs()}
    if "mb" in pack:
        pack["mb"][:, 0] = True
    ref = g.execute(pack, engine="reference")
    got = engine.build(g, handle, EngineConfig("iree", knobs)).execute(pack)
    dt = g.inputs()[0].dtype
    for name in ref:
        assert_close(name, got[name], ref[name], TOL[dt] * (3 if dt != F32 else 10))
