"""The floor over a whole graph (fusegraph/torch/graph_floor.py): after each region won
alone, the graph with its claimed regions is timed against the graph with none, and the
faster runs. On a virtual clock (this machine's load would drown real milliseconds) the
decision is checked both ways; on the real clock the check runs, is cached, and the model
stays right whichever side wins."""

from __future__ import annotations

import copy
import json
import logging
import re
from functools import partial
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch.compile backend needs torch")

from test_torch_compile import ConvNet  # noqa: E402

from fusegraph.select import timing  # noqa: E402
from fusegraph.torch import partition, runtime  # noqa: E402
from fusegraph.torch.compile_backend import fusegraph_backend  # noqa: E402
from fusegraph.torch.explainer import explain  # noqa: E402

FLOOR = {"floor": True, "incumbent": "eager", "rest": "eager", "warmup_s": 0.02}


def _rel(a: Any, b: Any) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-30))


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """A region call costs 3, a region's incumbent 9 (every region wins alone), and a
    candidate named "incumbent" pays ``graph_extra`` more: 0 leaves the unclaimed graph (its
    ATen nodes cost nothing here) the faster, 100 makes it the slower."""
    state = {"now": 0.0, "graph_extra": 0.0}
    real_call = runtime.RegionRunner.__call__

    def costly(self: Any, inputs: Any, sizes: Any) -> Any:
        state["now"] += 3.0
        return real_call(self, inputs, sizes)

    def slow_incumbent(region: Any, inputs: Any, opts: Any) -> Any:
        return lambda: state.__setitem__("now", state["now"] + 9.0)

    def virtual(candidates: Any, *, on_error: Any = None, **_: Any) -> dict[str, timing.Timing]:
        out = {}
        for name, call in candidates.items():
            try:
                call()
                start = state["now"]
                call()
            except Exception as exc:
                if on_error is not None:
                    on_error(name, exc)
                continue
            ms = state["now"] - start
            out[name] = timing.Timing(name, ms, ms, (ms,))
        return out

    def whole(candidates: Any, **kwargs: Any) -> dict[str, timing.Timing]:
        out = virtual(candidates, **kwargs)
        if "incumbent" in out and state.get("graph_level"):
            ms = out["incumbent"].median_ms + state["graph_extra"]
            out["incumbent"] = timing.Timing("incumbent", ms, ms, (ms,))
        return out

    from fusegraph.torch import graph_floor

    real_measure = graph_floor.measure

    def graph_measure(*args: Any, **kwargs: Any) -> Any:
        state["graph_level"] = 1.0
        try:
            return real_measure(*args, **kwargs)
        finally:
            state["graph_level"] = 0.0

    monkeypatch.setattr(runtime.RegionRunner, "__call__", costly)
    monkeypatch.setattr(partition, "_incumbent_call", slow_incumbent)
    monkeypatch.setattr(timing, "time_candidates", whole)
    monkeypatch.setattr(graph_floor, "measure", graph_measure)
    return state


def test_a_graph_slower_with_its_claimed_regions_is_handed_back_whole(
        clock: dict[str, float], tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    report = explain(ConvNet(), torch.randn(2, 3, 8, 8), options=FLOOR)
    regions = [r for r in report.rows if r.region is not None]
    assert regions and not any(r.fusegraph for r in report.rows), report.table()
    handed = [r for r in regions if "handed back with the whole graph" in r.why]
    assert handed, report.table()
    # the row keeps the region's own verdict: it won alone, the graph lost
    assert all("graph: measured" in r.why and "the region: fusegraph" in r.why for r in handed), [r.why for r in handed]


def test_a_graph_faster_with_its_claimed_regions_keeps_them(
        clock: dict[str, float], tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    clock["graph_extra"] = 100.0
    report = explain(ConvNet(), torch.randn(2, 3, 8, 8), options=FLOOR)
    assert any(r.fusegraph for r in report.rows), report.table()
    assert not any("handed back" in r.why for r in report.rows), report.table()


def test_the_graph_verdict_is_cached_and_read_back(
        clock: dict[str, float], tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    explain(ConvNet(), torch.randn(2, 3, 8, 8), options=FLOOR)
    table = json.loads((tmp_path / "regions-verdicts.json").read_text())
    graph_verdicts = [v for v in table.values() if v.get("incumbent") == "graph"]
    assert graph_verdicts and all(not v["fusegraph"] for v in graph_verdicts), table
    clock["graph_extra"] = 100.0  # would now keep the regions, were the graph measured again
    again = explain(ConvNet(), torch.randn(2, 3, 8, 8), options=FLOOR)
    handed = [r for r in again.rows if "handed back with the whole graph" in r.why]
    assert handed and all("graph: cached" in r.why for r in handed), again.table()


def test_the_check_can_be_turned_off(clock: dict[str, float], tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    report = explain(ConvNet(), torch.randn(2, 3, 8, 8), options={**FLOOR, "whole_graph": False})
    assert any(r.fusegraph for r in report.rows), report.table()


def test_on_the_real_clock_the_check_runs_and_the_model_stays_right(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Regions claimed by a slow incumbent, then the graph timed for real (on the compiling
    thread, real tensors, outside the compile's fake mode): the check runs without falling
    back, records its verdict, and whichever side won, outputs and gradients match eager."""
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(partition, "_incumbent_call",
                        lambda region, inputs, opts: lambda: torch.ones(256, 256) @ torch.ones(256, 256))
    eager = ConvNet()
    twin = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend=partial(fusegraph_backend, options=FLOOR))
    x = torch.randn(2, 3, 8, 8)
    with caplog.at_level(logging.INFO, logger="fusegraph.torch"):
        got = compiled(x)
        got.sum().backward()
    want = eager(x)
    want.sum().backward()
    assert _rel(got, want) < 1e-5
    for (name, p), q in zip(eager.named_parameters(), twin.parameters(), strict=True):
        assert q.grad is not None and _rel(q.grad, p.grad) < 1e-4, name
    text = caplog.text
    assert "did not run" not in text, text
    # the forward and the backward, whichever side won each
    assert len(re.findall(r"claimed regions: (?:graph|fusegraph \(fusegraph regions\)): measured", text)) == 2, text
    table = json.loads((tmp_path / "regions-verdicts.json").read_text())
    assert sum(v.get("incumbent") == "graph" for v in table.values()) == 2


def test_a_graph_whose_inputs_would_not_fit_twice_is_not_timed_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timing the graph allocates its inputs again (a forward's parameters, a backward's saved
    activations): on a GPU they must fit in half the free memory, else the regions' verdicts
    stand and the report says why."""
    from fusegraph.torch import graph_floor

    inputs = [torch.empty(256, 1024), torch.empty(1024)]  # 1 MiB + 4 KiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, 1 << 30))
    why = graph_floor.room(inputs, torch.device("cuda", 0))
    assert "over half of the" in why and "GiB free" in why, why
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 1 << 30))
    assert graph_floor.room(inputs, torch.device("cuda", 0)) == ""
    assert graph_floor.room(inputs, torch.device("cpu")) == ""
