"""A Dynamo graph whose fusegraph trace kept regions is timed as a step against Inductor's
own compile of the same graph and against eager (fusegraph/torch/step_floor.py), and the
fastest runs. Here every region wins (the virtual clock of tests/test_torch_graph_floor.py,
the unclaimed ATen graph made slower), and the step's verdict is forced by a timer of this
file's own that runs every side and reports the times it is told: Inductor's own winning
gives Inductor's ATen graphs, saved tensors, loss and gradients bit for bit; the trace
winning keeps the regions. Either verdict is stored under the Dynamo graph's key and read
back without timing, or compiling the losing side, again. Eager winning:
tests/test_torch_step_candidates.py."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch.compile backend needs torch")

from test_torch_graph_floor import clock  # noqa: E402, F401  (the virtual clock fixture)
from test_torch_incumbent_path import (  # noqa: E402, F401  (fixtures and helpers)
    FLOOR,
    ConvBN,
    LNBlock,
    _rel,
    _side_by_side,
    _step,
    graphs,
)

from fusegraph.select import timing  # noqa: E402
from fusegraph.torch import step_floor  # noqa: E402
from fusegraph.torch.compile_backend import STORED_OWN, collecting, fusegraph_backend  # noqa: E402
from fusegraph.torch.graph_floor import INDUCTORS_OWN  # noqa: E402

OPTIONS = {**FLOOR, "warmup_s": 0.0}
ALL = ("own", "eager", "trace")
REAL_TIMER = timing.time_candidates  # before any fixture replaces it


@pytest.fixture
def step_clock(request: pytest.FixtureRequest, tmp_path: Any,
               monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Every region wins alone and in its ATen graph; the step's timing runs each side once
    and reports ``trace_ms`` / ``own_ms`` / ``eager_ms`` (eager the slowest unless a test
    says otherwise). ``calls`` counts step timings, ``backward`` says for each side run
    (by name: own, eager, trace) whether it ran a backward; ``timer`` replaces the forced
    times (REAL_TIMER: the real clock)."""
    state = step_timer(monkeypatch, tmp_path)
    request.getfixturevalue("clock")["graph_extra"] = 100.0
    yield state


def step_timer(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> dict[str, Any]:
    """The step check's timing forced (step_clock's state), for a cache of the test's own."""
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    state: dict[str, Any] = {"calls": 0, "trace_ms": 2.0, "own_ms": 1.0, "eager_ms": 3.0, "backward": {},
                             "timer": None}

    def fixed(candidates: Any, **_: Any) -> dict[str, timing.Timing]:
        out = {}
        for name, call in candidates.items():
            call()
            state["backward"][name] = call.backward
            ms = state[f"{name}_ms"]
            out[name] = timing.Timing(name, ms, ms, (ms,))
        return out

    def timed(candidates: Any, **kwargs: Any) -> Any:
        state["calls"] += 1
        return (state["timer"] or fixed)(candidates, **kwargs)

    monkeypatch.setattr(step_floor, "_time", timed)
    return state


def _stored() -> list[dict[str, Any]]:
    from fusegraph.regions.verdicts import VerdictStore

    path = VerdictStore().path
    table = json.loads(path.read_text()) if path.exists() else {}
    return [v for v in table.values() if v.get("source") == "concluded" or v.get("engine") == step_floor.ENGINE]


def test_inductors_own_faster_runs_it_and_the_verdict_is_stored(step_clock: dict[str, Any],
                                                                request: pytest.FixtureRequest) -> None:
    seen: list[str] = request.getfixturevalue("graphs")
    (want, want_graphs), (got, got_graphs), rows = _side_by_side(ConvBN, (4, 3, 8, 8), seen, OPTIONS)
    # two timings: Inductor's own and eager first, then the three once the trace kept regions
    assert step_clock["calls"] == 2 and step_clock["backward"] == dict.fromkeys(ALL, True), step_clock
    # the first two lowered are Inductor's own forward and backward (the first pass's after them)
    assert len(got_graphs) > 2 and any("fusegraph.region" in t for t in got_graphs[2:])
    assert got_graphs[:2] == want_graphs
    assert got[2] == want[2], (got[2], want[2])  # the same tensors saved for the backward
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a, b), float((a - b).abs().max())
    regions = [r for r in rows if r.region is not None]
    assert regions and all(r.where == "inductor" for r in rows), [(r.node, r.where) for r in rows]
    times = f"{INDUCTORS_OWN} 1.000 ms vs {step_floor.ENGINE} 2.000 ms vs eager 3.000 ms"
    assert all(step_floor.OWN_WON in r.why and times in r.why for r in rows), rows[0]
    stored = _stored()
    assert len(stored) == 1 and not stored[0]["fusegraph"] and stored[0]["source"] == "measured", stored
    # compiled again: straight to Inductor's own, nothing traced, nothing timed
    (want, want_graphs), (again, again_graphs), rows = _side_by_side(ConvBN, (4, 3, 8, 8), seen, OPTIONS)
    assert step_clock["calls"] == 2
    assert again_graphs == want_graphs and again[2] == want[2] and torch.equal(again[0], want[0])
    assert rows and all(r.where == "inductor" and r.why.startswith(STORED_OWN) for r in rows), rows[:2]
    assert all("cached" in r.why and "fusegraph 2.0000 ms" in r.why for r in rows), rows[0].why


def test_the_trace_faster_keeps_its_regions_and_the_verdict_is_stored(step_clock: dict[str, Any],
                                                                      request: pytest.FixtureRequest) -> None:
    seen: list[str] = request.getfixturevalue("graphs")
    step_clock["trace_ms"], step_clock["own_ms"] = 1.0, 2.0
    (want, _), (got, _), rows = _side_by_side(LNBlock, (2, 8, 32), seen, OPTIONS)
    # two timings: Inductor's own and eager first, then the three once the trace kept regions
    assert step_clock["calls"] == 2 and step_clock["backward"] == dict.fromkeys(ALL, True), step_clock
    claimed = [r for r in rows if r.fusegraph]
    assert {r.node[:2] for r in claimed} == {"fw", "bw"}, [(r.node, r.where) for r in rows]
    assert all(step_floor.TRACE_WON in r.why and "measured" in r.why for r in claimed), claimed[0].why
    assert abs(float(got[0]) - float(want[0])) < 1e-5 * want[3], (got[0], want[0], want[3])
    for a, b in zip(got[1], want[1], strict=True):
        assert _rel(a, b) < 1e-4
    stored = _stored()
    assert len(stored) == 1 and stored[0]["fusegraph"] and stored[0]["source"] == "measured", stored
    # compiled again: the trace (its ATen graphs' verdicts cached too), Inductor's own never compiled
    (want, _), (again, again_graphs), rows = _side_by_side(LNBlock, (2, 8, 32), seen, OPTIONS)
    assert step_clock["calls"] == 2
    assert len(again_graphs) == 2 and all("fusegraph.region" in t for t in again_graphs), len(again_graphs)
    claimed = [r for r in rows if r.fusegraph]
    assert claimed and all(step_floor.TRACE_WON in r.why and "cached" in r.why for r in claimed), claimed[0].why
    assert abs(float(again[0]) - float(want[0])) < 1e-5 * want[3]


@pytest.mark.parametrize("winner", ["own", "trace", "timed"])
def test_inference_without_grad_times_the_forward_alone(winner: str, step_clock: dict[str, Any]) -> None:
    """Forced either way, or timed on the real clock ("timed": any side may win on this
    machine; the output follows the verdict the rows give)."""
    if winner == "trace":
        step_clock["trace_ms"], step_clock["own_ms"] = 1.0, 2.0
    if winner == "timed":
        step_clock["timer"] = REAL_TIMER
    model = LNBlock().eval()
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        want = torch.compile(model)(x)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=partial(fusegraph_backend, options=OPTIONS))
        with collecting() as rows:
            got = compiled(x)
    # two timings: Inductor's own and eager first, then the three once the trace kept regions
    assert step_clock["calls"] == 2, step_clock
    if winner != "timed":
        assert step_clock["backward"] == dict.fromkeys(ALL, False), step_clock
    side = "trace" if any(r.fusegraph for r in rows) else "eager" if rows[0].where == "torch.eager" else "own"
    assert side == winner or winner == "timed"
    assert rows and all(step_floor.RUNS[side] in r.why
                        for r in rows if (r.fusegraph if side == "trace" else r.region is not None)), rows[0].why
    if side == "own":
        assert torch.equal(got, want) and all(r.where == "inductor" for r in rows)
    elif side == "eager":
        assert torch.equal(got, model(x)) and all(r.where == "torch.eager" for r in rows)
    else:
        assert _rel(got, want) < 1e-5
    assert len(_stored()) == 1


def test_a_dynamic_batch_is_timed_once(step_clock: dict[str, Any]) -> None:
    """``mark_dynamic``: one Dynamo graph for every batch, timed at the first one's size;
    Inductor's own compile runs every later batch without a recompile or a second timing."""
    model = LNBlock().eval()
    xs = [torch.randn(b, 8, 32) for b in (2, 3, 5)]
    outs: dict[str, list[Any]] = {}
    for name, backend in (("inductor", "inductor"), ("fusegraph", partial(fusegraph_backend, options=OPTIONS))):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        outs[name] = []
        with torch.no_grad():
            for x in xs:
                x = x.clone()
                torch._dynamo.mark_dynamic(x, 0)
                outs[name].append(compiled(x))
    # two timings: Inductor's own and eager first, then the three once the trace kept regions
    assert step_clock["calls"] == 2 and step_clock["backward"] == dict.fromkeys(ALL, False), step_clock
    for a, b in zip(outs["fusegraph"], outs["inductor"], strict=True):
        assert torch.equal(a, b), float((a - b).abs().max())


def test_the_users_parameters_are_untouched(step_clock: dict[str, Any]) -> None:
    """The check runs a backward on fresh tensors: after the compiling call the model's
    ``.grad`` are still unset and its running statistics updated once; the step's
    gradients are then eager's (float32 tolerances)."""
    model = ConvBN()
    eager = copy.deepcopy(model)
    x = torch.randn(4, 3, 8, 8)
    g = torch.randn(4, 10)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=partial(fusegraph_backend, options=OPTIONS))
    out = compiled(x)
    # two timings: Inductor's own and eager first, then the three once the trace kept regions
    assert step_clock["calls"] == 2 and step_clock["backward"] == dict.fromkeys(ALL, True)
    assert all(p.grad is None for p in model.parameters())
    (out * g).sum().backward()
    want = eager(x)
    (want * g).sum().backward()
    assert _rel(out.detach(), want.detach()) < 1e-5
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None and _rel(p.grad, q.grad) < 1e-4
    # the running statistics: one update each, this call's (none from the check's steps)
    for (name, a), b in zip(model.named_buffers(), eager.buffers(), strict=True):
        assert torch.equal(a, b) if a.dtype == torch.long else _rel(a, b) < 1e-5, name


def test_a_check_that_fails_keeps_the_trace_and_stores_nothing(
        step_clock: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("made to fail in this test")

    monkeypatch.setattr(step_floor, "time_steps", broken)
    model = LNBlock().eval()
    x = torch.randn(2, 8, 32)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=partial(fusegraph_backend, options=OPTIONS))
    with torch.no_grad(), collecting() as rows, caplog.at_level(logging.WARNING, logger="fusegraph.torch"):
        got = compiled(x)
    assert "the step check did not run (RuntimeError: made to fail" in caplog.text
    assert any(r.fusegraph for r in rows) and _stored() == []
    assert _rel(got, model(x).detach()) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("winner", ["own", "eager", "trace", "timed"])
def test_on_cuda_bf16_channels_last_training_runs_the_verdicts_side(
        winner: str, step_clock: dict[str, Any], request: pytest.FixtureRequest) -> None:
    """The ResNet-style step as bench_torch.py runs it on a GPU (channels-last, bf16
    autocast), every region winning: the step's verdict forced each way, or timed on the
    real clock ("timed"); the result is Inductor's own, or eager's, exactly where the
    verdict says so, else the trace's within bf16 tolerances."""
    seen: list[str] = request.getfixturevalue("graphs")
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    if winner == "trace":
        step_clock["trace_ms"], step_clock["own_ms"] = 1.0, 2.0
    if winner == "eager":
        step_clock["eager_ms"] = 0.5
    if winner == "timed":
        step_clock["timer"] = REAL_TIMER
    cuda = torch.device("cuda")
    model = ConvBN().to(cuda).to(memory_format=torch.channels_last)
    x = torch.randn(8, 3, 16, 16, device=cuda).to(memory_format=torch.channels_last)
    g = torch.randn(8, 10, device=cuda)
    sides = []
    for backend in ("eager", "inductor", partial(fusegraph_backend, options=OPTIONS)):
        twin = copy.deepcopy(model)
        torch._dynamo.reset()
        compiled = torch.compile(twin, backend=backend)
        start = len(seen)
        with torch.autocast("cuda", torch.bfloat16), collecting() as rows:
            sides.append((_step(twin, compiled, x, g), seen[start:], rows))
    (eager, _, _), (want, want_graphs, _), (got, got_graphs, rows) = sides
    # two timings: Inductor's own and eager first, then the three once the trace kept regions
    assert step_clock["calls"] == 2, step_clock
    side = "trace" if any(r.fusegraph for r in rows) else "eager" if rows[0].where == "torch.eager" else "own"
    assert any(r.region is not None for r in rows) and rows
    assert side == winner or winner == "timed", (side, winner)
    if side != "trace":  # Inductor's code, or eager's; cuDNN's weight gradients need not be bitwise repeatable
        assert all(step_floor.RUNS[side] in r.why for r in rows), rows[0].why
        if side == "own":
            assert got_graphs[:2] == want_graphs and got[2] == want[2]  # Inductor's own lowered first
        ref = want if side == "own" else eager
        assert abs(float(got[0]) - float(ref[0])) <= 1e-6 * ref[3]
        for a, b in zip(got[1], ref[1], strict=True):
            assert _rel(a, b) < 1e-5
    else:
        assert all(step_floor.TRACE_WON in r.why for r in rows if r.fusegraph)
        assert abs(float(got[0]) - float(want[0])) <= 2e-2 * want[3]
        for a, b in zip(got[1], want[1], strict=True):
            assert _rel(a, b) < 5e-2
