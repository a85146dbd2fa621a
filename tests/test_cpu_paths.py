"""The torch engine's compiled CPU path (engines/torch/frozen.py, issue 14): the chain of
candidates a CPU plan tries once its weights are bound (AOTInductor with its package cached,
Inductor, the oneDNN Graph bridge only on request), their numerics against the float64
reference, refusals handed to the next candidate and reported, and the thread choice.

Two tests compile for real (Inductor: seconds; AOTInductor: tens of seconds with a cold
Inductor cache on 2 shared cores); the chain's logic is tested with stand-in compilers.
No test asserts a time.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import fusegraph as fg
from fusegraph import DataType as DT
from fusegraph.engines.base import EngineConfig
from fusegraph.reference.inputs import random_inputs

torch = pytest.importorskip("torch", reason="the torch engine needs PyTorch (pip install 'fusegraph[torch]')")

from fusegraph.engines import torch as torch_engine  # noqa: E402
from fusegraph.engines.torch import frozen  # noqa: E402

CPU = fg.Handle("cpu")
ENGINE = torch_engine.TorchEngine()
WEIGHTS = ("w1", "b1", "w2", "b2", "wf", "bf")
TOL = 1e-4  # f32 kernels (oneDNN, Inductor's fused loops) against float64, a few layers deep
needs_compiler = pytest.mark.skipif(bool(frozen.can_compile()), reason=frozen.can_compile() or "-")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test its own cache directory (packages really compiled or loaded), and the
    compiled path opted into (its default is off; the suite's conftest says so too)."""
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(frozen.ENV, "auto")
    return tmp_path / "cache"


def _net() -> fg.Graph:
    """conv + bias + ReLU, a residual block, max pooling, a flatten, GEMM + bias."""
    g = fg.Graph("net", io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT)
    x = g.tensor("x", [1, 4, 12, 12], fg.strides_for([1, 4, 12, 12], "NHWC"))
    w1 = g.tensor("w1", [8, 4, 3, 3], fg.strides_for([8, 4, 3, 3], "KRSC"))
    b1 = g.tensor("b1", [1, 8, 1, 1])
    w2 = g.tensor("w2", [8, 8, 3, 3], fg.strides_for([8, 8, 3, 3], "KRSC"))
    b2 = g.tensor("b2", [1, 8, 1, 1])
    h = g.relu(g.bias(g.conv_fprop(x, w1, padding=[1, 1]), b1))
    h = g.relu(g.add(g.bias(g.conv_fprop(h, w2, padding=[1, 1]), b2), h))
    p = g.pooling(h, fg.PoolingMode.MAX, window=(2, 2), stride=(2, 2), pre_padding=(0, 0), post_padding=(0, 0))
    flat = g.reshape(p, [1, 8 * 6 * 6])
    wf = g.tensor("wf", [8 * 6 * 6, 10], (1, 8 * 6 * 6))
    bf = g.tensor("bf", [10])
    # No ReLU on the 10 outputs: all ten clamped to zero (it happened) leaves nothing to compare.
    g.add(g.matmul(flat, wf), bf).set_output(True).set_name("y")
    return g.validate()


def _err(got: np.ndarray, want: np.ndarray) -> float:
    assert not np.isnan(got).any()
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


def _plan(g: fg.Graph, rng: np.random.Generator, **knobs: Any) -> tuple[Any, dict[str, np.ndarray]]:
    plan = ENGINE.build(g, CPU, EngineConfig("torch", tuple(knobs.items())) if knobs else None)
    pack = random_inputs(g, rng)
    assert plan.bind_constants({k: pack[k] for k in WEIGHTS}) is True
    return plan, pack


def _check_runs(plan: Any, g: fg.Graph, pack: dict[str, np.ndarray], rng: np.random.Generator, calls: int = 3) -> None:
    """Fresh activations each call, against the float64 reference with the bound weights."""
    for _ in range(calls):
        x = random_inputs(g, rng)["x"]
        want = g.execute({**pack, "x": x}, engine="reference")["y"]
        assert _err(plan.execute({"x": x})["y"], want) < TOL


# ---- stand-in compilers: the chain's logic without compile time -------------------------------
def _eager_module(module: Any, example: Sequence[Any], *rest: Any) -> Any:
    """A 'compiled' function that is the graph module itself (right results, no compile)."""
    return lambda *xs: list(module(*xs))


def _wrong_module(module: Any, example: Sequence[Any], *rest: Any) -> Any:
    return lambda *xs: [2 * y + 1 for y in module(*xs)]


def _refuses(what: str) -> Any:
    def refuse(*a: Any, **k: Any) -> Any:
        raise RuntimeError(what)

    return refuse


# ---- the chain and the knob --------------------------------------------------------------------
def test_chain_order_and_knob_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert frozen.chain("auto", False) == ("aoti", "inductor")
    assert frozen.chain("auto", True) == ("onednn_graph", "aoti", "inductor")
    assert frozen.chain("inductor", False) == ("inductor",)
    assert frozen.chain("off", False) == ()
    assert frozen.chain("off", True) == ("onednn_graph",)
    assert frozen.knob_default() == "auto"  # the fixture opts in
    monkeypatch.setenv(frozen.ENV, "OFF")
    assert frozen.knob_default() == "off"
    monkeypatch.delenv(frozen.ENV)
    assert frozen.knob_default() == "off"  # the default: no compile at session creation
    monkeypatch.setenv(frozen.ENV, "bogus")
    assert frozen.knob_default() == "off"  # an unknown value is the default, not an error at every build


def test_knobs_and_what_is_worth_compiling() -> None:
    g = _net()
    knobs = {k.name: k for k in ENGINE.knobs(g, CPU)}
    if not frozen.can_compile():
        assert knobs["cpu_compile"].default in frozen.CHOICES and set(knobs["cpu_compile"].choices) == set(frozen.CHOICES)
    if "onednn_graph" in knobs:
        assert knobs["onednn_graph"].default is False  # opt-in since issue 14
    assert frozen.worth_compiling(g)
    tiny = fg.Graph("tiny", io_data_type=DT.FLOAT)
    tiny.relu(tiny.tensor("a", [4, 4])).set_output(True)
    assert not frozen.worth_compiling(tiny.validate())


def test_package_key_follows_the_weights_and_layouts(rng: np.random.Generator) -> None:
    g = _net()
    pack = random_inputs(g, rng)
    w = {k: torch.from_numpy(np.ascontiguousarray(pack[k])) for k in WEIGHTS}
    acts = [t for t in g.inputs() if t.name == "x"]
    key = frozen.package_key(g, w, acts)
    assert key == frozen.package_key(g, dict(w), acts)
    other = {**w, "bf": w["bf"] + 1}
    assert frozen.package_key(g, other, acts) != key  # weights are folded into the package
    assert frozen.package_key(g, w, acts, "channels_last") != key


# ---- the chain on a plan -------------------------------------------------------------------------
def test_a_refused_candidate_hands_over_to_the_next(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(frozen, "can_compile", lambda: "")
    monkeypatch.setattr(frozen, "compile_aoti", _refuses("export refused the graph"))
    monkeypatch.setattr(frozen, "compile_inductor", _eager_module)
    g = _net()
    plan, pack = _plan(g, rng)
    with caplog.at_level(logging.WARNING, logger="fusegraph.engines.torch"):
        _check_runs(plan, g, pack, rng)
    d = plan.describe()
    assert d["cpu_path"] == "inductor" and d["onednn_graph"] is False
    assert d["cpu_path_attempts"][0] == "aoti refused (RuntimeError: export refused the graph)"
    assert "CPU path inductor" in caplog.text and "export refused the graph" in caplog.text


def test_a_wrong_result_is_refused(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frozen, "can_compile", lambda: "")
    monkeypatch.setattr(frozen, "compile_aoti", lambda m, e, k: _wrong_module(m, e))
    monkeypatch.setattr(frozen, "compile_inductor", _eager_module)
    g = _net()
    plan, pack = _plan(g, rng)
    _check_runs(plan, g, pack, rng)
    attempts = plan.describe()["cpu_path_attempts"]
    assert plan.describe()["cpu_path"] == "inductor"
    assert attempts[0].startswith("aoti refused (output 0: relative error")


def test_all_refusing_runs_eagerly_and_says_why(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(frozen, "can_compile", lambda: "")
    monkeypatch.setattr(frozen, "compile_aoti", _refuses("no export"))
    monkeypatch.setattr(frozen, "compile_inductor", _refuses("no inductor"))
    g = _net()
    plan, pack = _plan(g, rng)
    with caplog.at_level(logging.WARNING, logger="fusegraph.engines.torch"):
        _check_runs(plan, g, pack, rng)
    assert plan.describe()["cpu_path"] == "eager"
    assert "every CPU path refused, running eagerly" in caplog.text
    assert "no export" in caplog.text and "no inductor" in caplog.text


def test_off_and_small_graphs_run_eagerly_without_trying(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frozen, "can_compile", lambda: "")
    monkeypatch.setattr(frozen, "compile_aoti", _refuses("must not be tried"))
    monkeypatch.setattr(frozen, "compile_inductor", _refuses("must not be tried"))
    monkeypatch.setenv(frozen.ENV, "off")
    g = _net()
    plan, pack = _plan(g, rng)
    _check_runs(plan, g, pack, rng, calls=1)
    assert plan.describe()["cpu_path"] == "eager" and plan.describe()["cpu_path_attempts"] == []
    monkeypatch.setenv(frozen.ENV, "auto")
    tiny = fg.Graph("tiny", io_data_type=DT.FLOAT)
    a, b = tiny.tensor("a", [4, 4]), tiny.tensor("b", [4, 4])
    tiny.relu(tiny.add(a, b)).set_output(True).set_name("y")
    tiny.validate()
    small = ENGINE.build(tiny, CPU)
    feed = random_inputs(tiny, rng)
    small.bind_constants({"b": feed["b"]})
    want = tiny.execute(feed, engine="reference")["y"]
    assert _err(small.execute({"a": feed["a"]})["y"], want) < 1e-6
    assert small.describe()["cpu_path"] == "eager" and small.describe()["cpu_path_attempts"] == []


def test_the_default_path_uses_no_torchscript(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.jit.trace is deprecated (PyTorch 2.13): the default chain never calls it."""
    monkeypatch.setattr(frozen, "can_compile", lambda: "")
    monkeypatch.setattr(frozen, "compile_aoti", lambda m, e, k: _eager_module(m, e))
    monkeypatch.setattr(torch.jit, "trace", _refuses("torch.jit.trace called"))
    monkeypatch.setattr(torch.jit, "freeze", _refuses("torch.jit.freeze called"))
    g = _net()
    plan, pack = _plan(g, rng)
    _check_runs(plan, g, pack, rng)
    assert plan.describe()["cpu_path"] == "aoti"


def _onnx_model(rng: np.random.Generator) -> bytes:
    """Conv + ReLU, conv + residual add + ReLU, global pooling, Gemm: one claimed subgraph."""
    def init(name: str, *shape: int) -> onnx.TensorProto:
        return helper.make_tensor(name, TensorProto.FLOAT, shape, (rng.standard_normal(shape) * 0.3).ravel().tolist())

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "r1"], ["a2"]),
        helper.make_node("Relu", ["a2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes, "cpu_path", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 12, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
        [init("w1", 8, 4, 3, 3), init("b1", 8), init("w2", 8, 8, 3, 3), init("b2", 8), init("wf", 10, 8), init("bf", 10)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def test_the_partition_report_names_the_cpu_path(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxruntime as ort

    import fusegraph.onnx as fgo

    monkeypatch.setattr(frozen, "can_compile", lambda: "")
    monkeypatch.setattr(frozen, "compile_aoti", _refuses("export refused the graph"))
    monkeypatch.setattr(frozen, "compile_inductor", _eager_module)
    model = _onnx_model(rng)
    sess = fgo.InferenceSession(model, providers=[(fgo.PROVIDER, {"engine": "torch", "floor": "off"})])
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    for _ in range(2):
        feed = {"x": rng.standard_normal((1, 4, 12, 12)).astype(np.float32)}
        assert _err(sess.run(None, feed)[0], ref.run(None, feed)[0].astype(np.float64)) < TOL
    (unit,) = [s for s in sess.partition_report().subgraphs if s.kind == "fusegraph"]
    assert "CPU path: inductor (aoti refused (RuntimeError: export refused the graph)" in unit.note, unit.note


# ---- real compiles -------------------------------------------------------------------------------
@needs_compiler
def test_inductor_path_matches_the_reference(rng: np.random.Generator) -> None:
    g = _net()
    plan, pack = _plan(g, rng, cpu_compile="inductor")
    _check_runs(plan, g, pack, rng)
    d = plan.describe()
    assert d["cpu_path"] == "inductor", d["cpu_path_attempts"]


@needs_compiler
def test_aoti_package_is_compiled_once_then_loaded(rng: np.random.Generator, _own_cache: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.jit, "trace", _refuses("torch.jit.trace called"))
    g = _net()
    plan, pack = _plan(g, rng)
    _check_runs(plan, g, pack, rng)
    assert plan.describe()["cpu_path"] == "aoti", plan.describe()["cpu_path_attempts"]
    assert plan.describe()["cpu_path_attempts"][0].startswith("aoti compiled")
    assert len(list((_own_cache / frozen.PACKAGES).glob("*.pt2"))) == 1
    again = ENGINE.build(g, CPU)
    again.bind_constants({k: pack[k] for k in WEIGHTS})
    _check_runs(again, g, pack, rng)
    assert again.describe()["cpu_path_attempts"][0].startswith("aoti loaded from the cache")


# ---- threads ------------------------------------------------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.parametrize("faster", ["one", "all"])
def test_adaptive_threads_settle_on_the_faster_setting(faster: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in function whose time depends on the thread count, a stand-in clock."""
    many = 4
    clock = _Clock()
    current = [many]
    seen: list[int] = []
    monkeypatch.setattr(frozen, "time", clock)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: current.__setitem__(0, n))
    monkeypatch.setattr(torch, "get_num_threads", lambda: current[0])

    def fn(*xs: Any) -> list[Any]:
        seen.append(current[0])
        clock.now += 1.0 if (current[0] == 1) == (faster == "one") else 3.0
        return []

    adaptive = frozen.AdaptiveThreads(fn, many)
    for _ in range(400):
        adaptive()
        assert current[0] == many  # restored after every call
    want = 1 if faster == "one" else many
    assert adaptive.threads == want
    assert sum(n != want for n in seen[-200:]) <= 2 * adaptive.PROBE  # once settled, the other is rarely probed


@pytest.mark.parametrize("faster", ["one", "all"])
def test_adaptive_threads_start_on_the_setting_timed_faster(faster: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """warm() times each setting once (after an untimed first call) and starts on the faster;
    a probe twice as slow as the current setting ends its probing at once."""
    many = 2
    clock = _Clock()
    current = [many]
    seen: list[int] = []
    monkeypatch.setattr(frozen, "time", clock)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: current.__setitem__(0, n))
    monkeypatch.setattr(torch, "get_num_threads", lambda: current[0])

    def fn(*xs: Any) -> list[Any]:
        seen.append(current[0])
        clock.now += 1.0 if (current[0] == 1) == (faster == "one") else 50.0
        return []

    adaptive = frozen.AdaptiveThreads(fn, many)
    adaptive.warm()
    want = 1 if faster == "one" else many
    assert adaptive.threads == want and current[0] == many
    seen.clear()
    for _ in range(300):
        adaptive()
    assert sum(n != want for n in seen) == 1  # one probe, 49 units slower: the next waits ~4900 calls


def test_adaptive_threads_look_again_when_several_threads_turn_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settled on all cores with probes far apart, a neighbour takes a core: the first call
    several times slower probes one thread at once, and the plan switches."""
    many = 2
    clock = _Clock()
    current = [many]
    loaded = [False]
    monkeypatch.setattr(frozen, "time", clock)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: current.__setitem__(0, n))
    monkeypatch.setattr(torch, "get_num_threads", lambda: current[0])

    def fn(*xs: Any) -> list[Any]:
        if current[0] == 1:
            clock.now += 2.0
        else:
            clock.now += 50.0 if loaded[0] else 1.0
        return []

    adaptive = frozen.AdaptiveThreads(fn, many)
    for _ in range(100):
        adaptive()
    assert adaptive.threads == many and adaptive.gap >= 64
    loaded[0] = True
    for _ in range(4):
        adaptive()
    assert adaptive.threads == 1
