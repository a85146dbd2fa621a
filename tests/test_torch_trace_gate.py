"""A trace that cannot win is not compiled (fusegraph/torch/compile_backend.py,
step_floor.trace_cannot_win): with the floor on and no CUDA graphs, Inductor's own compile
and eager are timed as a step first; an ATen graph of fusegraph's trace whose claimed
regions, with those claimed before it, save no more than the margin of the faster side's
step is then neither compiled nor checked whole, and the rows say why. Every region wins
alone here by 6 ms (tests/test_torch_graph_floor.py's virtual clock: 3 ms against 9); the
step's times are forced (tests/test_torch_step_floor.py's timer), which moves the bound."""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch.compile backend needs torch")

from test_torch_graph_floor import clock  # noqa: E402, F401  (the virtual clock fixture)
from test_torch_incumbent_path import (  # noqa: E402, F401  (fixtures and helpers)
    FLOOR,
    LNBlock,
    _rel,
    _side_by_side,
    graphs,
)
from test_torch_step_floor import step_clock  # noqa: E402, F401  (the step check's forced timer)

from fusegraph.regions.verdicts import Verdict  # noqa: E402
from fusegraph.torch import ddp_split, step_choice, step_floor  # noqa: E402
from fusegraph.torch.compile_backend import INDUCTORS_OWN, collecting, fusegraph_backend  # noqa: E402

OPTIONS = {**FLOOR, "warmup_s": 0.0}
GAIN_MS = 6.0  # what each region saves on the virtual clock


@pytest.fixture
def trace_compiles(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """``is_backward`` of each ATen graph fusegraph's trace compiled (Inductor's own compile
    of the Dynamo graph does not pass through here)."""
    from torch._inductor import compile_fx as inductor

    seen: list[bool] = []
    real = inductor.compile_fx_inner

    def spy(gm: Any, inputs: Any, **kw: Any) -> Any:
        seen.append(bool(kw.get("is_backward")))
        return real(gm, inputs, **kw)

    monkeypatch.setattr(inductor, "compile_fx_inner", spy)
    return seen


def _set_best(step: dict[str, Any], ms: float) -> None:
    """Inductor's own the faster side at ``ms`` (eager slower); the trace faster than both."""
    step["own_ms"], step["eager_ms"], step["trace_ms"] = ms, 2 * ms, ms / 2


def _gated(rows: list[Any]) -> list[Any]:
    return [r for r in rows if "not compiled: the regions claimed save" in r.why]


def _saved(why: str) -> float:
    found = re.search(r"save ([0-9.]+) ms together", why)
    assert found, why
    return float(found.group(1))


def test_the_bound_is_the_margin_of_the_faster_side() -> None:
    best = Verdict(False, "measured", "", step_floor.ENGINE, None, 10.0, "eager")
    assert step_floor.trace_cannot_win(0.3, best, 0.03)  # 0.3 ms <= 3% of 10 ms
    assert "eager" in step_floor.trace_cannot_win(0.3, best, 0.03)
    assert not step_floor.trace_cannot_win(0.31, best, 0.03)
    assert not step_floor.trace_cannot_win(float("inf"), best, 0.03)  # a region claimed unmeasured
    unmeasured = Verdict(False, "concluded", "", step_floor.ENGINE, None, None, "eager")
    assert not step_floor.trace_cannot_win(0.0, unmeasured, 0.03)


def test_inference_whose_regions_save_too_little_compiles_no_trace(
        trace_compiles: list[bool], tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
        request: pytest.FixtureRequest) -> None:
    """Three forward regions (18 ms saved) against a 1000 ms step (bound 30 ms): the forward
    is not compiled, Inductor's own runs bit for bit, timed once; against a 100 ms step
    (bound 3 ms) the same trace is compiled and kept."""
    step: dict[str, Any] = request.getfixturevalue("step_clock")
    model = LNBlock().eval()
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        want = torch.compile(model)(x)
    for best, kept in ((1000.0, False), (100.0, True)):
        _set_best(step, best)
        step["calls"] = 0
        trace_compiles.clear()
        monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path / str(best)))  # no verdict of the other
        torch._dynamo.reset()
        with torch.no_grad(), collecting() as rows:
            got = torch.compile(model, backend=partial(fusegraph_backend, options=OPTIONS))(x)
        gated = _gated(rows)
        if kept:
            assert not gated and any(r.fusegraph for r in rows) and trace_compiles, [r.why for r in rows]
            assert step["calls"] == 2 and _rel(got, want) < 1e-5
            continue
        assert torch.equal(got, want) and not trace_compiles and step["calls"] == 1, step
        assert gated and not any(r.fusegraph for r in rows)
        regions = {r.region for r in gated}
        assert all(_saved(r.why) == pytest.approx(GAIN_MS * len(regions)) for r in gated), gated[0].why
        assert all(f"({step_floor.NAMES[step_floor.OWN]}) takes {best:.3f} ms" in r.why and r.where == "inductor" for r in gated)
        assert all(r.why.endswith(INDUCTORS_OWN) for r in rows)  # and who runs it


@pytest.mark.parametrize("best", [1500.0, 2500.0])
def test_training_counts_the_forward_and_backward_together(
        best: float, trace_compiles: list[bool], request: pytest.FixtureRequest) -> None:
    """The forward's regions alone save too little; with the backward's (bound 45 ms) they
    do not: the forward is skipped, the backward compiled, the Dynamo graph traced again
    with every graph compiled, and the trace kept. With a bound above both (75 ms) nothing
    of the trace is compiled: the step is Inductor's own, its ATen graphs and gradients."""
    step: dict[str, Any] = request.getfixturevalue("step_clock")
    seen: list[str] = request.getfixturevalue("graphs")
    _set_best(step, best)
    (want, want_graphs), (got, got_graphs), rows = _side_by_side(LNBlock, (2, 8, 32), seen, OPTIONS)
    fw = {r.region for r in rows if r.node.startswith("fw") and r.region is not None}
    bw = {r.region for r in rows if r.node.startswith("bw") and r.region is not None}
    assert fw and bw and GAIN_MS * len(fw) <= 0.03 * 1500.0 < GAIN_MS * (len(fw) + len(bw)) <= 0.03 * 2500.0
    if best == 2500.0:
        assert not trace_compiles and step["calls"] == 1, (trace_compiles, step)
        assert got_graphs == want_graphs and got[2] == want[2] and torch.equal(got[0], want[0])
        for a, b in zip(got[1], want[1], strict=True):
            assert torch.equal(a, b)
        gated = _gated(rows)
        assert {r.node[:2] for r in gated} == {"fw", "bw"} and not any(r.fusegraph for r in rows)
        return
    # the first pass compiled the backward only (claimed, and unclaimed for its whole-graph
    # check), the second trace the forward too; then the three timed
    first_forward = trace_compiles.index(False)
    assert first_forward > 0 and all(trace_compiles[:first_forward]), trace_compiles
    assert step["calls"] == 2 and not _gated(rows)
    assert {r.node[:2] for r in rows if r.fusegraph} == {"fw", "bw"}
    assert all(step_floor.TRACE_WON in r.why for r in rows if r.fusegraph)
    assert abs(float(got[0]) - float(want[0])) < 1e-5 * want[3]


def test_no_step_is_timed_where_ddp_reads_the_first_call() -> None:
    """DDP's graph split (torch/_dynamo/backends/distributed.py) sets the tracing context's
    ``fakify_first_call``: the compiled piece's first call must give it fake outputs, so the
    step check, which would make that call, does not run in the compile there: Inductor's own
    is compiled at once, uncalled, and the check waits for real calls (ddp_split.py)."""
    from torch._guards import TracingContext, tracing

    gm = torch.fx.symbolic_trace(lambda x: x * 2 + 1)
    inputs = [torch.randn(4)]
    assert step_floor.why_not(gm, inputs) == ""
    context = TracingContext(None)
    context.fakify_first_call = True
    with tracing(context):
        assert "DDP's graph split" in step_floor.why_not(gm, inputs)
        own_calls: list[int] = []

        def compile_own() -> Any:
            def own(*args: Any) -> Any:
                own_calls.append(1)
                return gm(*args)

            return own

        settled = step_choice.settle(gm, inputs, compile_own, gm.forward, margin=0.03, warmup_s=0.0)
        fn = settled.fn
        assert settled.side == step_floor.OWN and settled.verdict is None, settled
        assert isinstance(fn, ddp_split.Deferred) and step_choice.pending(fn), fn
        assert not own_calls and fn.candidates[step_floor.OWN].__name__ == "own"
        # step_floor's own settle, called there, times nothing and runs Inductor's own
        settled = step_floor.settle(gm, inputs, compile_own, gm.forward, margin=0.03, warmup_s=0.0)
        assert settled.side == step_floor.OWN and settled.verdict is None and not own_calls
        assert settled.fn.__name__ == "own"
