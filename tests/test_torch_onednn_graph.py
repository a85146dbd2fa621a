"""The torch engine's oneDNN Graph path (CPU): the plan traced with its bound weights
frozen in, probed in a child process first, checked against the eager plan, and eager
whenever anything about it fails."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

import fusegraph as fg
from fusegraph import DataType as DT
from fusegraph.engines.base import EngineConfig
from fusegraph.runtime import bounded
from fusegraph.select.autotune import random_inputs

torch = pytest.importorskip("torch", reason="the torch engine needs PyTorch (pip install 'fusegraph[torch]')")

from fusegraph.engines import torch as torch_engine  # noqa: E402
from fusegraph.engines.torch import fusion as torch_fusion  # noqa: E402
from fusegraph.engines.torch import onednn_graph as ong  # noqa: E402
from fusegraph.engines.torch import steps as torch_steps  # noqa: E402
from fusegraph.engines.torch.frozen import can_compile  # noqa: E402

pytestmark = pytest.mark.skipif(not ong.available(), reason="this torch build has no oneDNN Graph bridge")

CPU = fg.Handle("cpu")
ENGINE = torch_engine.TorchEngine()
# The bridge is opt-in since issue 14 (frozen.py's compiled path is the default): asked for
# here, alone (no compiled candidate after it), so a refusal leaves the plan eager.
BRIDGE = EngineConfig("torch", (("onednn_graph", True),) + ((("cpu_compile", "off"),) if not can_compile() else ()))
TOL = 1e-4  # oneDNN Graph's fused f32 kernels against float64, after a few layers


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test its own verdict cache, so that probes really run."""
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _net() -> fg.Graph:
    """conv + bias + ReLU, a residual block, max pooling, a flatten and a GEMM + bias + ReLU:
    what the light CNNs are made of."""
    g = fg.Graph("net", io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT)
    x = g.tensor("x", [1, 4, 12, 12], fg.strides_for([1, 4, 12, 12], "NHWC"))
    w1 = g.tensor("w1", [8, 4, 3, 3], fg.strides_for([8, 4, 3, 3], "KRSC"))
    b1 = g.tensor("b1", [1, 8, 1, 1])
    w2 = g.tensor("w2", [8, 8, 3, 3], fg.strides_for([8, 8, 3, 3], "KRSC"))
    b2 = g.tensor("b2", [1, 8, 1, 1])
    h = g.relu(g.bias(g.conv_fprop(x, w1, padding=[1, 1]), b1))
    h = g.relu(g.add(g.bias(g.conv_fprop(h, w2, padding=[1, 1]), b2), h))
    p = g.pooling(h, fg.PoolingMode.MAX, window=(2, 2), stride=(2, 2), pre_padding=(0, 0), post_padding=(1, 1))
    flat = g.reshape(p, [1, 8 * 6 * 6])
    wf = g.tensor("wf", [8 * 6 * 6, 10], (1, 8 * 6 * 6))
    bf = g.tensor("bf", [10])
    g.relu(g.add(g.matmul(flat, wf), bf)).set_output(True).set_name("y")
    return g.validate()


WEIGHTS = ("w1", "b1", "w2", "b2", "wf", "bf")


def _bound_plan(g: fg.Graph, rng: np.random.Generator, config: EngineConfig | None = None) -> tuple[torch_engine.TorchPlan, dict[str, np.ndarray]]:
    plan = ENGINE.build(g, CPU, config or BRIDGE)
    assert isinstance(plan, torch_engine.TorchPlan)
    pack = random_inputs(g, rng)
    plan.bind_constants({k: pack[k] for k in WEIGHTS if k in pack})
    return plan, pack


def _err(got: np.ndarray, want: np.ndarray) -> float:
    """Relative L2 error; against max(|want|, 1) so that an output the final ReLU clamped to
    all zeros (possible on some seeds: 10 outputs) reads as the absolute error, not NaN."""
    diff = float(np.linalg.norm(got.astype(np.float64) - want))
    return diff / max(float(np.linalg.norm(want)), 1.0)


def _assert_runs_eagerly(rng: np.random.Generator, caplog: pytest.LogCaptureFixture, *why: str) -> None:
    """The plan falls back: correct results from the eager path, and a warning saying why."""
    g = _net()
    plan, pack = _bound_plan(g, rng)
    with caplog.at_level(logging.WARNING, logger="fusegraph.engines.torch"):
        got = plan.execute(pack)["y"]
    assert _err(got, g.execute(pack, engine="reference")["y"]) < 1e-5
    assert plan.describe()["onednn_graph"] is False
    assert "running eagerly" in caplog.text and all(w in caplog.text for w in why)


def test_traced_plan_matches_the_reference_and_is_reused(rng: np.random.Generator, _own_cache: Path) -> None:
    g = _net()
    plan, pack = _bound_plan(g, rng)
    for _ in range(3):
        pack = {**pack, "x": random_inputs(g, rng)["x"]}
        assert _err(plan.execute(pack)["y"], g.execute(pack, engine="reference")["y"]) < TOL
    assert plan.describe()["onednn_graph"] is True
    verdicts = json.loads((_own_cache / ong.VERDICTS).read_text())
    assert list(verdicts.values()) == [""]  # probed once, fine


def test_cached_verdict_skips_the_probe(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    g = _net()
    plan, pack = _bound_plan(g, rng)
    plan.execute(pack)

    def no_probe(*a: object, **k: object) -> tuple[str, bool]:
        raise AssertionError("probed again despite a cached verdict")

    monkeypatch.setattr(ong, "_run_probe", no_probe)
    again, pack = _bound_plan(g, rng)
    assert _err(again.execute(pack)["y"], g.execute(pack, engine="reference")["y"]) < TOL
    assert again.describe()["onednn_graph"] is True


def test_a_crashing_probe_leaves_the_plan_eager(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture, _own_cache: Path) -> None:
    """A child killed by a signal (what a segfault in the bridge looks like) is a definitive,
    cached 'no'; the plan runs eagerly, correctly, and says why in the log."""
    def crashed(cmd: list[str], **kw: object) -> bounded.BoundedRun:
        return bounded.BoundedRun(-11, "", "", 0, None)

    monkeypatch.setattr(bounded, "run_bounded", crashed)  # the probe's child runs under ceilings
    _assert_runs_eagerly(rng, caplog, "signal 11")
    assert "signal 11" in next(iter(json.loads((_own_cache / ong.VERDICTS).read_text()).values()))


def test_a_child_that_cannot_start_is_not_cached(monkeypatch: pytest.MonkeyPatch, _own_cache: Path) -> None:
    def broken(cmd: list[str], **kw: object) -> bounded.BoundedRun:
        return bounded.BoundedRun(1, "", "ImportError: no module named torch", 0, None)

    monkeypatch.setattr(bounded, "run_bounded", broken)
    why = ong.probe(_net(), list(WEIGHTS), ())
    assert "exit code 1" in why and "ImportError" in why
    assert not (_own_cache / ong.VERDICTS).exists()


def test_a_result_that_differs_from_eager_is_refused(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    real = ong.trace

    def skewed(*a: object, **k: object) -> object:
        fn = real(*a, **k)  # type: ignore[arg-type]
        return lambda *xs: tuple(t * 1.01 for t in fn(*xs))

    monkeypatch.setattr(ong, "trace", skewed)
    _assert_runs_eagerly(rng, caplog, "against the eager plan")


def test_another_weight_object_runs_eagerly(rng: np.random.Generator) -> None:
    g = _net()
    plan, pack = _bound_plan(g, rng)
    plan.execute(pack)
    w1 = np.empty_like(pack["w1"])
    w1[...] = -pack["w1"]
    other = {**pack, "w1": w1}
    assert _err(plan.execute(other)["y"], g.execute(other, engine="reference")["y"]) < TOL
    assert _err(plan.execute(pack)["y"], g.execute(pack, engine="reference")["y"]) < TOL  # still the bound weights


def test_knob_off_and_graphs_without_convs(rng: np.random.Generator) -> None:
    g = _net()
    plan, pack = _bound_plan(g, rng, EngineConfig("torch", (("onednn_graph", False),)))
    plan.execute(pack)
    assert plan.describe()["onednn_graph"] is False
    m = fg.Graph("mm", io_data_type=DT.FLOAT)
    m.relu(m.matmul(m.tensor("a", [3, 4]), m.tensor("b", [4, 5]))).set_output(True)
    assert "onednn_graph" not in {k.name for k in ENGINE.knobs(m.validate(), CPU)}


def test_bound_weights_may_be_left_out_of_the_pack(rng: np.random.Generator) -> None:
    """bind_constants says the plan keeps them: a pack of the activations alone runs with
    the bound weights, on the fused path."""
    g = _net()
    plan = ENGINE.build(g, CPU, BRIDGE)
    pack = random_inputs(g, rng)
    assert plan.bind_constants({k: pack[k] for k in WEIGHTS}) is True
    for _ in range(2):
        x = random_inputs(g, rng)["x"]
        want = g.execute({**pack, "x": x}, engine="reference")["y"]
        assert _err(plan.execute({"x": x})["y"], want) < TOL
    assert plan.describe()["onednn_graph"] is True


def test_fused_results_are_fresh_arrays_the_caller_owns(rng: np.random.Generator) -> None:
    """Results may be lent as views of the tensors computed, never of memory that a later
    call, an input or a weight reuses: writing into one result changes nothing after."""
    g = fg.Graph("two", io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT)
    x = g.tensor("x", [1, 4, 6, 6], fg.strides_for([1, 4, 6, 6], "NHWC"))
    w = g.tensor("w", [4, 4, 1, 1], fg.strides_for([4, 4, 1, 1], "KRSC"))
    b = g.tensor("b", [1, 4, 1, 1])
    y = g.relu(g.bias(g.conv_fprop(x, w), b))
    y.set_output(True).set_name("y")
    g.identity(y).set_output(True).set_name("y2")
    g.identity(x).set_output(True).set_name("x2")
    g.validate()
    plan = ENGINE.build(g, CPU, BRIDGE)
    pack = random_inputs(g, rng)
    plan.bind_constants({"w": pack["w"], "b": pack["b"]})
    want = g.execute(pack, engine="reference")
    first = plan.execute({"x": pack["x"]})
    assert plan.describe()["onednn_graph"] is True
    for name in ("y", "y2", "x2"):
        assert _err(first[name], want[name]) < TOL
    assert not np.shares_memory(first["x2"], pack["x"])
    assert not np.shares_memory(first["y"], first["y2"])
    kept = {k: v.copy() for k, v in first.items()}
    for v in first.values():
        v[...] = np.nan
    again = plan.execute({"x": pack["x"]})
    for name, v in kept.items():
        assert np.array_equal(again[name], v), name
    assert not any(np.shares_memory(again[n], first[n]) for n in first)
    assert np.isfinite(pack["w"]).all() and np.isfinite(pack["x"]).all()


def test_traced_channel_shuffle_keeps_channels_last(rng: np.random.Generator) -> None:
    """conv -> channel shuffle -> conv, traced: the shuffle is one torch.channel_shuffle
    whose result stays NHWC (a row-major reshape copy would make every later oneDNN
    partition reorder its input and output), and the result matches the reference."""
    g = fg.Graph("shuffled", io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT)
    nhwc = lambda dims: fg.strides_for(dims, "NHWC")  # noqa: E731
    x = g.tensor("x", [1, 12, 5, 5], nhwc([1, 12, 5, 5]))
    w1 = g.tensor("w1", [12, 4, 1, 1], fg.strides_for([12, 4, 1, 1], "KRSC"))
    b1 = g.tensor("b1", [1, 12, 1, 1])
    h = g.relu(g.bias(g.conv_fprop(x, w1), b1))
    h.set_stride(list(nhwc([1, 12, 5, 5])))
    t5 = g.transpose(g.reshape(h, [1, 3, 4, 5, 5]), [0, 2, 1, 3, 4])
    s = g.reshape(t5, [1, 12, 5, 5])
    s.set_stride(list(nhwc([1, 12, 5, 5])))
    w2 = g.tensor("w2", [12, 4, 1, 1], fg.strides_for([12, 4, 1, 1], "KRSC"))
    b2 = g.tensor("b2", [1, 12, 1, 1])
    g.relu(g.bias(g.conv_fprop(s, w2), b2)).set_output(True).set_name("y")
    g.validate()
    assert "channel_shuffle(g=3)" in [st.describe() for st in torch_fusion.plan_traced_steps(g).values()]
    plan = ENGINE.build(g, CPU, BRIDGE)
    pack = random_inputs(g, rng)
    plan.bind_constants({k: pack[k] for k in ("w1", "b1", "w2", "b2")})
    assert _err(plan.execute(pack)["y"], g.execute(pack, engine="reference")["y"]) < TOL
    assert plan.describe()["onednn_graph"] is True


def test_as_declared_restores_the_declared_memory_format() -> None:
    t = fg.Graph("t").tensor("t", [2, 3, 4, 5], fg.strides_for([2, 3, 4, 5], "NHWC"))
    y = torch_steps.as_declared(torch.randn(2, 3, 4, 5), t)
    assert y.is_contiguous(memory_format=torch.channels_last)
    rm = fg.Graph("r").tensor("r", [2, 3, 4, 5])
    assert torch_steps.as_declared(y, rm).is_contiguous()
    odd = fg.Graph("o").tensor("o", [2, 3, 4, 5], (60, 1, 3, 12))  # neither format: left as is
    assert torch_steps.as_declared(y, odd) is y


def test_the_lean_call_path_agrees_with_the_general_one(rng: np.random.Generator) -> None:
    """Activations alone, as NumPy (the ONNX provider's call) take a lean path once the
    traced function exists; anything else -- another layout, a read-only or mistyped
    array, an extra weight -- takes the general path, with the same result or error."""
    g = _net()
    plan, pack = _bound_plan(g, rng)
    plan.execute(pack)  # builds the traced function
    assert plan._hot_in is not None
    x = random_inputs(g, rng)["x"]
    want = g.execute({**pack, "x": x}, engine="reference")["y"]
    lean = plan.execute({"x": x})["y"]
    assert _err(lean, want) < TOL
    nchw = np.ascontiguousarray(x)  # declared NHWC: laid out by torch on the lean path
    assert np.array_equal(plan.execute({"x": nchw})["y"], lean)
    frozen = x.copy()
    frozen.setflags(write=False)
    assert np.array_equal(plan.execute({"x": frozen})["y"], lean)
    assert np.array_equal(plan.execute({**pack, "x": x})["y"], lean)  # weights passed too
    with pytest.raises(fg.VariantPackError, match=r"'x'.*dtype"):
        plan.execute({"x": x.astype(np.float64)})
    with pytest.raises(fg.VariantPackError, match=r"'x'.*shape"):
        plan.execute({"x": x[:, :, :-1]})
    plan.bind_constants({k: (-pack[k] if k == "w1" else pack[k]) for k in WEIGHTS})  # new weights
    other = {**pack, "w1": -pack["w1"], "x": x}
    assert _err(plan.execute({"x": x})["y"], g.execute(other, engine="reference")["y"]) < TOL


def test_a_shared_value_scaled_and_concatenated_stays_correct(rng: np.random.Generator) -> None:
    """DenseNet's pattern: a value both concatenated and pre-activated (scale, shift, ReLU)
    then convolved. Fused by the bridge, the scale-shift overwrote its input before the
    concat read it (relative error ~0.3, so the plan fell back to eager); traced as aten
    addcmul + relu it runs fused and right."""
    g = fg.Graph("dense", io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT)
    nhwc = lambda dims: fg.strides_for(dims, "NHWC")  # noqa: E731
    x = g.tensor("x", [1, 8, 10, 10], nhwc([1, 8, 10, 10]))
    w0 = g.tensor("w0", [16, 8, 3, 3], fg.strides_for([16, 8, 3, 3], "KRSC"))
    y = g.pooling(g.relu(g.conv_fprop(x, w0, padding=[1, 1])), fg.PoolingMode.MAX, window=(2, 2), stride=(2, 2),
                  pre_padding=(0, 0), post_padding=(0, 0))
    y.set_stride(list(nhwc([1, 16, 5, 5])))
    z = g.relu(g.add(g.mul(y, g.tensor("scale", [1, 16, 1, 1])), g.tensor("shift", [1, 16, 1, 1])))
    w1 = g.tensor("w1", [8, 16, 1, 1], fg.strides_for([8, 16, 1, 1], "KRSC"))
    c = g.conv_fprop(z, w1)
    c.set_stride(list(nhwc([1, 8, 5, 5])))
    out = g.concatenate([y, c], axis=1)
    out.set_stride(list(nhwc([1, 24, 5, 5])))
    out.set_output(True).set_name("y")
    g.validate()
    assert "scale+shift+relu" in [st.describe() for st in torch_fusion.plan_traced_steps(g).values()]
    plan = ENGINE.build(g, CPU, BRIDGE)
    pack = random_inputs(g, rng)
    plan.bind_constants({k: pack[k] for k in ("w0", "scale", "shift", "w1")})
    for _ in range(2):
        x_ = random_inputs(g, rng)["x"]
        assert _err(plan.execute({"x": x_})["y"], g.execute({**pack, "x": x_}, engine="reference")["y"]) < TOL
    assert plan.describe()["onednn_graph"] is True
