"""The torch engine against the float64 reference on every op it claims (PyTorch CPU here),
in f32 / f16 / bf16 and NCHW / NHWC, plus its I/O kinds (NumPy, tensors, Buffers through
DLPack), knobs, serialization, and its behaviour without torch."""

from __future__ import annotations

import numpy as np
import pytest
from engine_fakes import conv_graph

import fusegraph as fg
from fusegraph import DataType as DT
from fusegraph.engines.base import EngineConfig
from fusegraph.engines.registry import REGISTRY
from fusegraph.errors import VariantPackError
from fusegraph.graph.ops import POINTWISE, PointwiseMode, PoolingMode, ReductionMode
from fusegraph.select.autotune import random_inputs

torch = pytest.importorskip("torch", reason="the torch engine needs PyTorch (pip install 'fusegraph[torch]')")

from fusegraph.engines import torch as torch_engine  # noqa: E402

CPU = fg.Handle("cpu")
ENGINE = torch_engine.TorchEngine()
TOL = {DT.FLOAT: 1e-5, DT.HALF: 1e-2, DT.BFLOAT16: 2e-2, DT.DOUBLE: 1e-12}
NORM_TOL = {DT.FLOAT: 1e-4, DT.HALF: 1e-2, DT.BFLOAT16: 2e-2}
FLOATS = [DT.FLOAT, DT.HALF, DT.BFLOAT16]


def check(g: fg.Graph, rng: np.random.Generator, tol: float, config: EngineConfig | None = None,
          pack: dict[str, np.ndarray] | None = None) -> None:
    """Runs g on torch and on the reference, compares every output (rel. L2, NaN never passes)."""
    g.validate()
    assert ENGINE.supports(g, CPU), ENGINE.supports(g, CPU).reason
    pack = pack if pack is not None else random_inputs(g, rng)
    got = ENGINE.build(g, CPU, config).execute(pack)
    ref = g.execute(pack, engine="reference")
    for t in g.outputs():
        o, r = got[t.name], ref[t.name]
        assert o.shape == r.shape and o.dtype == r.dtype, (t.name, o.shape, r.shape, o.dtype, r.dtype)
        assert o.strides == r.strides, f"{t.name}: strides {o.strides} != declared {r.strides}"
        o64, r64 = o.astype(np.float64), r.astype(np.float64)
        assert np.array_equal(np.isnan(o64), np.isnan(r64)), f"{t.name}: NaN pattern differs"
        o64, r64 = np.nan_to_num(o64), np.nan_to_num(r64)
        if t.dtype == DT.BOOLEAN or t.dtype.is_integer:
            assert np.array_equal(o64, r64), f"{t.name}: {np.sum(o64 != r64)} elements differ"
            continue
        err = np.linalg.norm(o64 - r64) / max(np.linalg.norm(r64), 1e-30)
        assert err <= tol, f"{t.name}: rel err {err:.2e} > {tol:.0e} (max abs {np.abs(o64 - r64).max():.2e})"


def _g(dt: DT, **kw: object) -> fg.Graph:
    return fg.Graph("t", io_data_type=dt, intermediate_data_type=DT.FLOAT if dt != DT.DOUBLE else dt, **kw)  # type: ignore[arg-type]


def _nchw(g: fg.Graph, name: str, dims: list[int], layout: str) -> fg.TensorAttr:
    lay = {"NCHW": "NCHW", "NHWC": "NHWC"}[layout] if len(dims) == 4 else "row_major"
    return g.tensor(name, dims, fg.strides_for(dims, lay))


# ---- convolutions -------------------------------------------------------------------------------
CONV_CASES: dict[str, dict[str, object]] = {
    "3x3_pad1": {"x": [2, 8, 9, 9], "w": [6, 8, 3, 3], "padding": [1, 1]},
    "stride2": {"x": [2, 8, 9, 9], "w": [6, 8, 3, 3], "padding": [1, 1], "stride": [2, 2]},
    "dilation2": {"x": [1, 4, 11, 11], "w": [4, 4, 3, 3], "padding": [2, 2], "dilation": [2, 2]},
    "groups2": {"x": [2, 8, 7, 7], "w": [6, 4, 3, 3], "padding": [1, 1]},
    "depthwise": {"x": [2, 8, 7, 7], "w": [8, 1, 3, 3], "padding": [1, 1]},
    "asym_pad": {"x": [1, 4, 8, 8], "w": [5, 4, 3, 2], "pre_padding": [0, 1], "post_padding": [2, 0], "stride": [2, 1]},
    "1x1": {"x": [2, 16, 5, 5], "w": [8, 16, 1, 1]},
}


def _conv_kwargs(case: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in case.items() if k not in ("x", "w")}


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv_fprop(case: str, dt: DT, layout: str, rng: np.random.Generator) -> None:
    c = CONV_CASES[case]
    g = _g(dt, compute_data_type=DT.FLOAT)
    x = _nchw(g, "x", c["x"], layout)  # type: ignore[arg-type]
    w = _nchw(g, "w", c["w"], layout)  # type: ignore[arg-type]
    g.conv_fprop(x, w, **_conv_kwargs(c)).set_output(True)  # type: ignore[arg-type]
    check(g, rng, TOL[dt])


@pytest.mark.parametrize("nsp", [1, 3])
def test_conv_fprop_1d_and_3d(nsp: int, rng: np.random.Generator) -> None:
    g = _g(DT.FLOAT)
    x = g.tensor("x", [2, 4, *([6] * nsp)])
    w = g.tensor("w", [3, 4, *([3] * nsp)])
    g.conv_fprop(x, w, padding=[1] * nsp, stride=[2] * nsp).set_output(True)
    check(g, rng, TOL[DT.FLOAT])


@pytest.mark.parametrize("dt", [DT.FLOAT, DT.HALF])
@pytest.mark.parametrize("case", ["3x3_pad1", "stride2", "groups2", "asym_pad", "dilation2"])
def test_conv_dgrad(case: str, dt: DT, rng: np.random.Generator) -> None:
    c = CONV_CASES[case]
    # dy has the forward output's dims: make them with a throwaway forward graph
    fwd = _g(dt)
    fy = fwd.conv_fprop(fwd.tensor("x", c["x"]), fwd.tensor("w", c["w"]), **_conv_kwargs(c))  # type: ignore[arg-type]
    fy.set_output(True)
    fwd.validate()
    g = _g(dt, compute_data_type=DT.FLOAT)
    dy = g.tensor("dy", fy.dim)
    w = g.tensor("w", c["w"])  # type: ignore[arg-type]
    g.conv_dgrad(dy, w, **_conv_kwargs(c)).set_dim(c["x"]).set_output(True)  # type: ignore[arg-type]
    check(g, rng, TOL[dt])


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("case", ["3x3_pad1", "stride2", "groups2", "asym_pad", "dilation2"])
def test_conv_wgrad(case: str, layout: str, rng: np.random.Generator) -> None:
    c = CONV_CASES[case]
    fwd = _g(DT.FLOAT)
    fy = fwd.conv_fprop(fwd.tensor("x", c["x"]), fwd.tensor("w", c["w"]), **_conv_kwargs(c))  # type: ignore[arg-type]
    fy.set_output(True)
    fwd.validate()
    g = _g(DT.FLOAT)
    x = _nchw(g, "x", c["x"], layout)  # type: ignore[arg-type]
    dy = _nchw(g, "dy", fy.dim, layout)
    g.conv_wgrad(x, dy, **_conv_kwargs(c)).set_dim(c["w"]).set_output(True)  # type: ignore[arg-type]
    check(g, rng, TOL[DT.FLOAT] * 10)  # sums over N x spatial: one more accumulation level


def test_conv_bias_relu_f16_io_f32_compute(rng: np.random.Generator) -> None:
    from fusegraph.demo import build_graph

    g, _ = build_graph(n=2, c=8, hw=10, k=16)
    check(g, rng, TOL[DT.HALF])


# ---- matmul -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize(("a", "b"), [([7, 5], [5, 9]), ([3, 7, 5], [5, 9]), ([2, 1, 4, 6], [3, 6, 2])])
def test_matmul(a: list[int], b: list[int], dt: DT, rng: np.random.Generator) -> None:
    g = _g(dt)
    g.matmul(g.tensor("a", a), g.tensor("b", b)).set_output(True)
    check(g, rng, TOL[dt])


def test_matmul_transposed_operand_strides(rng: np.random.Generator) -> None:
    g = _g(DT.FLOAT)
    a = g.tensor("a", [6, 4], [1, 6])  # column-major
    g.matmul(a, g.tensor("b", [4, 5])).set_output(True)
    check(g, rng, TOL[DT.FLOAT])


@pytest.mark.parametrize(("a", "a_strides"), [([3, 7, 5], None), ([2, 3, 7, 5], None), ([3, 7, 5], [5, 15, 1])])
def test_matmul_one_weight_for_every_batch(a: list[int], a_strides: list[int] | None, rng: np.random.Generator) -> None:
    """A weight broadcast over the batch (a linear layer as an ONNX export writes it) runs as
    one GEMM over the batch's rows: the result matches, whatever the rows' layout."""
    g = _g(DT.FLOAT)
    ta = g.tensor("a", a, a_strides) if a_strides else g.tensor("a", a)
    b = g.tensor("b", [1] * (len(a) - 2) + [5, 4], None)
    g.matmul(ta, b).set_output(True)
    check(g, rng, TOL[DT.FLOAT])


def test_matmul_int32(rng: np.random.Generator) -> None:
    g = fg.Graph("imm", io_data_type=DT.INT32)
    g.matmul(g.tensor("a", [3, 4]), g.tensor("b", [4, 5])).set_output(True)
    check(g, rng, 0.0)


# ---- pointwise ----------------------------------------------------------------------------------
_PARAMS = {
    PointwiseMode.RELU_FWD: {"relu_lower_clip": -0.2, "relu_upper_clip": 0.5, "relu_lower_clip_slope": 0.1},
    PointwiseMode.ELU_FWD: {"elu_alpha": 0.7},
    PointwiseMode.SWISH_FWD: {"swish_beta": 1.5},
    PointwiseMode.SOFTPLUS_FWD: {"softplus_beta": 2.0},
    PointwiseMode.RELU_BWD: {"relu_lower_clip": 0.1},
}


def _pointwise_graph(mode: PointwiseMode, dt: DT, params: dict[str, float] | None = None) -> fg.Graph:
    spec = POINTWISE[mode]
    in_dt = DT.BOOLEAN if spec.inputs == "bool" else dt
    g = fg.Graph(f"pw_{mode.value}", io_data_type=dt, intermediate_data_type=DT.FLOAT)
    a = g.tensor("a", [4, 6], data_type=in_dt)
    b = g.tensor("b", [1, 6], data_type=in_dt)  # broadcast along rows
    if mode == PointwiseMode.BINARY_SELECT:
        c = g.tensor("c", [4, 6], data_type=DT.BOOLEAN)
        y = g.pointwise(a, b, c, mode=mode)
    elif spec.arity == 2:
        y = g.pointwise(a, b, mode=mode, **(params or {}))
    else:
        y = g.pointwise(a, mode=mode, **(params or {}))
    y.set_output(True)
    return g


@pytest.mark.parametrize("dt", [DT.FLOAT, DT.HALF])
@pytest.mark.parametrize("mode", list(PointwiseMode), ids=lambda m: m.value)
def test_pointwise_every_mode(mode: PointwiseMode, dt: DT, rng: np.random.Generator) -> None:
    check(_pointwise_graph(mode, dt), rng, TOL[dt] * 2)


@pytest.mark.parametrize("mode", list(_PARAMS), ids=lambda m: m.value)
def test_pointwise_parameters(mode: PointwiseMode, rng: np.random.Generator) -> None:
    check(_pointwise_graph(mode, DT.FLOAT, _PARAMS[mode]), rng, TOL[DT.FLOAT])


@pytest.mark.parametrize("mode", [PointwiseMode.ADD, PointwiseMode.SUB, PointwiseMode.MUL, PointwiseMode.DIV,
                                  PointwiseMode.MAX, PointwiseMode.MIN, PointwiseMode.ABS, PointwiseMode.NEG],
                         ids=lambda m: m.value)
def test_pointwise_int32(mode: PointwiseMode, rng: np.random.Generator) -> None:
    g = _pointwise_graph(mode, DT.INT32)
    pack = random_inputs(g, rng)
    check(g, rng, 0.0, pack=pack)


def test_pointwise_with_scalar_and_broadcast_stride(rng: np.random.Generator) -> None:
    g = _g(DT.FLOAT)
    x = g.tensor("x", [2, 3, 4, 5], fg.strides_for([2, 3, 4, 5], "NHWC"))
    b = g.tensor("b", [2, 3, 4, 5], [0, 1, 0, 0])  # a per-channel vector, broadcast by strides
    g.mul(g.add(x, b), g.scalar(0.5)).set_output(True)
    check(g, rng, TOL[DT.FLOAT])


def test_cast_through_identity(rng: np.random.Generator) -> None:
    g = _g(DT.FLOAT)
    g.identity(g.tensor("x", [3, 4])).set_data_type(DT.HALF).set_output(True)
    check(g, rng, TOL[DT.HALF])


# ---- reductions, norms, pooling --------------------------------------------------------------
@pytest.mark.parametrize("mode", list(ReductionMode), ids=lambda m: m.value)
@pytest.mark.parametrize("axes", [[1], [0, 2], [2]])
def test_reduction(mode: ReductionMode, axes: list[int], rng: np.random.Generator) -> None:
    g = _g(DT.FLOAT)
    g.reduction(g.tensor("x", [3, 4, 5]), mode, axes=axes).set_output(True)
    check(g, rng, 1e-5)


def test_reduction_int_sum_and_avg(rng: np.random.Generator) -> None:
    for mode in (ReductionMode.SUM, ReductionMode.AVG, ReductionMode.MAX):
        g = fg.Graph("ired", io_data_type=DT.INT32)
        g.reduction(g.tensor("x", [3, 4]), mode, axes=[1]).set_output(True)
        check(g, rng, 0.0)


@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_batchnorm_inference(dt: DT, layout: str, rng: np.random.Generator) -> None:
    g = _g(dt)
    x = _nchw(g, "x", [2, 6, 5, 5], layout)
    p = {k: g.tensor(k, [1, 6, 1, 1], data_type=DT.FLOAT) for k in ("scale", "bias", "mean", "var")}
    g.batchnorm_inference(x, p["scale"], p["bias"], p["mean"], p["var"], 1e-3).set_output(True)
    check(g, rng, NORM_TOL[dt])


@pytest.mark.parametrize("dt", [DT.FLOAT, DT.HALF])
def test_batchnorm_training_with_stats(dt: DT, rng: np.random.Generator) -> None:
    g = _g(dt)
    x = g.tensor("x", [4, 3, 5, 5])
    y, mean, inv = g.batchnorm(x, g.tensor("s", [3], data_type=DT.FLOAT), g.tensor("b", [3], data_type=DT.FLOAT), 1e-5)
    for t in (y, mean, inv):
        t.set_output(True)
    check(g, rng, NORM_TOL[dt])


@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("training", [False, True])
def test_layernorm(dt: DT, training: bool, rng: np.random.Generator) -> None:
    g = _g(dt)
    x = g.tensor("x", [4, 3, 8])
    phase = fg.NormFwdPhase.TRAINING if training else fg.NormFwdPhase.INFERENCE
    y, mean, inv = g.layernorm(x, g.tensor("s", [1, 3, 8]), g.tensor("b", [1, 1, 8]), 1e-5, phase)
    for t in (y, mean, inv):
        if t is not None:
            t.set_output(True)
    check(g, rng, NORM_TOL[dt])


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_rmsnorm(training: bool, bias: bool, rng: np.random.Generator) -> None:
    g = _g(DT.FLOAT)
    x = g.tensor("x", [4, 16])
    phase = fg.NormFwdPhase.TRAINING if training else fg.NormFwdPhase.INFERENCE
    y, inv = g.rmsnorm(x, g.tensor("s", [1, 16]), 1e-6, phase, bias=g.tensor("b", [1, 16]) if bias else None)
    y.set_output(True)
    if inv is not None:
        inv.set_output(True)
    check(g, rng, NORM_TOL[DT.FLOAT])


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("mode", list(PoolingMode), ids=lambda m: m.value)
@pytest.mark.parametrize("pads", [((0, 0), (0, 0)), ((1, 1), (1, 1)), ((0, 1), (2, 0))])
def test_pooling(mode: PoolingMode, layout: str, pads: tuple[tuple[int, int], tuple[int, int]], rng: np.random.Generator) -> None:
    g = _g(DT.FLOAT)
    x = _nchw(g, "x", [2, 3, 9, 8], layout)
    g.pooling(x, mode, window=(3, 3), stride=(2, 2), pre_padding=pads[0], post_padding=pads[1]).set_output(True)
    check(g, rng, TOL[DT.FLOAT])


@pytest.mark.parametrize(
    ("size", "window", "stride", "pre", "post"),
    [(112, 3, 2, 0, 1), (9, 3, 2, 0, 2), (10, 3, 2, 1, 1), (10, 3, 2, 1, 2), (8, 2, 2, 0, 1), (7, 3, 1, 1, 1),
     (11, 5, 3, 2, 3), (6, 4, 2, 0, 3)],
)
@pytest.mark.parametrize("mode", list(PoolingMode), ids=lambda m: m.value)
def test_pooling_asymmetric_padding(size: int, window: int, stride: int, pre: int, post: int, mode: PoolingMode,
                                        rng: np.random.Generator) -> None:
    """Cases torch pads natively (ceil_mode) and cases that need the padded copy."""
    g = _g(DT.FLOAT)
    x = _nchw(g, "x", [1, 4, size, size + 1], "NHWC")
    g.pooling(x, mode, window=(window, window), stride=(stride, stride), pre_padding=(pre, pre),
              post_padding=(post, pre)).set_output(True)
    check(g, rng, 0.0 if mode == PoolingMode.MAX else TOL[DT.FLOAT])


def test_pooling_f16_and_int_max(rng: np.random.Generator) -> None:
    g = _g(DT.HALF)
    g.pooling(g.tensor("x", [1, 2, 6, 6]), PoolingMode.AVG_INCLUDE_PAD, (2, 2)).set_output(True)
    check(g, rng, TOL[DT.HALF])
    gi = fg.Graph("imax", io_data_type=DT.INT32)
    gi.pooling(gi.tensor("x", [1, 2, 6, 6]), PoolingMode.MAX, (2, 2)).set_output(True)
    check(gi, rng, 0.0)


# ---- attention, softmax ------------------------------------------------------------------------
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize(
    "variant", ["plain", "causal", "bool_mask", "float_mask", "gqa", "causal_mask", "scale", "cross"]
)
def test_sdpa(variant: str, dt: DT, rng: np.random.Generator) -> None:
    g = _g(dt)
    skv = 9 if variant == "cross" else 7
    q = g.tensor("q", [2, 4, 7, 8])
    kv_heads = 2 if variant == "gqa" else 4
    k = g.tensor("k", [2, kv_heads, skv, 8])
    v = g.tensor("v", [2, kv_heads, skv, 8])
    mask = None
    if variant in ("bool_mask", "causal_mask"):
        mask = g.tensor("m", [1, 1, 7, skv], data_type=DT.BOOLEAN)
    elif variant == "float_mask":
        mask = g.tensor("m", [2, 1, 7, skv], data_type=dt)
    g.sdpa(q, k, v, attn_scale=0.3 if variant == "scale" else None,
           causal=variant in ("causal", "causal_mask"), mask=mask).set_output(True)
    g.validate()
    pack = random_inputs(g, rng)
    if mask is not None and mask.dtype == DT.BOOLEAN:
        m = pack["m"].copy()
        m[..., 0] = True  # keep one key per row, so no row is fully masked
        pack["m"] = m
    check(g, rng, TOL[dt] * 2, pack=pack)


@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize(("axis", "log"), [(-1, False), (1, False), (-1, True)])
def test_softmax(axis: int, log: bool, dt: DT, rng: np.random.Generator) -> None:
    g = _g(dt)
    g.softmax(g.tensor("x", [3, 5, 7]), axis=axis, log=log).set_output(True)
    check(g, rng, TOL[dt])


# ---- data movement ----------------------------------------------------------------------------
def test_reshape_transpose_concat_slice(rng: np.random.Generator) -> None:
    g = _g(DT.FLOAT)
    x = g.tensor("x", [2, 3, 4], fg.strides_for([2, 3, 4], "row_major"))
    y = g.tensor("y", [2, 5, 4])
    r = g.reshape(g.transpose(x, [0, 2, 1]), [2, 12])
    cat = g.concatenate([g.reshape(x, [2, 3, 4]), y], axis=1)
    s = g.slice(cat, [0, 1, 0], [2, 8, 4], [1, 2, 3])
    r.set_output(True)
    s.set_output(True)
    check(g, rng, 0.0)


def test_concat_bool_and_int(rng: np.random.Generator) -> None:
    g = fg.Graph("cat", io_data_type=DT.BOOLEAN)
    g.concatenate([g.tensor("a", [2, 3]), g.tensor("b", [2, 2])], axis=1).set_output(True)
    check(g, rng, 0.0)


# ---- I/O kinds, knobs, serialization --------------------------------------------------------------
def test_given_output_array_is_written(rng: np.random.Generator) -> None:
    g = conv_graph()
    pack = random_inputs(g, rng)
    yt = g.tensor_by_name("y")
    out = fg.graph.layout.empty_strided(yt.shape, yt.strides, np.float32)
    res = ENGINE.build(g, CPU).execute({**pack, "y": out})
    assert res == {}
    ref = g.execute(pack, engine="reference")["y"]
    assert np.linalg.norm(out - ref) / max(float(np.linalg.norm(ref)), 1e-30) < 1e-5


def test_torch_tensors_in_and_out(rng: np.random.Generator) -> None:
    g = conv_graph()
    pack = random_inputs(g, rng)
    tensors = {k: torch.from_numpy(v) for k, v in pack.items()}
    res = ENGINE.build(g, CPU).execute(tensors)
    assert isinstance(res["y"], torch.Tensor)
    ref = g.execute(pack, engine="reference")["y"]
    assert np.linalg.norm(res["y"].numpy() - ref) / max(float(np.linalg.norm(ref)), 1e-30) < 1e-5
    with pytest.raises(VariantPackError, match="dtype"):
        ENGINE.build(g, CPU).execute({**tensors, "x": tensors["x"].double()})


def test_buffers_in_and_out_share_memory(rng: np.random.Generator) -> None:
    iree = REGISTRY.get("iree")
    if not iree.available():
        pytest.skip(f"fusegraph Buffers need IREE's runtime: {iree.available().reason}")
    g = conv_graph()
    pack = random_inputs(g, rng)
    bufs = {k: fg.Buffer.from_numpy(v, CPU, tensor=g.tensor_by_name(k)) for k, v in pack.items()}
    plan = ENGINE.build(g, CPU)
    res = plan.execute(bufs)
    y = res["y"]
    assert isinstance(y, fg.Buffer) and y.shape == g.tensor_by_name("y").shape
    assert y.strides == g.tensor_by_name("y").strides
    ref = g.execute(pack, engine="reference")["y"]
    assert np.linalg.norm(y.to_numpy() - ref) / max(float(np.linalg.norm(ref)), 1e-30) < 1e-5
    # zero copy: the torch view of an input Buffer is its memory
    view = torch_engine.buffer_to_torch(bufs["x"], g.tensor_by_name("x"))
    view.mul_(0.0)
    assert np.abs(bufs["x"].to_numpy()).max() == 0.0
    # a given output Buffer is written in place
    out = fg.Buffer.empty(g.tensor_by_name("y"), CPU)
    plan.execute({**bufs, "y": out})
    zero_x = g.execute({**pack, "x": np.zeros_like(pack["x"])}, engine="reference")["y"]
    assert np.abs(out.to_numpy() - zero_x).max() < 1e-6


@pytest.mark.parametrize("fmt", ["auto", "channels_last", "contiguous"])
def test_memory_format_knob(fmt: str, rng: np.random.Generator) -> None:
    check(conv_graph(), rng, TOL[DT.FLOAT], EngineConfig("torch", (("memory_format", fmt),)))


def test_threads_knob_runs_single_threaded_and_restores(rng: np.random.Generator) -> None:
    before = torch.get_num_threads()
    check(conv_graph(), rng, TOL[DT.FLOAT], EngineConfig("torch", (("threads", 1),)))
    assert torch.get_num_threads() == before


def test_knobs_are_typed_and_checked() -> None:
    g = conv_graph()
    knobs = {k.name: k for k in ENGINE.knobs(g, CPU)}
    assert knobs["memory_format"].choices == ("auto", "channels_last", "contiguous")
    assert "cudnn_benchmark" not in knobs  # a GPU-only knob
    with pytest.raises(ValueError, match="not in"):
        ENGINE.build(g, CPU, EngineConfig("torch", (("memory_format", "weird"),)))
    with pytest.raises(ValueError, match="no knob 'nope'"):
        ENGINE.build(g, CPU, EngineConfig("torch", (("nope", 1),)))


def test_serialize_and_load_plan(rng: np.random.Generator) -> None:
    g = conv_graph()
    plan = ENGINE.build(g, CPU, EngineConfig("torch", (("memory_format", "contiguous"),)))
    again = ENGINE.load_plan(plan.serialize(), CPU)
    assert again.config == plan.config
    pack = random_inputs(g, rng)
    np.testing.assert_array_equal(again.execute(pack)["y"], plan.execute(pack)["y"])


@pytest.mark.slow
def test_torch_compile_knob_on_cpu(rng: np.random.Generator) -> None:
    """torch.compile works on this CPU (Inductor + the system C++ compiler), in seconds."""
    if not ENGINE.compile_support(CPU):
        pytest.skip(f"torch.compile unavailable here: {ENGINE.compile_support(CPU).reason}")
    g = _g(DT.FLOAT)
    x = g.tensor("x", [64, 32])
    g.tanh(g.mul(g.relu(g.add(x, g.tensor("b", [1, 32]))), g.scalar(2.0))).set_output(True)
    check(g, rng, TOL[DT.FLOAT], EngineConfig("torch", (("compile", True),)))


@pytest.mark.slow
def test_inductors_fx_graph_cache_serves_a_second_build(rng: np.random.Generator, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A compiled plan's graph is keyed in Inductor's FX graph cache, so another session (or
    process) of the same graph loads it instead of compiling again. Compiled outside Dynamo
    the cache was bypassed for want of a shape environment, and every ONNX session on a GPU
    recompiled each of its torch[compile=True] regions. Within a process, plans of one graph
    share the compiled callable."""
    if not ENGINE.compile_support(CPU):
        pytest.skip(f"torch.compile unavailable here: {ENGINE.compile_support(CPU).reason}")
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FUSEGRAPH_CACHE", "0")  # with it on, an AOTInductor package is kept instead (test_torch_aoti_regions.py)
    g = _g(DT.FLOAT)
    x = g.tensor("x", [48, 24])
    g.sigmoid(g.mul(g.add(x, g.tensor("b", [1, 24])), g.scalar(3.0))).set_output(True)
    from fusegraph.engines.torch import compiled

    monkeypatch.setattr(compiled, "COMPILED", {})
    before = dict(counters["inductor"])
    check(g, rng, TOL[DT.FLOAT], EngineConfig("torch", (("compile", True),)))
    check(g, rng, TOL[DT.FLOAT], EngineConfig("torch", (("compile", True),)))  # in process: the same callable
    assert len(compiled.COMPILED) == 1
    compiled.COMPILED.clear()  # as another process would start: Inductor's cache on disk only
    check(g, rng, TOL[DT.FLOAT], EngineConfig("torch", (("compile", True),)))
    got = {k: counters["inductor"][k] - before.get(k, 0) for k in ("fxgraph_cache_miss", "fxgraph_cache_hit",
                                                                       "fxgraph_cache_bypass")}
    assert got == {"fxgraph_cache_miss": 1, "fxgraph_cache_hit": 1, "fxgraph_cache_bypass": 0}, got


@pytest.mark.slow
def test_torch_compile_knob_reshapes_a_tensor_no_view_reaches(rng: np.random.Generator) -> None:
    """A reshape of a transposed tensor under torch.compile: traced as a reshape into the
    declared layout, not as a view (Inductor lays buffers out anew, and a view valid on the
    traced strides failed inside it on the H100)."""
    if not ENGINE.compile_support(CPU):
        pytest.skip(f"torch.compile unavailable here: {ENGINE.compile_support(CPU).reason}")
    g = _g(DT.FLOAT)
    x = g.tensor("x", [4, 6, 8])
    t = g.transpose(g.relu(x), [1, 0, 2])
    g.add(g.reshape(t, [6, 32]), g.tensor("b", [1, 32])).set_output(True)
    check(g, rng, TOL[DT.FLOAT], EngineConfig("torch", (("compile", True),)))


def _depthwise_graph(c: int = 16, groups: int | None = None) -> fg.Graph:
    g = fg.Graph("dw", io_data_type=DT.FLOAT)
    groups = c if groups is None else groups
    x = g.tensor("x", [2, c, 9, 9])
    w = g.tensor("w", [c, c // groups, 3, 3])
    g.conv_fprop(x, w, padding=[1, 1]).set_output(True)
    return g.validate()


def test_the_depthwise_knob_is_offered_on_a_gpu_for_depthwise_convolutions_only() -> None:
    from fusegraph.regions.incumbent import op_by_op_config

    gpu = fg.Handle("cuda:0")
    names = lambda g, h: {k.name for k in ENGINE.knobs(g, h)}  # noqa: E731
    assert "cudnn_depthwise" in names(_depthwise_graph(), gpu)
    assert "cudnn_depthwise" not in names(_depthwise_graph(), CPU)
    assert "cudnn_depthwise" not in names(_depthwise_graph(groups=4), gpu)  # grouped, not depthwise
    assert "cudnn_depthwise" not in names(conv_graph(), gpu)
    untimed = dict(op_by_op_config(_depthwise_graph(), gpu, benchmark=False).knobs)
    assert untimed["cudnn_depthwise"] is False and untimed["cudnn_benchmark"] is False
    assert "cudnn_depthwise" not in dict(op_by_op_config(_depthwise_graph(), gpu).knobs)
    assert "cudnn_depthwise" not in dict(op_by_op_config(conv_graph(), gpu, benchmark=False).knobs)


# ---- what torch cannot do, and torch missing ------------------------------------------------------
def test_unsupported_cases_say_why() -> None:
    g = fg.Graph("iavg", io_data_type=DT.INT32)
    g.pooling(g.tensor("x", [1, 2, 4, 4]), PoolingMode.AVG_INCLUDE_PAD, (2, 2), name="pool").set_output(True)
    s = ENGINE.supports(g.validate(), CPU)
    assert not s and "INT32 average pooling" in s.reason and "node 'pool'" in s.reason
    h = ENGINE.supports(conv_graph(), fg.Handle("cuda:0"))
    if torch.cuda.is_available():  # the GPU machine: supported there
        assert h, h.reason
    else:
        assert not h and "GPU" in h.reason


def test_without_torch_the_engine_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("fusegraph.engines.torch.engine.torch_installed", lambda: False)
    e = torch_engine.TorchEngine()
    assert not e.available() and "not installed" in e.available().reason
    assert not e.supports(conv_graph(), CPU)
    assert e.version == "-"
    assert e.library_versions() == {}


def test_module_imports_without_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from fusegraph.engines.torch import TorchEngine\n"
        "e = TorchEngine(); print(bool(e.available()), e.available().reason)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    available, reason = res.stdout.split(" ", 1)
    assert available == "False" and "PyTorch" in reason


def test_every_op_kind_is_lowered() -> None:
    assert set(torch_engine.LOWER) == set(fg.OpKind)



@pytest.mark.parametrize("out_layout", ["NHWC", "NCHW"])
def test_channel_shuffle_lands_in_declared_layout(out_layout: str, rng: np.random.Generator) -> None:
    """reshape -> transpose -> reshape (ShuffleNet): the copy goes straight into the declared
    layout of the last reshape, so a channels-last graph stays channels-last."""
    g = _g(DT.FLOAT)
    x = _nchw(g, "x", [1, 12, 5, 6], "NHWC")
    s5 = g.reshape(x, [1, 3, 4, 5, 6])
    t5 = g.transpose(s5, [0, 2, 1, 3, 4])
    y = g.reshape(t5, [1, 12, 5, 6])
    y.set_stride(list(fg.strides_for([1, 12, 5, 6], out_layout)))
    w = g.tensor("w", [8, 12, 1, 1], fg.strides_for([8, 12, 1, 1], "KRSC"))
    g.conv_fprop(y, w).set_output(True).set_name("z")
    y.set_output(True).set_name("y")
    check(g, rng, TOL[DT.FLOAT])
    plan = ENGINE.build(g, CPU)
    fn = plan._fn
    seen: dict[str, object] = {}

    def spy(inputs: dict[str, object]) -> dict[str, object]:
        out = fn(inputs)
        seen.update(out)
        return out

    plan._fn = spy
    plan.execute(random_inputs(g, rng))
    got = seen["y"]
    assert isinstance(got, torch.Tensor)
    assert got.stride() == tuple(fg.strides_for([1, 12, 5, 6], out_layout))


def test_host_inputs_in_another_layout_are_laid_out_by_torch(rng: np.random.Generator) -> None:
    """The torch plan relayouts a NumPy input whose memory order differs from the declared
    one itself (TorchPlan.relayouts_host_inputs), with the same result; the other engines
    take it too, through the variant pack's copy into the declared layout (one input
    contract, docs/graph_api.md)."""
    g = fg.Graph("cl", io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT)
    x = g.tensor("x", [2, 3, 5, 7], fg.strides_for([2, 3, 5, 7], "NHWC"))
    g.relu(g.mul(x, g.tensor("s", [1, 3, 1, 1]))).set_output(True).set_name("y")
    g.validate()
    pack = random_inputs(g, rng)
    nchw = np.ascontiguousarray(pack["x"])  # row-major, not the declared NHWC
    assert not np.array_equal(np.array(nchw.strides), np.array(pack["x"].strides))
    plan = torch_engine.TorchEngine().build(g, fg.Handle("cpu"))
    assert plan.relayouts_host_inputs
    want = g.execute(pack, engine="reference")["y"]
    np.testing.assert_allclose(plan.execute({**pack, "x": nchw})["y"], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(plan.execute({**pack, "x": nchw[..., ::-1].copy()[..., ::-1]})["y"], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(g.execute({**pack, "x": nchw}, engine="reference")["y"], want, rtol=1e-12, atol=1e-12)
