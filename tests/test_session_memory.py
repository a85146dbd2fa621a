"""Dropping a session frees its model's weights and plans at once, without waiting for the
garbage collector: the tests run with the collector off, open a session, run it, drop it,
and check that what its plan owned (units, engine plans, weights) is gone."""

from __future__ import annotations

import gc
import tracemalloc
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import fusegraph.onnx as fgo
from fusegraph.onnx.plan_release import break_cycles
from fusegraph.onnx.units import FusegraphUnit

pytestmark = pytest.mark.usefixtures("own_cache")

D = 256  # two 256x256 float32 layers: 0.5 MB of weights


def _mlp(rng: np.random.Generator, layers: int = 2) -> onnx.ModelProto:
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32)
        b = rng.standard_normal(D).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
                  helper.make_node("Relu", [f"a{i}"], [f"r{i}"])]
        x = f"r{i}"
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, D])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, [4, D])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.fixture
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _weak(obj: Any) -> weakref.ref[Any] | None:
    try:
        return weakref.ref(obj)
    except TypeError:
        return None


def _owned(sess: fgo.InferenceSession) -> tuple[list[weakref.ref[Any]], int]:
    """Weak references to what the session's plans own that may sit in a reference cycle
    (units, engine plans, bound weights; a whole-model runner where one won), and how many
    fusegraph units there are."""
    refs: list[weakref.ref[Any] | None] = [_weak(sess._direct)] if sess._direct is not None else []
    fused = 0
    for plan in sess._plans.values():
        refs.append(_weak(plan))
        for u in plan.units:
            refs.append(_weak(u))
            if not isinstance(u, FusegraphUnit):
                continue
            fused += 1
            refs += [_weak(u.plan), *(_weak(p) for p in u.graph.plans.values())]
            refs += [_weak(w) for w in u.weights.values()]
            refs += [_weak(w) for w in getattr(u, "_weights_dev", {}).values()]
    return [r for r in refs if r is not None], fused


def _run_checked(sess: fgo.InferenceSession, model: onnx.ModelProto, x: np.ndarray, rel: float = 1e-5) -> None:
    got = sess.run(None, {"x": x})[0]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert not np.isnan(got).any()
    err = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want.astype(np.float64))
    assert err < rel, f"relative error {err:.2e}, max abs {np.abs(got - want).max():.2e}"


CASES = {
    "defaults": {},
    "floor_off": {"floor": "off"},
    "torch": {"floor": "off", "engine": "torch"},
    "regions": {"floor": "off", "engine": "torch", "regions": "on"},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_del_frees_the_plan_without_the_collector(case: str, rng: np.random.Generator, no_gc: None) -> None:
    model = _mlp(rng)
    x = rng.standard_normal((4, D)).astype(np.float32)
    sess = fgo.InferenceSession(model.SerializeToString(), providers=[(fgo.PROVIDER, CASES[case])])
    _run_checked(sess, model, x)
    refs, fused = _owned(sess)
    if case != "defaults":  # the floor off: the fusegraph units are kept, whatever their speed
        assert fused >= 1
    assert refs
    del sess
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"{len(alive)} object(s) the session owned outlive it: {[type(a).__name__ for a in alive][:8]}"


@pytest.mark.parametrize("case", ["regions"])
def test_replacing_a_session_frees_the_old_one(case: str, rng: np.random.Generator, no_gc: None) -> None:
    model = _mlp(rng)
    x = rng.standard_normal((4, D)).astype(np.float32)
    opts = [(fgo.PROVIDER, CASES[case])]
    sess: fgo.InferenceSession | None = fgo.InferenceSession(model.SerializeToString(), providers=opts)
    assert sess is not None
    _run_checked(sess, model, x)
    refs, fused = _owned(sess)
    assert fused >= 1
    sess = fgo.InferenceSession(model.SerializeToString(), providers=opts)  # a reload
    assert all(r() is None for r in refs)
    refs, _ = _owned(sess)
    sess = None
    assert all(r() is None for r in refs)


def test_open_run_drop_loop_does_not_grow(rng: np.random.Generator, no_gc: None) -> None:
    """20 sessions opened, run and dropped in turn: the traced memory after the last is what
    it was after the fifth (the weights of each are freed before the next is opened)."""
    model = _mlp(rng).SerializeToString()
    x = rng.standard_normal((4, D)).astype(np.float32)
    opts = [(fgo.PROVIDER, CASES["regions"])]
    weights = 2 * D * D * 4
    tracemalloc.start()
    try:
        current: list[int] = []
        for _ in range(20):
            sess = fgo.InferenceSession(model, providers=opts)
            sess.run(None, {"x": x})
            del sess
            current.append(tracemalloc.get_traced_memory()[0])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    growth = current[-1] - current[4]
    assert growth < weights // 4, f"traced memory grew {growth} bytes over 15 sessions (weights: {weights})"
    assert peak < current[4] + 8 * weights, f"peak {peak} bytes, {current[4]} after the fifth session"


def _holding(obj: Any) -> Any:
    def closure() -> Any:
        return obj

    return closure


def test_break_cycles_cuts_graph_plan_and_closure_cycles(rng: np.random.Generator, no_gc: None) -> None:
    """break_cycles alone (what the session's finalizer calls): a graph built with its plan
    cached in it, held only through a closure, is freed once cut."""
    import fusegraph as fg

    g = fg.Graph(io_data_type=fg.DataType.FLOAT)
    a = g.tensor("a", [3, 4])
    g.relu(a).set_name("y").set_output(True)
    plan = g.build(engine="reference")
    assert g.plans  # the graph holds its plan, the plan its graph: a cycle
    probe = weakref.ref(plan)
    closure = _holding(plan)
    del plan
    assert break_cycles([[closure]]) >= 1
    assert not g.plans and g._selection is None
    del closure
    assert probe() is None


@pytest.mark.gpu
def test_on_cuda_del_returns_the_device_memory(rng: np.random.Generator, no_gc: None) -> None:
    """On cuda:0 with the defaults (regions=auto: the region path, CUDA graphs, split products
    and their fallbacks): the weights copied to the device and the plans' buffers are given
    back at ``del``, with the collector off, session after session."""
    import torch

    model = _mlp(rng, layers=3)
    x = rng.standard_normal((4, D)).astype(np.float32)
    opts = [(fgo.PROVIDER, {"device": "cuda", "floor": "off"})]
    warm = fgo.InferenceSession(model.SerializeToString(), providers=opts)  # torch and CUDA set up
    warm.run(None, {"x": x})
    del warm
    torch.cuda.synchronize()
    # cuBLAS keeps a workspace (32 MiB on Hopper) per stream it has run on, for the process's
    # life, the captures' one warm-up stream included: torch's cache, not the session's --
    # cleared here
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)
    clear()
    base = torch.cuda.memory_allocated()
    for _ in range(3):
        sess = fgo.InferenceSession(model.SerializeToString(), providers=opts)
        _run_checked(sess, model, x, rel=1e-3)  # TF32 may be on, as in test_onnx_regions' CUDA tests
        refs, fused = _owned(sess)
        assert fused >= 1
        held = torch.cuda.memory_allocated() - base
        assert held >= 3 * D * D * 4  # the weights are on the device while the session lives
        del sess
        torch.cuda.synchronize()
        assert all(r() is None for r in refs)
        clear()
        left = torch.cuda.memory_allocated() - base
        assert left <= 0, f"{left} bytes of device memory outlive the session ({held} while it lived)"


@pytest.mark.gpu
def test_captures_warm_up_on_one_stream_so_cublas_workspaces_do_not_pile_up(rng: np.random.Generator) -> None:
    """Each captured plan's warm-up runs on the device's one warm-up stream
    (engines/cuda_capture.warm_up_stream): cuBLAS keeps a workspace (32 MiB on Hopper) per
    stream it ran on, so a fresh stream per capture grew the device memory by a workspace
    per plan. After the first two plans, two more captured matmul plans add their buffers
    only, and each plan still computes what the reference does."""
    import torch

    import fusegraph as fg
    from fusegraph.engines import cuda_capture
    from fusegraph.engines.base import EngineConfig
    from fusegraph.engines.registry import REGISTRY

    handle = fg.Handle("cuda:0")
    engine = REGISTRY.get("torch")
    plans: list[Any] = []
    marks: list[int] = []
    torch.cuda.synchronize()
    for i in range(4):
        g = fg.Graph(f"mm{i}", io_data_type=fg.DataType.FLOAT, compute_data_type=fg.DataType.FLOAT)
        a = g.tensor(name="a", dim=[32 + 8 * i, 64], stride=[64, 1], data_type=fg.DataType.FLOAT)
        b = g.tensor(name="b", dim=[64, 48], stride=[48, 1], data_type=fg.DataType.FLOAT)
        y = g.matmul(a, b, name="mm")
        y.set_output(True).set_name("y")
        plan = engine.build(g, handle, EngineConfig("torch", (("cuda_graph", True),)))
        for _ in range(3):
            pack = {"a": rng.standard_normal((32 + 8 * i, 64)).astype(np.float32),
                    "b": rng.standard_normal((64, 48)).astype(np.float32)}
            got = plan.execute(pack)["y"]
            want = g.execute(pack, engine="reference")["y"]
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2  # TF32 may be allowed
        assert plan.describe()["cuda_graph"] is True
        plans.append(plan)
        torch.cuda.synchronize()
        marks.append(torch.cuda.memory_allocated())
    assert str(torch.device("cuda", 0)) in cuda_capture._WARM_UP
    grown = marks[3] - marks[1]
    assert grown < 16 * 2**20, f"two more captured plans took {grown / 2**20:.1f} MiB"
