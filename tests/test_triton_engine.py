"""The Triton row-kernel engine: CPU checks that run in CI (lazy imports, why it is
unavailable, which graphs are one row kernel and why not, the generated text) and
GPU-marked checks against the float64 reference (``pytest -m gpu tests/test_triton_engine.py``
on the GPU machine)."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
from engine_fakes import check_repeated_calls, rel_error

import fusegraph as fg
from fusegraph import DataType as DT
from fusegraph.engines.base import EngineConfig
from fusegraph.engines.triton import TritonEngine
from fusegraph.engines.triton.codegen import kernel_source
from fusegraph.engines.triton.rows import Access, Refusal, analyze
from fusegraph.errors import UnsupportedError, VariantPackError
from fusegraph.graph.ops import NormFwdPhase, ReductionMode
from fusegraph.reference.inputs import random_inputs

ENGINE = TritonEngine()
GPU = fg.Handle("cuda:0")
TOL = {DT.FLOAT: 1e-5, DT.HALF: 1e-2, DT.BFLOAT16: 2e-2}


def _g(name: str, dt: DT = DT.HALF) -> fg.Graph:
    return fg.Graph(name, io_data_type=dt, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)


def ln_gelu(dt: DT = DT.HALF, rows: int = 64, cols: int = 96, stats: bool = False) -> fg.Graph:
    g = _g(f"ln_gelu_{dt.value}", dt)
    x = g.tensor("x", [rows, cols])
    phase = NormFwdPhase.TRAINING if stats else NormFwdPhase.INFERENCE
    y, mean, inv = g.layernorm(x, g.tensor("scale", [1, cols]), g.tensor("bias", [1, cols]), 1e-5, phase)
    g.gelu(y).set_output(True)
    if stats:
        assert mean is not None and inv is not None
        mean.set_output(True).set_data_type(DT.FLOAT)
        inv.set_output(True).set_data_type(DT.FLOAT)
    return g


def softmax_graph(dt: DT = DT.HALF, shape: tuple[int, ...] = (64, 200), log: bool = False) -> fg.Graph:
    g = _g(f"softmax_{dt.value}", dt)
    x = g.tensor("x", list(shape))
    scaled = g.mul(x, g.scalar(0.125))
    g.softmax(scaled, -1, log=log).set_output(True)
    return g


# ---- CPU ---------------------------------------------------------------------------------------
def test_import_loads_neither_triton_nor_torch() -> None:
    code = textwrap.dedent("""
        import sys
        import fusegraph.engines.triton as t
        e = t.TritonEngine(); e.available(); e.version
        assert "triton" not in sys.modules and "torch" not in sys.modules, [m for m in sys.modules if m in ("torch", "triton")]
    """)
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unavailable_here_says_why() -> None:
    import importlib.util

    s = ENGINE.available()
    if importlib.util.find_spec("triton") is None:
        assert not s and "Triton is not installed" in s.reason
    cpu = ENGINE.supports(ln_gelu().validate(), fg.Handle("cpu"))
    assert not cpu and "NVIDIA GPUs only" in cpu.reason
    with pytest.raises(UnsupportedError, match="NVIDIA GPUs only"):
        ENGINE.build(ln_gelu().validate(), fg.Handle("cpu"))


def test_registry_lists_triton() -> None:
    from fusegraph.engines.registry import REGISTRY

    assert "triton" in REGISTRY.names()


def test_row_view_of_layernorm_gelu() -> None:
    rg = analyze(ln_gelu().validate())
    assert (rg.rows, rg.cols) == (64, 96)
    assert rg.access["x"] == Access("full", 96, 1)
    assert rg.access["scale"] == Access("col", 0, 1)
    assert [n.kind.value for n in rg.order] == ["layernorm", "pointwise"]


def test_row_view_collapses_leading_dims_and_padded_rows() -> None:
    g = _g("sm3")
    x = g.tensor("x", [2, 3, 40], [3 * 64, 64, 1])  # rows padded to 64 elements
    g.softmax(x, -1).set_output(True)
    rg = analyze(g.validate())
    assert (rg.rows, rg.cols) == (6, 40) and rg.access["x"] == Access("full", 64, 1)
    g2 = _g("ln3")
    x2 = g2.tensor("x", [4, 8, 16])  # layernorm: one row per batch item, 128 columns
    y, _, _ = g2.layernorm(x2, g2.tensor("s", [1, 8, 16]), g2.tensor("b", [1, 8, 16]), 1e-5)
    y.set_output(True)
    rg2 = analyze(g2.validate())
    assert (rg2.rows, rg2.cols) == (4, 128) and rg2.access["s"] == Access("col", 0, 1)


def _refusal(g: fg.Graph) -> str:
    with pytest.raises(Refusal) as info:
        analyze(g.validate())
    return str(info.value)


def test_refusals_say_why() -> None:
    g = _g("chain")
    g.relu(g.exp(g.tensor("x", [8, 8]))).set_output(True)
    assert "pointwise-only" in _refusal(g)
    g = _g("axis0")
    g.softmax(g.tensor("x", [8, 16]), 0).set_output(True)
    assert "not over the trailing dims" in _refusal(g)
    g = _g("transposed")
    g.softmax(g.tensor("x", [2, 8, 16], [16, 32, 1]), -1).set_output(True)
    assert "do not collapse" in _refusal(g) and "'x'" in _refusal(g)
    g = _g("wide")
    g.softmax(g.tensor("x", [2, 32768]), -1).set_output(True)
    assert "up to 16384" in _refusal(g)
    g = _g("mm")
    g.softmax(g.matmul(g.tensor("a", [8, 8]), g.tensor("b", [8, 8])), -1).set_output(True)
    assert "matmul" in _refusal(g)
    g = _g("odd_broadcast")
    x = g.tensor("x", [4, 8, 16])
    g.softmax(g.add(x, g.tensor("m", [1, 8, 1])), -1).set_output(True)
    assert "'m'" in _refusal(g)
    g = _g("colout")
    x = g.tensor("x", [8, 16])
    g.softmax(x, -1).set_output(True)
    g.mul(g.tensor("s", [1, 16]), g.scalar(2.0)).set_output(True)
    assert "every row's program would write it" in _refusal(g)
    g = fg.Graph("f64", io_data_type=DT.DOUBLE, intermediate_data_type=DT.DOUBLE, compute_data_type=DT.DOUBLE)
    g.softmax(g.tensor("x", [8, 16]), -1).set_output(True)
    assert "DOUBLE" in _refusal(g)


GOLDEN = '''\
# fusegraph row kernel for graph 'ln_gelu_half': 64 rows x 96 columns
import triton
import triton.language as tl
from triton.language.extra import libdevice  # noqa: F401

ROWS = tl.constexpr(4)
BLOCK = tl.constexpr(128)


@triton.jit
def _mul(a, b):
    return a * b


@triton.jit
def fg_row_kernel(p0, p1, p2, p3):
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK)[None, :]
    cm = c < 96
    v0 = tl.load(p1 + c * 1, mask=cm, other=0.0)  # scale
    v1 = tl.load(p2 + c * 1, mask=cm, other=0.0)  # bias
    r = (pid * ROWS + tl.arange(0, ROWS))[:, None]
    v2 = tl.load(p0 + r * 96 + c * 1, mask=cm, other=0.0).to(tl.float32)  # x
    # layernorm_0: layernorm
    v4_mean = tl.sum(tl.where(cm, v2, 0.0), 1)[:, None] / 96.0
    v4_d = tl.where(cm, v2 - v4_mean, 0.0)
    v4_inv = 1.0 / tl.sqrt_rn(tl.sum(v4_d * v4_d, 1)[:, None] / 96.0 + 9.999999747378752e-06)
    v4 = v4_d * v4_inv * v0.to(tl.float32) + v1.to(tl.float32)
    # pointwise_0: pointwise
    v5 = (0.5 * v4 * (1.0 + tl.erf(v4 * 0.7071067811865476)))
    tl.store(p3 + r * 96 + c * 1, tl.broadcast_to(v5, [ROWS, BLOCK]).to(tl.float16), mask=cm)  # pointwise_0::y
'''


# the same graph with gelu_cdf="poly": the helper, and GELU through it
GOLDEN_POLY = '''\
# fusegraph row kernel for graph 'ln_gelu_half': 64 rows x 96 columns
import triton
import triton.language as tl
from triton.language.extra import libdevice  # noqa: F401

ROWS = tl.constexpr(4)
BLOCK = tl.constexpr(128)


@triton.jit
def _mul(a, b):
    return a * b


@triton.jit
def _gelu_cdf(x):
    z = tl.abs(x) * 0.7071067811865476
    zc = tl.minimum(z, 4.2)
    h = tl.where(z < 4.2, tl.exp2(((((((0.00010021174239227548 * zc + -0.00046152211143635213) * zc + -0.0023023411631584167) * zc + 0.02945261262357235) * zc + -0.14896371960639954) * zc + -0.9183286428451538) * zc + -1.6279137134552002) * zc + -1.0), 0.0)  # erfc(z) / 2
    return tl.where(x < 0.0, h, 1.0 - h)


@triton.jit
def fg_row_kernel(p0, p1, p2, p3):
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK)[None, :]
    cm = c < 96
    v0 = tl.load(p1 + c * 1, mask=cm, other=0.0)  # scale
    v1 = tl.load(p2 + c * 1, mask=cm, other=0.0)  # bias
    r = (pid * ROWS + tl.arange(0, ROWS))[:, None]
    v2 = tl.load(p0 + r * 96 + c * 1, mask=cm, other=0.0).to(tl.float32)  # x
    # layernorm_0: layernorm
    v4_mean = tl.sum(tl.where(cm, v2, 0.0), 1)[:, None] / 96.0
    v4_d = tl.where(cm, v2 - v4_mean, 0.0)
    v4_inv = 1.0 / tl.sqrt_rn(tl.sum(v4_d * v4_d, 1)[:, None] / 96.0 + 9.999999747378752e-06)
    v4 = v4_d * v4_inv * v0.to(tl.float32) + v1.to(tl.float32)
    # pointwise_0: pointwise
    v5 = (v4 * _gelu_cdf(v4))
    tl.store(p3 + r * 96 + c * 1, tl.broadcast_to(v5, [ROWS, BLOCK]).to(tl.float16), mask=cm)  # pointwise_0::y
'''


def test_golden_kernel_text() -> None:
    g = ln_gelu().validate()
    assert kernel_source(g, analyze(g), 4) == GOLDEN_POLY  # the default: the polynomial CDF
    assert kernel_source(g, analyze(g), 4, "erf") == GOLDEN
    assert kernel_source(g, analyze(g), 4, "poly") == GOLDEN_POLY


def test_gelu_cdf_knob_only_where_gelu_is() -> None:
    """The ``gelu_cdf`` knob is offered for graphs with GELU forward or backward (elsewhere
    it would not change the kernel, and autotuning would time it for nothing), defaults to
    the polynomial CDF (measured faster, bench_gpu.py --erf-ab), and comes last so the
    capped product of knob settings tries both forms at the default tiling; "poly" leaves a
    kernel without GELU as it was; other values are refused."""
    from fusegraph.engines.base import knob_values
    from fusegraph.select.heuristics import knob_configs

    g = ln_gelu().validate()
    knobs = ENGINE.knobs(g, GPU)
    assert [k.name for k in knobs] == ["cuda_graph", "rows_per_program", "num_warps", "gelu_cdf"]
    assert knobs[-1].default == "poly" and knobs[-1].choices == ("poly", "erf")
    assert knob_values("triton", knobs, EngineConfig("triton"))["gelu_cdf"] == "poly"
    with pytest.raises(ValueError, match="gelu_cdf"):
        knob_values("triton", knobs, EngineConfig("triton", (("gelu_cdf", "tanh"),)))
    combos = knob_configs(knobs)
    assert combos[0] == () and combos[1] == (("gelu_cdf", "erf"),)
    sm = softmax_graph().validate()
    assert "gelu_cdf" not in [k.name for k in ENGINE.knobs(sm, GPU)]
    assert kernel_source(sm, analyze(sm), 4, "poly") == kernel_source(sm, analyze(sm), 4)
    bwd = _g("gelu_bwd", DT.FLOAT)
    dy, x = bwd.tensor("dy", [64, 96]), bwd.tensor("x", [64, 96])
    bwd.softmax(bwd.gelu_backward(dy, x), -1).set_output(True)
    bwd.validate()
    assert "gelu_cdf" in [k.name for k in ENGINE.knobs(bwd, GPU)]
    erf, poly = kernel_source(bwd, analyze(bwd), 4, "erf"), kernel_source(bwd, analyze(bwd), 4)
    assert "tl.erf(" in erf and "_gelu_cdf" not in erf
    assert "tl.erf(" not in poly and "def _gelu_cdf(x):" in poly and "_gelu_cdf(v" in poly
    with pytest.raises(ValueError, match="gelu_cdf"):
        kernel_source(g, analyze(g), 4, "tanh")


def test_gelu_cdf_polynomial_is_f32_accurate() -> None:
    """The emitted GELU CDF (codegen.gelu_cdf_source) evaluated as the GPU does -- f32 Horner
    with FMA, exp2 off by up to ex2.approx's 2^-22 either way -- on a dense grid and far out,
    against float64 erf/erfc: erf's error <= 4e-7 absolute, GELU's <= 2e-7 * max(1, |x|)
    (1.65e-7 measured; torch's f32 GELU on libdevice erf: 1.06e-7)."""
    from scipy import special

    from fusegraph.engines.triton import codegen

    text = "\n".join(codegen.gelu_cdf_source())
    assert all(repr(c) in text for c in codegen.GELU_CDF_COEFFS) and repr(codegen.GELU_CDF_Z) in text
    f32 = np.float32
    c = np.array(codegen.GELU_CDF_COEFFS, dtype=f32)
    x = np.concatenate([
        np.linspace(-30, 30, 1_200_001, dtype=f32),
        f32(10.0) ** np.linspace(-30, 5, 20_001, dtype=f32),
        -(f32(10.0) ** np.linspace(-30, 5, 20_001, dtype=f32)),
    ])
    xd = x.astype(np.float64)
    z = (np.abs(x) * f32(0.7071067811865476)).astype(f32)
    zc = np.minimum(z, f32(codegen.GELU_CDF_Z))
    p = np.full_like(zc, c[-1])
    for k in c[-2::-1]:
        p = (p.astype(np.float64) * zc + np.float64(k)).astype(f32)  # one rounding: FMA
    ref_cdf = 0.5 * special.erfc(-xd / np.sqrt(2.0))
    ref_gelu = xd * ref_cdf
    for ulps in (-1.0, 0.0, 1.0):
        h = (np.exp2(p.astype(np.float64)) * (1.0 + ulps * 2.0**-22)).astype(f32)
        h = np.where(z < f32(codegen.GELU_CDF_Z), h, f32(0.0))
        cdf = np.where(x < 0, h, (f32(1.0) - h).astype(f32))
        erf_err = np.abs((2.0 * cdf.astype(np.float64) - 1.0) - special.erf(xd / np.sqrt(2.0)))
        assert erf_err.max() <= 4e-7 + 2.0**-23, erf_err.max()  # + the f32 rounding of the CDF itself
        gelu = (x * cdf).astype(f32).astype(np.float64)
        gelu_err = np.abs(gelu - ref_gelu) / np.maximum(1.0, np.abs(xd))
        assert gelu_err.max() <= 2e-7, gelu_err.max()


def test_knobs_and_default_tiling() -> None:
    from fusegraph.engines.triton.engine import default_tiling

    assert default_tiling(8192, 4096) == (1, 4)  # one row of 4096 per program, 4 warps (bench_gpu, H200)
    assert default_tiling(8192, 64) == (64, 4)
    assert default_tiling(3, 64) == (4, 1)


# ---- GPU ---------------------------------------------------------------------------------------
def _needs_triton() -> None:
    s = ENGINE.supports(ln_gelu().validate(), GPU)
    if not s:
        pytest.fail(f"GPU test without a usable Triton engine: {s.reason}")


def _check(g: fg.Graph, rng: np.random.Generator, tol: float, config: EngineConfig | None = None) -> Any:
    _needs_triton()
    g.validate()
    s = ENGINE.supports(g, GPU)
    assert s, s.reason
    pack = random_inputs(g, rng)
    plan = ENGINE.build(g, GPU, config)
    got = plan.execute(pack)
    ref = g.execute(pack, engine="reference")
    for t in g.outputs():
        assert got[t.name].strides == ref[t.name].strides, t.name
        err = rel_error(got[t.name], ref[t.name])
        assert err <= tol, (t.name, err)
    return plan


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [DT.HALF, DT.BFLOAT16, DT.FLOAT])
def test_layernorm_gelu(dt: DT, rng: np.random.Generator) -> None:
    _check(ln_gelu(dt), rng, TOL[dt])


@pytest.mark.gpu
def test_layernorm_training_stats(rng: np.random.Generator) -> None:
    _check(ln_gelu(DT.FLOAT, stats=True), rng, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [DT.HALF, DT.BFLOAT16, DT.FLOAT])
@pytest.mark.parametrize("log", [False, True])
def test_softmax(dt: DT, log: bool, rng: np.random.Generator) -> None:
    _check(softmax_graph(dt, log=log), rng, TOL[dt])
    _check(softmax_graph(dt, (2, 3, 4096), log=log), rng, TOL[dt])


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
def test_rmsnorm_with_stats(bias: bool, rng: np.random.Generator) -> None:
    g = _g("rms", DT.FLOAT)
    x = g.tensor("x", [33, 8, 20])
    y, inv = g.rmsnorm(x, g.tensor("s", [1, 8, 20]), 1e-6, NormFwdPhase.TRAINING, bias=g.tensor("b", [1, 8, 20]) if bias else None)
    g.swish(y).set_output(True)
    assert inv is not None
    inv.set_output(True)
    _check(g, rng, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(ReductionMode))
def test_trailing_reductions(mode: ReductionMode, rng: np.random.Generator) -> None:
    g = _g(f"red_{mode.value}", DT.FLOAT)
    x = g.tensor("x", [48, 3, 10])
    pre = g.tanh(x) if mode != ReductionMode.MUL else g.add(g.mul(g.tanh(x), g.scalar(0.1)), g.scalar(1.0))
    g.reduction(pre, mode, [48, 1, 1]).set_output(True)
    _check(g, rng, 1e-5)


@pytest.mark.gpu
def test_pointwise_menagerie_and_broadcasts(rng: np.random.Generator) -> None:
    """Every kind of operand (frame, row, column, scalar, constant) and most pointwise modes
    around one softmax, against the reference."""
    g = _g("zoo", DT.FLOAT)
    x = g.tensor("x", [40, 72])
    rowv = g.tensor("rowv", [40, 1])
    colv = g.tensor("colv", [1, 72])
    s = g.tensor("s", [1, 1])
    h = g.add(g.mul(x, colv), rowv)
    h = g.sub(h, s)
    h = g.max(h, g.neg(g.abs(x)))
    h = g.binary_select(h, g.tanh(h), g.cmp_gt(x, g.scalar(0.0)))
    h = g.add(g.sigmoid(h), g.elu(h))
    h = g.add(h, g.gelu_approx_tanh(x))
    h = g.add(h, g.softplus(x))
    h = g.add(h, g.mul(g.sin(x), g.cos(x)))
    h = g.add(h, g.swish(x))
    sm = g.softmax(h, -1)
    out = g.add(g.mul(sm, g.exp(g.neg(g.abs(x)))), g.sqrt(g.abs(rowv)))
    out.set_output(True)
    _check(g, rng, 1e-5)


@pytest.mark.gpu
def test_max_reduction_keeps_nan(rng: np.random.Generator) -> None:
    g = _g("nanmax", DT.FLOAT)
    g.reduction(g.tensor("x", [4, 32]), ReductionMode.MAX, [4, 1]).set_output(True)
    _needs_triton()
    plan = ENGINE.build(g.validate(), GPU)
    x = rng.standard_normal((4, 32)).astype(np.float32)
    x[2, 7] = np.nan
    got = plan.execute({"x": x})[g.outputs()[0].name]
    assert np.isnan(got[2, 0]) and not np.isnan(got[[0, 1, 3], 0]).any()


@pytest.mark.gpu
def test_gelu_on_a_dense_grid_against_float64() -> None:
    """GELU's polynomial CDF on the GPU (gelu_cdf="poly", codegen.gelu_cdf_source): a dense
    f32 grid over [-12, 12], far-out values and inf/NaN, against float64 -- the f32 accuracy
    the CPU test emulates, with room for ex2.approx."""
    import torch

    _needs_triton()
    g = _g("gelu_grid", DT.FLOAT)
    x = g.tensor("x", [512, 4096])
    g.gelu(x).set_output(True)
    g.reduction(x, ReductionMode.MAX, [512, 1]).set_output(True)  # a row op: what makes it a row graph
    g.validate()
    plan = ENGINE.build(g, GPU, EngineConfig("triton", (("gelu_cdf", "poly"),)))
    assert "_gelu_cdf" in plan.source.read_text()
    grid = torch.linspace(-12, 12, 512 * 4096 - 8, dtype=torch.float64, device="cuda")
    far = torch.tensor([1e5, -1e5, 40.0, -40.0, 1e-30, -1e-30, float("inf"), float("nan")], dtype=torch.float64, device="cuda")
    xs = torch.cat([grid, far]).float()
    out = plan.execute({"x": xs.reshape(512, 4096)})
    torch.cuda.synchronize()
    y = out[g.outputs()[0].name].reshape(-1).double()
    xd = xs.double()
    ref = xd * 0.5 * torch.special.erfc(-xd / math.sqrt(2.0))
    fin = torch.isfinite(xd)
    err = ((y - ref).abs() / xd.abs().clamp_min(1.0))[fin]
    assert float(err.max()) <= 3e-7, float(err.max())
    assert float(y[-2]) == float("inf") and math.isnan(float(y[-1]))


@pytest.mark.gpu
def test_knob_settings_agree(rng: np.random.Generator) -> None:
    g = ln_gelu(DT.HALF, rows=100, cols=300)
    for rows, warps in ((1, 1), (2, 4), (8, 8), (16, 16)):
        _check(g, rng, 1e-2, EngineConfig("triton", (("rows_per_program", rows), ("num_warps", warps))))
    _check(g, rng, 1e-2, EngineConfig("triton", (("gelu_cdf", "poly"),)))
    even = ln_gelu(DT.FLOAT, rows=1024, cols=64, stats=True)  # tiles cover the data exactly: no masks at all
    assert "mask" not in kernel_source(even.validate(), analyze(even), 8)
    _check(even, rng, 1e-4, EngineConfig("triton", (("rows_per_program", 8),)))
    with pytest.raises(ValueError, match="rows_per_program"):
        ENGINE.build(g.validate(), GPU, EngineConfig("triton", (("rows_per_program", 3),)))


@pytest.mark.gpu
def test_torch_tensors_streams_outputs_and_errors(rng: np.random.Generator) -> None:
    import torch

    _needs_triton()
    g = ln_gelu(DT.HALF, rows=256, cols=512).validate()
    plan = ENGINE.build(g, GPU)
    pack = random_inputs(g, rng)
    dev = plan.stage(pack)
    ref = g.execute(pack, engine="reference")
    name = g.outputs()[0].name
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = plan.execute(dev)[name]
    side.synchronize()
    assert rel_error(out.float().cpu().numpy(), ref[name]) <= 1e-2
    given = torch.empty_like(out)
    assert plan.execute({**dev, name: given}) == {}
    torch.cuda.synchronize()
    assert rel_error(given.float().cpu().numpy(), ref[name]) <= 1e-2
    with pytest.raises(VariantPackError, match="strides"):
        plan.execute({**dev, "x": dev["x"].t().contiguous().t()})
    with pytest.raises(VariantPackError, match="missing"):
        plan.execute({"x": dev["x"]})
    with pytest.raises(VariantPackError, match="dtype"):
        plan.execute({**dev, "x": dev["x"].float()})
    assert "source" in plan.describe() and plan.source.is_file()
    # after aligned calls launched the compiled kernel directly: a pointer 2 bytes off 16
    base = torch.empty(dev["x"].numel() + 1, dtype=dev["x"].dtype, device=dev["x"].device)
    odd = base[1:].view(dev["x"].shape)
    odd.copy_(dev["x"])
    assert odd.data_ptr() % 16 != 0
    out_odd = plan.execute({**dev, "x": odd})[name]
    torch.cuda.synchronize()
    assert rel_error(out_odd.float().cpu().numpy(), ref[name]) <= 1e-2
    again = plan.execute(dev)[name]
    assert torch.equal(again, out)


@pytest.mark.gpu
def test_selection_picks_triton_for_softmax_and_norms() -> None:
    _needs_triton()
    assert softmax_graph(DT.HALF, (128, 1024)).build(GPU).engine == "triton"
    assert ln_gelu(DT.HALF).build(GPU).engine == "triton"
    g = _g("pool")  # not a row graph: goes on to the engines after triton
    g.softmax(g.tensor("x", [8, 40000]), -1).set_output(True)
    assert g.build(GPU).engine != "triton"


@pytest.mark.gpu
@pytest.mark.parametrize("outputs", ["given", "allocated"])
def test_cuda_graph_replays_read_each_calls_inputs(outputs: str, rng: np.random.Generator) -> None:
    """The same pointers call after call on the default stream (inputs rewritten in place,
    the output given -- NaN-filled before each call -- or allocated where the last one was
    freed): after a few calls the launch replays from a CUDA graph, and every call's result
    is that call's; with cuda_graph="off" nothing is captured."""
    import torch

    _needs_triton()
    g = ln_gelu(DT.HALF, rows=256, cols=512).validate()
    plan = ENGINE.build(g, GPU)
    name = g.outputs()[0].name
    dev = plan.stage(random_inputs(g, rng))
    given = torch.empty_like(plan.execute(dev)[name])
    assert torch.cuda.current_stream().cuda_stream == 0
    check_repeated_calls(plan, g, dev, given, outputs, rng)
    assert len(plan.replays.graphs) >= 1, "the repeated pointers were never captured"  # type: ignore[attr-defined]
    off = ENGINE.build(g, GPU, EngineConfig("triton", (("cuda_graph", "off"),)))
    for _ in range(5):
        off.execute({**dev, name: given})
    assert not off.replays.graphs  # type: ignore[attr-defined]
