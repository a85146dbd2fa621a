"""A Dynamo graph in which fusegraph's trace kept no region is stored (in the region
verdicts' table: with the step check, eager timed against Inductor's own compile, the
"measured" winner; "concluded", no step timed, where the check does not run): the next
compile of the same graph, options, mode, device and library versions goes straight to
Inductor's own compile, without fusegraph's trace (no region claimed, nothing converted).
Here regions lose (or win) on a virtual clock, Inductor's own taking the step's tie with
eager; the trace is detected by counting the backend's claiming calls."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch.compile backend needs torch")

import torch.nn as nn  # noqa: E402
from test_torch_graph_floor import clock  # noqa: E402, F401  (the virtual clock fixture)
from test_torch_incumbent_path import (  # noqa: E402, F401  (fixtures and helpers)
    FLOOR,
    LNBlock,
    _side_by_side,
    graphs,
    regions_lose,
)
from test_torch_step_floor import step_clock  # noqa: E402, F401  (the step check's forced timer)

from fusegraph.torch import compile_backend, step_floor  # noqa: E402
from fusegraph.torch.compile_backend import INDUCTORS_OWN, STORED_OWN, collecting, fusegraph_backend  # noqa: E402


@pytest.fixture
def claims(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The kind ("fw"/"bw") of every ATen graph the backend claimed regions in."""
    seen: list[str] = []
    real = compile_backend._claim

    def counting(gm: Any, opts: Any, kind: str, *args: Any, **kwargs: Any) -> Any:
        seen.append(kind)
        return real(gm, opts, kind, *args, **kwargs)

    monkeypatch.setattr(compile_backend, "_claim", counting)
    return seen


def _dynamo() -> list[dict[str, Any]]:
    """The Dynamo graphs' verdicts: "concluded" ones and the step check's."""
    from fusegraph.regions.verdicts import VerdictStore

    path = VerdictStore().path
    table = json.loads(path.read_text()) if path.exists() else {}
    return [v for v in table.values() if v.get("source") == "concluded" or v.get("engine") == step_floor.ENGINE]


def _infer(model: nn.Module, x: Any, options: dict[str, Any], dynamic: bool = False) -> tuple[Any, list[Any]]:
    """A fresh Dynamo compile of ``model`` run once without gradients: its output and rows."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=partial(fusegraph_backend, options=options))
    x = x.clone()
    if dynamic:
        torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad(), collecting() as rows:
        out = compiled(x)
    return out, rows


@pytest.mark.usefixtures("regions_lose")
def test_the_second_compile_skips_fusegraphs_trace(request: pytest.FixtureRequest, claims: list[str]) -> None:
    """Training step: the first compile traces and claims (both graphs), finds nothing kept
    and stores it; the second claims nothing, lowers Inductor's own ATen graphs and gives
    Inductor's loss and gradients bit for bit; its rows say why and where the verdict is."""
    seen: list[str] = request.getfixturevalue("graphs")
    (_, _), (_, _), rows = _side_by_side(LNBlock, (2, 8, 32), seen, FLOOR)
    assert sorted(claims) == ["bw", "fw"], claims
    assert rows and all(r.why.endswith(INDUCTORS_OWN) for r in rows), rows[:3]
    assert all(step_floor.OWN_WON in r.why and "eager 2.000 ms" in r.why for r in rows), rows[0].why
    stored = _dynamo()
    assert len(stored) == 1 and stored[0]["source"] == "measured" and not stored[0]["fusegraph"], stored
    assert stored[0]["incumbent"] == step_floor.NAMES["own"] and stored[0]["fusegraph_ms"] is None, stored
    claims.clear()
    (want, want_graphs), (got, got_graphs), rows = _side_by_side(LNBlock, (2, 8, 32), seen, FLOOR)
    assert claims == [], claims
    assert len(want_graphs) == 2 and got_graphs == want_graphs
    assert got[2] == want[2]  # the same tensors saved for the backward
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a, b), float((a - b).abs().max())
    from fusegraph.regions.verdicts import VerdictStore

    path = str(VerdictStore().path)
    assert rows and all(r.where == "inductor" and r.why.startswith(STORED_OWN) for r in rows), rows[:3]
    assert all(path in r.why and "cached" in r.why for r in rows), rows[0].why
    assert any("layer_norm" in r.op for r in rows), [r.op for r in rows]  # the Dynamo graph's calls
    assert len(_dynamo()) == 1


@pytest.mark.usefixtures("regions_lose")
def test_what_changes_the_key_traces_again(claims: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Inference: a new shape, a new margin, new library versions each trace (and store)
    again; the floor off ignores the stored verdict and claims; a dynamic batch has one key."""
    model = LNBlock().eval()
    x = torch.randn(2, 8, 32)
    want = model(x).detach()
    out, _ = _infer(model, x, FLOOR)
    assert claims == ["fw"] and torch.equal(out, torch.compile(model)(x).detach()) and len(_dynamo()) == 1
    assert float((out - want).norm() / want.norm()) < 1e-5
    for changed in (lambda: _infer(model, torch.randn(3, 8, 32), FLOOR),
                    lambda: _infer(model, x, {**FLOOR, "margin": 0.5})):
        claims.clear()
        changed()
        assert claims == ["fw"], claims
    assert len(_dynamo()) == 3
    claims.clear()
    _, rows = _infer(model, x, FLOOR)
    assert claims == [] and all(r.why.startswith(STORED_OWN) for r in rows)

    from fusegraph.select import tuning_db

    real = tuning_db.engine_versions
    monkeypatch.setattr(tuning_db, "engine_versions", lambda engines: {**real(engines), "fusegraph": "99.0"})
    _infer(model, x, FLOOR)
    assert claims == ["fw"], claims
    monkeypatch.setattr(tuning_db, "engine_versions", real)

    claims.clear()
    out, rows = _infer(model, x, {"floor": False})
    assert claims == ["fw"] and any(r.fusegraph for r in rows)
    assert not any(r.why.startswith(STORED_OWN) for r in rows)
    assert float((out - want).norm() / want.norm()) < 1e-5

    claims.clear()
    _infer(model, torch.randn(4, 8, 32), FLOOR, dynamic=True)
    assert claims == ["fw"]
    claims.clear()
    out, rows = _infer(model, torch.randn(5, 8, 32), FLOOR, dynamic=True)
    assert claims == [] and rows and all(r.why.startswith(STORED_OWN) for r in rows)
    assert out.shape == (5, 8, 32)


@pytest.mark.usefixtures("clock")
def test_a_graph_that_keeps_regions_stores_nothing(request: pytest.FixtureRequest, tmp_path: Any,
                                                   monkeypatch: pytest.MonkeyPatch, claims: list[str]) -> None:
    """Every region wins alone and the whole graph with them (the virtual clock: the unclaimed
    graph made slower): no "no region kept" is stored, the next compile traces and claims
    again (the step check, step_floor.py, made to keep the trace, stores that). Handed back
    at the graph level (the unclaimed graph the faster), the step check times eager against
    Inductor's own compile and stores Inductor's own."""
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    step = request.getfixturevalue("step_clock")
    step["trace_ms"], step["own_ms"] = 1.0, 2.0
    state: Callable[[], Any] = request.getfixturevalue("clock").__setitem__  # type: ignore[assignment]
    state("graph_extra", 100.0)
    model = LNBlock().eval()
    x = torch.randn(2, 8, 32)
    want = model(x).detach()
    options = {**FLOOR, "warmup_s": 0.0}
    for _ in range(2):
        claims.clear()
        out, rows = _infer(model, x, options)
        assert claims == ["fw"] and any(r.fusegraph for r in rows)
        assert float((out - want).norm() / want.norm()) < 1e-5
        assert [v["fusegraph"] for v in _dynamo()] == [True]
    state("graph_extra", 0.0)
    torch._dynamo.reset()
    _, rows = _infer(copy.deepcopy(model), torch.randn(3, 8, 32), options)
    assert rows and not any(r.fusegraph for r in rows)
    assert any("handed back with the whole graph" in r.why for r in rows)
    assert sorted(v["fusegraph"] for v in _dynamo()) == [False, True]
    # timed twice by the first compile (before the trace, then with it), not by the second
    # (the stored verdict), once by the third (before the trace, which then kept nothing)
    assert step["calls"] == 3 and step["backward"] == {"own": False, "eager": False, "trace": False}


@pytest.mark.usefixtures("regions_lose")
def test_a_failed_first_pass_stores_nothing(claims: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever breaks the first pass, nothing is concluded: the next compile traces again."""
    def broken(*args: Any) -> Any:
        raise RuntimeError("made to fail in this test")

    monkeypatch.setattr(compile_backend, "_stored_hand_back", broken)
    model = LNBlock().eval()
    x = torch.randn(2, 8, 32)
    out, _ = _infer(model, x, FLOOR)
    assert claims == ["fw", "fw"], claims  # the failed pass, then the single trace
    assert _dynamo() == []
    want = model(x).detach()
    assert float((out - want).norm() / want.norm()) < 1e-5
