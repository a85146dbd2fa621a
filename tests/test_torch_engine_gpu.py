"""The torch engine and selection on an NVIDIA GPU (run on the GPU machine: pytest -m gpu).

cuDNN/cuBLAS/flash attention against the float64 reference, f16 I/O with f32 compute,
NHWC, device-resident tensors and Buffers, the GPU knobs, and the selection rules:
vendor engine first for compute-bound graphs, never the reference on a GPU handle.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_fakes import conv_graph, in_threads, layernorm_graph, rel_error

import fusegraph as fg
from fusegraph import DataType as DT
from fusegraph import HeurMode
from fusegraph.engines.base import EngineConfig
from fusegraph.engines.registry import REGISTRY
from fusegraph.errors import UnsupportedError
from fusegraph.select.autotune import random_inputs

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch", reason="the torch engine needs PyTorch")

from fusegraph.engines import torch as torch_engine  # noqa: E402

GPU = fg.Handle("cuda:0")
ENGINE = torch_engine.TorchEngine()


def _check(g: fg.Graph, rng: np.random.Generator, tol: float, config: EngineConfig | None = None) -> None:
    g.validate()
    s = ENGINE.supports(g, GPU)
    assert s, s.reason
    pack = random_inputs(g, rng)
    got = ENGINE.build(g, GPU, config).execute(pack)
    ref = g.execute(pack, engine="reference")
    for t in g.outputs():
        assert got[t.name].strides == ref[t.name].strides
        assert rel_error(got[t.name], ref[t.name]) <= tol, t.name


def _conv_f16(layout: str) -> fg.Graph:
    g = fg.Graph("conv_f16", io_data_type=DT.HALF, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    x = g.tensor("x", [8, 32, 28, 28], fg.strides_for([8, 32, 28, 28], layout))
    w = g.tensor("w", [64, 32, 3, 3], fg.strides_for([64, 32, 3, 3], "KRSC" if layout == "NHWC" else "KCRS"))
    b = g.tensor("b", [1, 64, 1, 1])
    g.relu(g.bias(g.conv_fprop(x, w, padding=[1, 1]), b)).set_output(True)
    return g


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("knobs", [(), (("cudnn_benchmark", False),), (("memory_format", "channels_last"),)])
def test_conv_bias_relu_f16(layout: str, knobs: tuple[tuple[str, object], ...], rng: np.random.Generator) -> None:
    _check(_conv_f16(layout), rng, 1e-2, EngineConfig("torch", knobs))


def test_untimed_convolutions_take_cudnns_deterministic_pick_and_restore_the_flags(rng: np.random.Generator) -> None:
    """``cudnn_benchmark=False`` runs under ``cudnn.deterministic``: PyTorch caches a shape's
    first algorithm under a key holding that flag but not ``benchmark``, so an untimed pick
    must not become what a timing plan of the same shape runs. Both plans agree with the
    reference, and the caller's flags come back as they were."""
    g = _conv_f16("NCHW")
    seen: list[tuple[bool, bool]] = []
    functional = torch.nn.functional
    orig = functional.conv2d

    def spy(*a, **k):  # type: ignore[no-untyped-def]
        seen.append((torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic))
        return orig(*a, **k)

    before = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    functional.conv2d = spy
    try:
        _check(g, rng, 1e-2, EngineConfig("torch", (("cudnn_benchmark", False),)))
        _check(g, rng, 1e-2, EngineConfig("torch", ()))
    finally:
        functional.conv2d = orig
    assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic) == before
    assert seen and seen[0] == (False, True) and seen[-1] == (True, before[1]), seen


@pytest.mark.parametrize("groups", [32, 4])
def test_depthwise_convolutions_off_cudnn_agree_and_restore_the_flag(groups: int, rng: np.random.Generator) -> None:
    """``cudnn_depthwise=False``: a depthwise convolution runs with cuDNN off (PyTorch's own
    kernel), a grouped one that is not depthwise keeps cuDNN; both agree with the reference."""
    g = fg.Graph("dw", io_data_type=DT.FLOAT)
    x = g.tensor("x", [4, 32, 28, 28])
    w = g.tensor("w", [32, 32 // groups, 7, 7])
    g.conv_fprop(x, w, padding=[3, 3]).set_output(True)
    seen: list[bool] = []
    functional = torch.nn.functional
    orig = functional.conv2d

    def spy(*a, **k):  # type: ignore[no-untyped-def]
        seen.append(torch.backends.cudnn.enabled)
        return orig(*a, **k)

    functional.conv2d = spy
    try:
        _check(g, rng, 1e-5, EngineConfig("torch", (("cudnn_depthwise", False),)) if groups == 32
               else EngineConfig("torch", ()))
    finally:
        functional.conv2d = orig
    assert torch.backends.cudnn.enabled
    assert seen and all(s is (groups != 32) for s in seen), seen


@pytest.mark.parametrize("dt", [DT.FLOAT, DT.HALF, DT.BFLOAT16])
def test_matmul(dt: DT, rng: np.random.Generator) -> None:
    g = fg.Graph("mm", io_data_type=dt)
    g.matmul(g.tensor("a", [4, 256, 512]), g.tensor("b", [512, 384])).set_output(True)
    # f32 must really be f32 (TF32 is switched off while the plan runs)
    _check(g, rng, {DT.FLOAT: 1e-5, DT.HALF: 1e-2, DT.BFLOAT16: 2e-2}[dt])


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_f16(causal: bool, rng: np.random.Generator) -> None:
    g = fg.Graph("sdpa", io_data_type=DT.HALF)
    q = g.tensor("q", [2, 8, 128, 64])
    k = g.tensor("k", [2, 2, 128, 64])
    v = g.tensor("v", [2, 2, 128, 64])
    g.sdpa(q, k, v, causal=causal).set_output(True)
    _check(g, rng, 2e-2)


def test_layernorm_and_conv_wgrad(rng: np.random.Generator) -> None:
    _check(layernorm_graph(64, 256), rng, 1e-4)
    g = fg.Graph("wgrad", io_data_type=DT.FLOAT)
    x = g.tensor("x", [4, 8, 16, 16])
    dy = g.tensor("dy", [4, 16, 8, 8])
    g.conv_wgrad(x, dy, padding=[1, 1], stride=[2, 2]).set_dim([16, 8, 3, 3]).set_output(True)
    _check(g, rng, 1e-4)


def test_torch_compile_on_gpu(rng: np.random.Generator) -> None:
    if not ENGINE.compile_support(GPU):
        pytest.skip(f"torch.compile unavailable: {ENGINE.compile_support(GPU).reason}")
    g = fg.Graph("chain", io_data_type=DT.HALF, intermediate_data_type=DT.FLOAT)
    x = g.tensor("x", [1024, 1024])
    y = x
    for _ in range(4):
        y = g.tanh(g.relu(g.add(y, g.scalar(0.1))))
    y.set_output(True)
    _check(g, rng, 1e-2, EngineConfig("torch", (("compile", True),)))


def test_device_tensors_stay_on_the_device(rng: np.random.Generator) -> None:
    g = conv_graph(n=2, c=16, hw=16, k=16)
    pack = random_inputs(g, rng)
    plan = ENGINE.build(g, GPU)
    staged = plan.stage(pack)
    assert all(t.device.type == "cuda" for t in staged.values())
    out = plan.execute(staged)["y"]
    assert isinstance(out, torch.Tensor) and out.device.type == "cuda"
    ref = g.execute(pack, engine="reference")["y"]
    assert rel_error(out.cpu().numpy(), ref) < 1e-5


def test_buffers_on_the_gpu(rng: np.random.Generator) -> None:
    iree = REGISTRY.get("iree")
    if not iree.supports(conv_graph(), GPU):
        pytest.skip(f"IREE has no CUDA device here: {iree.supports(conv_graph(), GPU).reason}")
    g = conv_graph(n=2, c=16, hw=16, k=16)
    pack = random_inputs(g, rng)
    bufs = {k: fg.Buffer.from_numpy(v, GPU, tensor=g.tensor_by_name(k)) for k, v in pack.items()}
    out = ENGINE.build(g, GPU).execute(bufs)["y"]
    assert isinstance(out, fg.Buffer) and out.device == "cuda:0"
    assert rel_error(out.to_numpy(), g.execute(pack, engine="reference")["y"]) < 1e-5


def test_selection_on_gpu_prefers_the_vendor_engine_for_compute(rng: np.random.Generator) -> None:
    g = _conv_f16("NHWC")
    g.create_execution_plans([HeurMode.A, HeurMode.FALLBACK], GPU)
    # the vendor graph engine (cuDNN's, docs/gpu.md) where installed, else PyTorch's cuDNN calls
    vendor = "cudnn" if REGISTRY.get("cudnn").available() else "torch"
    assert g._selection.candidates[0].config.engine == vendor
    assert all(c.config.engine != "reference" for c in g._selection.candidates)
    plan = g.build(GPU)
    assert plan.engine == vendor


def test_reference_is_refused_on_the_gpu() -> None:
    with pytest.raises(UnsupportedError, match="host only"):
        conv_graph().build(GPU, engine="reference")


def test_autotune_on_gpu_matches_the_reference(tmp_path, monkeypatch, rng: np.random.Generator) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    g = _conv_f16("NHWC")
    res = g.autotune(handle=GPU, budget_s=60, modes=[HeurMode.A], progress=False)
    assert res.best.engine != "reference"
    pack = random_inputs(g, rng)
    name = g.outputs()[0].name
    assert rel_error(g.execute(pack, handle=GPU)[name], g.execute(pack, engine="reference")[name]) < 1e-2


def test_cuda_graph_replays_with_fresh_inputs_and_bound_weights(rng: np.random.Generator) -> None:
    """The plan is captured once and replayed: each call's inputs land in the static buffers,
    bound weights stay where they are, and a call passing another weight runs eagerly."""
    g = conv_graph(n=2, c=8, hw=10, k=16)
    plan = ENGINE.build(g, GPU)
    pack = random_inputs(g, rng)
    plan.bind_constants({"w": pack["w"], "b": pack["b"]})
    for _ in range(3):
        pack = {**pack, "x": rng.standard_normal(pack["x"].shape).astype(np.float32)}
        pack["x"] = np.ascontiguousarray(pack["x"].transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)  # NHWC strides
        got = plan.execute(pack)["y"]
        assert rel_error(got, g.execute(pack, engine="reference")["y"]) < 1e-5
    assert plan.describe()["cuda_graph"] is True
    w2 = np.empty_like(pack["w"])
    w2[...] = -pack["w"]
    other = {**pack, "w": w2}
    assert rel_error(plan.execute(other)["y"], g.execute(other, engine="reference")["y"]) < 1e-5
    again = plan.execute(pack)["y"]  # the bound weights were not overwritten
    assert rel_error(again, g.execute(pack, engine="reference")["y"]) < 1e-5
    dev = {**pack, "x": torch.from_numpy(pack["x"]).cuda()}  # a device tensor in: a tensor out, not the static buffer
    first = plan.execute(dev)["y"]
    second = plan.execute({**dev, "x": dev["x"] * 2})["y"]
    assert isinstance(first, torch.Tensor) and first.data_ptr() != second.data_ptr()
    assert rel_error(first.cpu().numpy(), g.execute(pack, engine="reference")["y"]) < 1e-5


def test_cuda_graph_knob_off_runs_eagerly(rng: np.random.Generator) -> None:
    g = conv_graph()
    plan = ENGINE.build(g, GPU, EngineConfig("torch", (("cuda_graph", False),)))
    pack = random_inputs(g, rng)
    assert rel_error(plan.execute(pack)["y"], g.execute(pack, engine="reference")["y"]) < 1e-5
    assert plan.describe()["cuda_graph"] is False


@pytest.mark.parametrize("config", [EngineConfig("torch", (("cuda_graph", False),)), EngineConfig("torch", (("cuda_graph", True),))])
def test_given_outputs_are_written_in_place(config: EngineConfig, rng: np.random.Generator) -> None:
    """Device tensors in and every output given (the cuDNN frontend's way of calling): the
    results are written into the given tensors -- contiguous or not -- and nothing is
    returned; a given output of the wrong dtype or device is refused, naming it."""
    g = fg.Graph("given_out", io_data_type=DT.HALF, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    x, z = g.tensor("x", [64, 64]), g.tensor("z", [64, 64])
    g.relu(g.tanh(g.add(x, z))).set_output(True).set_name("y")
    g.validate()
    plan = ENGINE.build(g, GPU, config)
    pack = random_inputs(g, rng)
    ref = g.execute(pack, engine="reference")["y"]
    dev = plan.stage(pack)
    plan.execute(dev)  # a CUDA graph is captured by the first call
    for given in (torch.empty(64, 64, dtype=torch.float16, device="cuda"),
                  torch.empty(64, 64, dtype=torch.float16, device="cuda").t()):  # transposed strides
        given.fill_(float("nan"))
        assert plan.execute({**dev, "y": given}) == {}
        torch.cuda.synchronize()
        assert rel_error(given.float().cpu().numpy(), ref) <= 1e-2
    with pytest.raises(fg.errors.VariantPackError, match="tensor 'y'"):
        plan.execute({**dev, "y": torch.empty(64, 64, dtype=torch.float32, device="cuda")})
    with pytest.raises(fg.errors.VariantPackError, match="tensor 'y'"):
        plan.execute({**dev, "y": torch.empty(64, 64, dtype=torch.float16)})  # a host output


def test_cuda_graph_plan_from_threads_and_streams(rng: np.random.Generator) -> None:
    """One captured plan executed from six threads at once -- three on the default stream,
    three on streams of their own (those run eagerly: the captured buffers live on the
    capturing call's stream) -- each with its own device inputs, every result against the
    float64 reference (the captured buffers serve one call at a time)."""

    g = conv_graph(n=2, c=8, hw=10, k=16)
    plan = ENGINE.build(g, GPU, EngineConfig("torch", (("cuda_graph", True),)))
    packs = [random_inputs(g, np.random.default_rng(200 + i)) for i in range(6)]
    refs = [g.execute(p, engine="reference")["y"] for p in packs]
    devs = [plan.stage(p) for p in packs]  # device tensors in the declared layouts
    plan.execute(devs[0])  # captured on the default stream
    torch.cuda.synchronize()
    assert plan.describe()["cuda_graph"] is True
    errors: list[str] = []

    def work(i: int) -> None:
        stream = torch.cuda.current_stream() if i < 3 else torch.cuda.Stream()
        with torch.cuda.stream(stream):
            outs = [plan.execute(devs[i])["y"] for _ in range(10)]
        stream.synchronize()
        for o in outs:
            err = rel_error(o.cpu().numpy(), refs[i])
            if not err < 1e-5:
                errors.append(f"thread {i}: rel err {err}")

    in_threads(6, work)
    assert not errors, errors
