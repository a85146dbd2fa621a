"""The cold compile's region floor (issue 23: compile time no longer than Inductor's): a
region whose fusegraph plan takes ``screen`` times as long as its ATen ops run eagerly or
more is decided without compiling Inductor's code for it (partition._screen), with both
times in its row and its verdict stored; one content key is screened once; ``screen=0``
compiles every region as before; and the compile's phases are collected (phases.py).

Times come from a virtual clock (this machine's load would drown real microseconds): a
region call, the eager ops and Inductor's code each add a fixed cost, so every decision is
known in advance and each test has a control that flips it. The unclaimed rest runs eagerly
and no real Inductor compile runs (one costs seconds a region here): the incumbent's compile
is counted, not done."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch.compile backend needs torch")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from test_torch_compile import virtual_timing  # noqa: E402

from fusegraph.select import timing  # noqa: E402
from fusegraph.torch import partition, phases, runtime  # noqa: E402
from fusegraph.torch.explainer import explain  # noqa: E402

ONLY_REGIONS = {"floor": True, "rest": "eager", "whole_graph": False}


class Twin(nn.Module):
    """Two linear + bias + ReLU layers of one shape (one region content key), then a third of
    another shape."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.c = nn.Linear(16, 8)

    def forward(self, x: Any) -> Any:
        return self.c(F.relu(self.b(F.relu(self.a(x)))))


class Clock:
    """Virtual milliseconds: the region call costs ``call``, the region's ATen ops run
    eagerly ``eager``, Inductor's code ``inductor``; its compiles and the eager incumbents
    made are counted by region content key."""

    def __init__(self, call: float, eager: float, inductor: float) -> None:
        self.now = 0.0
        self.call, self.eager, self.inductor = call, eager, inductor
        self.compiled: list[str] = []
        self.screened: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real_call = runtime.RegionRunner.__call__
        real_incumbent = partition._incumbent_call

        def costly(runner: Any, inputs: Any, sizes: Any) -> Any:
            self.now += self.call
            return real_call(runner, inputs, sizes)

        def incumbent(region: Any, inputs: Any, opts: Any) -> Any:
            eager = real_incumbent(region, inputs, opts.__class__(**{**opts.__dict__, "incumbent": "eager"}))
            cost = self.eager if opts.incumbent == "eager" else self.inductor
            (self.screened if opts.incumbent == "eager" else self.compiled).append(region.key)

            def run() -> Any:
                self.now += cost
                return eager()

            return run

        monkeypatch.setattr(runtime.RegionRunner, "__call__", costly)
        monkeypatch.setattr(partition, "_incumbent_call", incumbent)
        monkeypatch.setattr(timing, "time_candidates", virtual_timing(lambda: self.now))


def _regions(report: Any) -> list[Any]:
    rows = [r for r in report.rows if r.region is not None]
    assert rows, [r.why for r in report.rows]
    return rows


def _measured_keys(clock: Clock) -> set[str]:
    return set(clock.compiled) | set(clock.screened)


def test_a_region_slower_than_its_eager_ops_by_the_screen_compiles_no_inductor(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Region call 3 ms, its ATen ops eagerly 1 ms: 3x, over the screen's 1.5x. No Inductor
    compile runs, every region says why with both times, runs on Inductor (not claimed), and
    the model's outputs and gradients are eager's. Control: eager ops at 2.5 ms (1.2x) pass
    the screen, and every region is then compiled and measured against Inductor, once per
    content key."""
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path / "a"))
    clock = Clock(call=3.0, eager=1.0, inductor=0.5)
    clock.install(monkeypatch)
    model = Twin()
    x = torch.randn(4, 16)
    report = explain(model, x, options=ONLY_REGIONS, backward=True)
    rows = _regions(report)
    assert clock.compiled == [], "an Inductor compile ran for a screened region"
    screened = [r for r in rows if "screened" in r.why]
    assert screened and not any(r.fusegraph for r in report.rows), [r.why for r in rows]
    for r in screened:
        assert "fusegraph 3.0000 ms vs its ATen ops run eagerly (the screen) 1.0000 ms" in r.why, r.why
        assert "took 3.00x its ATen ops run eagerly (screen 1.5x)" in r.why, r.why
        assert r.where == "torch.eager", r.where  # the rest: here eager, by default Inductor
    assert len(clock.screened) == len(set(clock.screened)), "a content key was screened twice"
    keys = {json.dumps(v, sort_keys=True) for v in json.loads((tmp_path / "a" / "regions-verdicts.json").read_text()).values()}
    assert any("screened" in k for k in keys)
    # the outputs and gradients are eager's (fresh data, float32)
    twin = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend="fusegraph", options=ONLY_REGIONS)
    y = torch.randn(4, 16)
    got, want = compiled(y), model(y)
    got.square().sum().backward()
    want.square().sum().backward()
    assert not torch.isnan(got).any()
    assert float((got - want).detach().norm() / want.detach().norm()) < 1e-5
    for p, q in zip(twin.parameters(), model.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert float((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-30)) < 1e-5

    # control: 3 ms against 2.5 ms passes the screen; Inductor's code is compiled, once a key
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path / "b"))
    control = Clock(call=3.0, eager=2.5, inductor=0.5)
    control.install(monkeypatch)
    rows = _regions(explain(Twin(), x, options=ONLY_REGIONS, backward=True))
    assert control.compiled and len(control.compiled) == len(set(control.compiled))
    assert set(control.compiled) == set(control.screened)  # every screened key passed and was compiled
    assert not any("screened" in r.why for r in rows), [r.why for r in rows]
    assert all("fusegraph 3.0000 ms vs inductor 0.5000 ms" in r.why for r in rows if "measured" in r.why)


def test_one_content_key_is_screened_once_and_its_verdict_read_back(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Twin's two 16 -> 16 layers share a content key: screened once (the forward has fewer
    screens than regions). A second compile with the same cache reads the stored screen
    verdicts: nothing is timed or compiled again."""
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    clock = Clock(call=3.0, eager=1.0, inductor=0.5)
    clock.install(monkeypatch)
    rows = _regions(explain(Twin(), torch.randn(4, 16), options=ONLY_REGIONS, backward=False))
    regions = {r.region for r in rows}
    assert clock.screened and len(clock.screened) < len(regions), (clock.screened, regions)
    assert len(clock.screened) == len(set(clock.screened))
    again = Clock(call=3.0, eager=1.0, inductor=0.5)
    again.install(monkeypatch)
    torch._dynamo.reset()
    rows = _regions(explain(Twin(), torch.randn(4, 16), options=ONLY_REGIONS, backward=False))
    assert again.screened == [] and again.compiled == []
    assert all("cached" in r.why and "screened" in r.why for r in rows if "screened" in r.why)
    assert any("screened" in r.why for r in rows)


def test_screen_zero_compiles_every_region_against_inductor(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``screen=0``: no eager timing, every buildable region measured against Inductor's code
    (as before the screen), with the same 3x gap that the screen would have caught."""
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    clock = Clock(call=3.0, eager=1.0, inductor=0.5)
    clock.install(monkeypatch)
    rows = _regions(explain(Twin(), torch.randn(4, 16), options={**ONLY_REGIONS, "screen": 0}, backward=True))
    assert clock.screened == [] and clock.compiled
    assert not any("screened" in r.why for r in rows)
    assert all("vs inductor 0.5000 ms" in r.why for r in rows if "measured" in r.why), [r.why for r in rows]


def test_a_region_faster_than_inductor_is_still_kept(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The screen never decides for fusegraph: a call at 1 ms against eager ops at 2 ms
    passes it and is then measured against Inductor's code (3 ms): kept, with Inductor's time."""
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    clock = Clock(call=1.0, eager=2.0, inductor=3.0)
    clock.install(monkeypatch)
    report = explain(Twin(), torch.randn(4, 16), options=ONLY_REGIONS, backward=False)
    kept = [r for r in _regions(report) if r.fusegraph]
    assert kept and all("fusegraph 1.0000 ms vs inductor 3.0000 ms" in r.why for r in kept), [r.why for r in kept]
    assert clock.compiled


def test_no_screen_where_eager_is_the_incumbent(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``incumbent="eager"``: the region's ATen ops are the incumbent itself, so there is no
    Inductor compile to spare and no screen: each region is measured once, against eager,
    with the same 3x gap."""
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    clock = Clock(call=3.0, eager=1.0, inductor=0.5)
    clock.install(monkeypatch)
    rows = _regions(explain(Twin(), torch.randn(4, 16), options={**ONLY_REGIONS, "incumbent": "eager"}, backward=True))
    assert clock.compiled == []
    assert not any("screened" in r.why for r in rows), [r.why for r in rows]
    measured = [r for r in rows if "measured" in r.why]
    assert measured and all("fusegraph 3.0000 ms vs eager 1.0000 ms" in r.why for r in measured), [r.why for r in measured]
    assert len(clock.screened) == len(set(clock.screened))  # one measurement a content key


@pytest.mark.parametrize("bad", [-1, "fast", None])
def test_the_screen_option_is_checked(bad: Any) -> None:
    with pytest.raises(ValueError, match="screen"):
        partition.Options.of({"screen": bad})


def test_the_compile_phases_are_collected(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inclusive seconds per phase: the region floor holds its screen and plan builds; with
    no collector open nothing is kept."""
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    Clock(call=3.0, eager=1.0, inductor=0.5).install(monkeypatch)
    with phases.compile_phases() as seconds:
        explain(Twin(), torch.randn(4, 16), options=ONLY_REGIONS, backward=True)
    assert {phases.REGION_FLOOR, phases.SCREEN, phases.BUILDS} <= set(seconds), seconds
    assert seconds[phases.REGION_FLOOR] >= seconds[phases.SCREEN] > 0
    assert seconds[phases.REGION_FLOOR] >= seconds[phases.BUILDS] > 0
    with phases.phase(phases.OWN):
        pass
    assert phases.OWN not in seconds
