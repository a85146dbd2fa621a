"""float32 matmuls as three bfloat16 tensor-core products (fusegraph/engines/torch/
split_products.py, the torch engine's ``fp32_matmul`` knob, the ONNX provider's
``fp32_matmul`` option; issue 24).

On the CPU: the split itself against float64 on fresh random data, through an emulated
bf16 GEMM (the bf16 halves multiplied in float32 / float64: their products are exact, as on
tensor cores) -- the stated elementwise bound holds for K in {64, 768, 3072}, and the low
halves matter (one bf16 product is far outside it); the shapes the torch lowering hands it;
the knob offered only on a GPU handle for graphs with a float32 matmul, and a typed error
where it is pinned on the CPU; the provider option's parsing; verdict keys apart between
``auto`` and ``ieee``. GPU-marked: the knob's plans (eager and compiled) against the float64
reference, and an ONNX model on cuda:0 running with the split.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import fusegraph as fg
from fusegraph import DataType as DT
from fusegraph.engines.base import EngineConfig
from fusegraph.errors import UnsupportedError
from fusegraph.onnx.options import ProviderOptions

torch = pytest.importorskip("torch", reason="the split runs on PyTorch (fusegraph[torch])")

from fusegraph.engines import torch as torch_engine  # noqa: E402
from fusegraph.engines.torch import split_products  # noqa: E402

CPU = fg.Handle("cpu")
GPU = fg.Handle("cuda:0")  # a handle only: the CPU tests never run on it
ENGINE = torch_engine.TorchEngine()


def _f32_product(a3: Any, b3: Any) -> Any:
    """A bf16 GEMM with float32 accumulation, emulated: bf16 x bf16 products are exact in
    float32 (8-bit significands), summed in float32."""
    return torch.matmul(a3.float(), b3.float())


def _f64_product(a3: Any, b3: Any) -> Any:
    """The same with an exact sum: what is left is the split's own error."""
    return torch.matmul(a3.double(), b3.double()).float()


def _operands(rng: np.random.Generator, *shapes: tuple[int, ...]) -> list[Any]:
    return [torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in shapes]


def _rel(got: Any, ref: np.ndarray) -> float:
    g = np.asarray(got, np.float64)
    assert np.isfinite(g).all(), "NaN/inf in output"
    return float(np.linalg.norm(g - ref) / max(float(np.linalg.norm(ref)), 1e-300))


# ---- the split against float64 ------------------------------------------------------------------
@pytest.mark.parametrize("k", [64, 768, 3072])
def test_the_split_stays_within_its_stated_bound(k: int, rng: np.random.Generator) -> None:
    a, b = _operands(rng, (48, k), (k, 40))
    a64, b64 = a.double().numpy(), b.double().numpy()
    ref = a64 @ b64
    scale = np.abs(a64) @ np.abs(b64)  # |A| |B|
    rel = []
    for mm, bound in ((_f32_product, split_products.bound(k)), (_f64_product, split_products.bound(0) + 2.0**-24)):
        for functional in (False, True):
            got = split_products.split_matmul(a, b, mm, functional=functional)
            assert got.dtype == torch.float32 and got.shape == (48, 40)
            err = np.abs(got.double().numpy() - ref)
            worst = float((err / scale).max())
            assert worst <= bound, f"K={k}: |C - AB| reached {worst:.2e} |A||B| > {bound:.2e}"
            rel.append(_rel(got, ref))
    # on random data far inside the worst case (~4.5e-6 here, as on the H200), far inside
    # the float32 tolerance issue 24 states (1e-3) and TF32's 2.5e-4
    assert max(rel) <= 1e-5, rel
    # the low halves matter: one bf16 product (hi @ hi) is ~500x further off
    one = _f32_product(a.to(torch.bfloat16), b.to(torch.bfloat16))
    assert _rel(one, ref) > 100 * max(rel), (_rel(one, ref), rel)


def test_eager_and_traced_forms_of_the_split_are_the_same_bits(rng: np.random.Generator) -> None:
    (x,) = _operands(rng, (6, 10))
    x[0, 0] = 3.0e-37  # tiny: its low half is in bf16's subnormals
    x[1, 1] = -1.0e30
    for dim, lo_at in ((-1, 2), (-2, 1), (0, 1)):
        eager = split_products.stacked(x, dim, lo_at)
        traced = split_products.stacked(x, dim, lo_at, functional=True)
        assert eager.dtype == torch.bfloat16 and torch.equal(eager, traced)
        hi, mid, lo = eager.float().split(x.shape[dim], dim=dim)
        low = lo if lo_at == 2 else mid
        assert torch.equal(hi, x.to(torch.bfloat16).float()) and torch.equal(hi, lo if lo_at == 1 else mid)
        rest = (x.double() - hi.double() - low.double()).abs()
        assert bool((rest <= 2.0**-16 * x.double().abs() + 2.0**-133).all())  # u**2 |x| (+ subnormal spacing)


@pytest.mark.parametrize(("a_shape", "b_shape", "batched"), [
    ((4, 5, 32), (32, 24), False),  # [.., M, K] @ [K, N]: one GEMM of the flattened rows
    ((3, 2, 5, 32), (1, 32, 24), False),  # one weight for every batch ([1, K, N])
    ((3, 5, 32), (3, 32, 24), True),  # a true batched matmul
    ((2, 1, 5, 32), (3, 32, 24), True),  # broadcast batch dims
    ((5, 32), (3, 32, 24), True),
])
def test_the_lowered_shapes(a_shape: tuple[int, ...], b_shape: tuple[int, ...], batched: bool,
                            rng: np.random.Generator) -> None:
    a, b = _operands(rng, a_shape, b_shape)
    ref = np.matmul(a.double().numpy(), b.double().numpy())
    calls: list[tuple[int, ...]] = []

    def mm(a3: Any, b3: Any) -> Any:
        assert a3.dtype == b3.dtype == torch.bfloat16 and a3.shape[-1] == 3 * a_shape[-1]
        calls.append(tuple(a3.shape))
        return _f32_product(a3, b3)

    assert split_products.batched(a_shape, b_shape) == batched
    for functional in (False, True):
        got = split_products.lowered(a, b, functional=functional, bmm=True, mm=mm)
        assert got is not None and tuple(got.shape) == ref.shape and got.dtype == torch.float32
        assert _rel(got, ref) <= 1e-5
    assert all(len(c) == (3 if batched else 2) for c in calls), calls  # bmm over one flat batch, or one mm
    stays = split_products.lowered(a, b, functional=False, bmm=False, mm=mm)
    assert (stays is None) == batched  # without the bmm kernel a batched matmul stays float32


# ---- the knob --------------------------------------------------------------------------------------
def _gemm_gelu(dt: DT = DT.FLOAT, shape: tuple[int, int, int] = (2, 5, 16), n: int = 24) -> fg.Graph:
    g = fg.Graph("gemm_bias_gelu", io_data_type=dt, compute_data_type=DT.FLOAT)
    x = g.tensor("x", list(shape))
    w = g.tensor("w", [shape[-1], n])
    bias = g.tensor("bias", [1, 1, n])
    g.gelu(g.bias(g.matmul(x, w), bias)).set_output(True)
    return g.validate()


def _conv_only() -> fg.Graph:
    g = fg.Graph("conv", io_data_type=DT.FLOAT)
    g.conv_fprop(g.tensor("x", [1, 4, 8, 8]), g.tensor("w", [4, 4, 3, 3]), padding=[1, 1]).set_output(True)
    return g.validate()


def _knob_names(graph: fg.Graph, handle: fg.Handle) -> set[str]:
    return {k.name for k in ENGINE.knobs(graph, handle)}


def test_the_knob_is_offered_on_a_gpu_for_float32_matmuls_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(split_products, "kernel_available", lambda device, op: True)  # as on a CUDA torch >= 2.8
    assert "fp32_matmul" in _knob_names(_gemm_gelu(), GPU)
    (knob,) = [k for k in ENGINE.knobs(_gemm_gelu(), GPU) if k.name == "fp32_matmul"]
    assert knob.default == "ieee" and knob.choices == ("ieee", "bf16x3") and knob.numerics  # tuning never flips it
    assert "fp32_matmul" not in _knob_names(_gemm_gelu(DT.HALF), GPU)  # f16 operands: tensor cores already
    assert "fp32_matmul" not in _knob_names(_conv_only(), GPU)
    assert "fp32_matmul" not in _knob_names(_gemm_gelu(), CPU)
    monkeypatch.setattr(split_products, "kernel_available", lambda device, op: False)  # an older torch
    assert "fp32_matmul" not in _knob_names(_gemm_gelu(), GPU)


def test_the_knob_pinned_on_the_cpu_is_a_typed_error_naming_it() -> None:
    with pytest.raises(UnsupportedError, match=r"fp32_matmul='bf16x3' is not offered here: .*CUDA kernels only"):
        ENGINE.build(_gemm_gelu(), CPU, EngineConfig("torch", (("fp32_matmul", "bf16x3"),)))
    with pytest.raises(UnsupportedError, match=r"fp32_matmul.*no float32 x float32 matmul"):
        ENGINE.build(_conv_only(), GPU, EngineConfig("torch", (("fp32_matmul", "bf16x3"),)))


@pytest.mark.parametrize("compiled", [False, True])
def test_the_torch_lowering_runs_the_split(compiled: bool, monkeypatch: pytest.MonkeyPatch,
                                           rng: np.random.Generator) -> None:
    """The CPU stand-in for the GPU path: a plan whose context says fp32_matmul=bf16x3 (forced:
    the knob is CUDA-only) with the emulated product in place of cuBLAS's -- eagerly and traced
    by Inductor -- agrees with the float64 reference and differs from the float32 plan."""
    from engine_fakes import rel_error

    from fusegraph.engines.torch import context
    from fusegraph.select.autotune import random_inputs

    real_init = context._Ctx.__init__

    def init(self: Any, graph: fg.Graph, handle: fg.Handle, config: EngineConfig) -> None:
        real_init(self, graph, handle, config)
        self.split_fp32 = self.split_batched = True

    calls: list[tuple[int, ...]] = []

    def product(a3: Any, b3: Any) -> Any:
        calls.append(tuple(a3.shape))
        return _f32_product(a3, b3)

    engine = torch_engine.TorchEngine()  # its own: an engine caches compile_support for the first device asked
    g = _gemm_gelu(DT.FLOAT, (2, 6, 64), 40)
    offered = {k.name for k in engine.knobs(g, CPU)}
    knobs = (("compile", True),) if compiled else (("onednn", False),) if "onednn" in offered else ()
    if compiled and "compile" not in offered:
        pytest.skip(f"Inductor cannot run here: {engine.compile_support(CPU).reason}")
    pack = random_inputs(g, rng)
    ref = g.execute(pack, engine="reference")
    out = g.outputs()[0].name
    ieee = engine.build(g, CPU, EngineConfig("torch", knobs)).execute(pack)[out]
    monkeypatch.setattr(context._Ctx, "__init__", init)
    monkeypatch.setattr(split_products, "cuda_product", product)
    got = engine.build(g, CPU, EngineConfig("torch", knobs)).execute(pack)[out]
    assert calls and all(c == (12, 3 * 64) for c in calls), calls  # [b*s, 3K]: one 2-D product
    assert rel_error(got, ref[out]) <= 5e-5, rel_error(got, ref[out])
    assert not np.array_equal(np.asarray(got), np.asarray(ieee)), "the float32 plan's bits: the split did not run"


# ---- the provider option ---------------------------------------------------------------------------
def test_the_provider_option_parses_auto_and_ieee_and_refuses_the_rest() -> None:
    assert ProviderOptions.parse({}).fp32_matmul == "auto"
    for raw, want in (("ieee", "ieee"), ("IEEE ", "ieee"), ("auto", "auto"), ("", "auto")):
        assert ProviderOptions.parse({"fp32_matmul": raw}).fp32_matmul == want
    assert ProviderOptions.parse({"fp32_matmul": "ieee"}).as_strings()["fp32_matmul"] == "ieee"
    for bad in ("bf16x3", "tf32", "1"):
        with pytest.raises(ValueError, match=r"option fp32_matmul=.*expected one of \['auto', 'ieee'\]"):
            ProviderOptions.parse({"fp32_matmul": bad})


def test_verdict_keys_differ_between_auto_and_ieee() -> None:
    from fusegraph.onnx import region_choice
    from fusegraph.regions.choose import Chooser
    from fusegraph.regions.incumbent import TorchOpByOp
    from fusegraph.regions.split import split

    auto, ieee = ProviderOptions.parse({}), ProviderOptions.parse({"fp32_matmul": "ieee"})
    tf32 = ProviderOptions.parse({"fp32_matmul": "auto", "precision": "tf32"})
    assert region_choice.split_wanted(auto, GPU) and not region_choice.split_wanted(ieee, GPU)
    assert not region_choice.split_wanted(auto, CPU)  # no split on the CPU: its keys are as before
    assert not region_choice.split_wanted(tf32, GPU)  # tf32 keeps TF32, never both
    opts = {name: region_choice.build_options(o, GPU) for name, o in (("auto", auto), ("ieee", ieee), ("tf32", tf32))}
    assert opts == {"auto": {"fp32_matmul": "bf16x3"}, "ieee": {}, "tf32": {"precision": "tf32"}}
    assert region_choice.build_options(auto, CPU) == region_choice.build_options(ieee, CPU) == {}
    region = split(_gemm_gelu()).regions[0]
    keys = {name: Chooser(GPU, TorchOpByOp(GPU), build_options=o).key(region) for name, o in opts.items()}
    assert len(set(keys.values())) == 3, keys


# ---- GPU -------------------------------------------------------------------------------------------
def _vit_mlp() -> fg.Graph:
    return _gemm_gelu(DT.FLOAT, (8, 197, 768), 3072)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_on_cuda_the_split_agrees_with_float64_and_differs_from_ieee(compiled: bool, rng: np.random.Generator) -> None:
    from engine_fakes import rel_error

    from fusegraph.select.autotune import random_inputs

    g = _vit_mlp()
    assert "fp32_matmul" in _knob_names(g, GPU), "torch.mm(bf16, bf16, out_dtype=float32) is missing on cuda:0"
    pack = random_inputs(g, rng)
    ref = g.execute(pack, engine="reference")
    out = g.outputs()[0].name
    base = (("compile", compiled), ("cuda_graph", False))
    split = ENGINE.build(g, GPU, EngineConfig("torch", (*base, ("fp32_matmul", "bf16x3"))))
    assert "fp32_matmul=bf16x3" in split.describe()["config"]
    got = split.execute(pack)[out]
    ieee = ENGINE.build(g, GPU, EngineConfig("torch", base)).execute(pack)[out]
    err = rel_error(got, ref[out])
    assert err <= 5e-5, f"bf16x3 relative error {err:.2e} (ieee: {rel_error(ieee, ref[out]):.2e})"
    assert not np.array_equal(np.asarray(got), np.asarray(ieee)), "the same bits as float32: the split did not run"


@pytest.mark.gpu
@pytest.mark.usefixtures("own_cache")
def test_on_cuda_an_onnx_model_runs_with_the_split(rng: np.random.Generator) -> None:
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    import fusegraph.onnx as fgo

    def const(name: str, shape: tuple[int, ...], scale: float) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    def scalar(name: str, v: float) -> onnx.TensorProto:
        return numpy_helper.from_array(np.array(v, np.float32), name)

    inits = [const("w", (256, 512), 256**-0.5), const("b", (512,), 0.1), scalar("sqrt2", float(np.sqrt(2))),
             scalar("one", 1.0), scalar("half", 0.5)]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="fc"),
             helper.make_node("Add", ["m", "b"], ["h"], name="bias"),
             helper.make_node("Div", ["h", "sqrt2"], ["hd"], name="gelu_div"),
             helper.make_node("Erf", ["hd"], ["he"], name="gelu_erf"),
             helper.make_node("Add", ["he", "one"], ["ha"], name="gelu_add"),
             helper.make_node("Mul", ["h", "ha"], ["hm"], name="gelu_mul"),
             helper.make_node("Mul", ["hm", "half"], ["y"], name="gelu_half")]
    graph = helper.make_graph(nodes, "mm_gelu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 64, 512])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    data = model.SerializeToString()
    opts = {"device": "cuda:0", "engine": "torch", "floor": "off", "floor_mode": "inline", "runners": "off"}
    sess = fgo.InferenceSession(data, providers=["FusegraphExecutionProvider", "CPUExecutionProvider"],
                                provider_options=[opts, {}])
    ref = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    x = rng.standard_normal((4, 64, 256)).astype(np.float32)
    got, want = sess.run(None, {"x": x})[0], ref.run(None, {"x": x})[0]
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and np.isfinite(got).all()
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert err <= 1e-4, f"relative error {err:.2e} against ONNX Runtime (max abs {np.abs(got - want).max():.2e})"
    report = sess.partition_report()
    rows = [r for s in report.subgraphs if s.kind == "fusegraph" for r in s.regions]
    assert any("fp32_matmul=bf16x3" in r.where for r in rows), str(report)
    ieee = fgo.InferenceSession(data, providers=["FusegraphExecutionProvider", "CPUExecutionProvider"],
                                provider_options=[{**opts, "fp32_matmul": "ieee"}, {}])
    assert not any("bf16x3" in r.where for s in ieee.partition_report().subgraphs for r in s.regions)
