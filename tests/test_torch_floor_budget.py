"""The region floor's budget over one Dynamo graph's compile (fusegraph/torch/floor_budget.py,
option ``budget``): past it a region without a stored verdict is neither built
nor measured, runs Inductor's code and is reported unmeasured; where no region was
measured, or one won, nothing of that compile is stored as final, so a later compile
measures what was left (and stores its verdict whatever it leaves). Regions win alone here by 6 ms
(tests/test_torch_graph_floor.py's virtual clock); the step's times are forced
(tests/test_torch_step_floor.py)."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch.compile backend needs torch")

from test_torch_graph_floor import clock  # noqa: E402, F401  (the virtual clock fixture)
from test_torch_incumbent_path import FLOOR, LNBlock, _rel  # noqa: E402
from test_torch_step_floor import step_clock  # noqa: E402, F401  (the step check's forced timer)

from fusegraph.errors import OptionError  # noqa: E402
from fusegraph.torch import partition  # noqa: E402
from fusegraph.torch.compile_backend import collecting, fusegraph_backend  # noqa: E402
from fusegraph.torch.floor_budget import AUTO_MIN_S, AUTO_SHARE, FloorBudget, budget_for  # noqa: E402
from fusegraph.torch.partition import Options  # noqa: E402

OPTIONS = {**FLOOR, "warmup_s": 0.0}
CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it
CPU = torch.device("cpu")


@pytest.mark.parametrize("good", ["auto", None, 0, 2.5])
def test_budget_option_accepts(good: Any) -> None:
    assert Options.of({"budget": good}).budget == good


@pytest.mark.parametrize("bad", ["soon", -1, True, [3]])
def test_budget_option_refuses_with_its_name(bad: Any) -> None:
    with pytest.raises(ValueError, match="budget") as err:
        Options.of({"budget": bad})
    assert isinstance(err.value, OptionError)


def test_auto_bounds_a_gpu_compile_by_inductors_own() -> None:
    auto = Options.of({})
    assert budget_for(auto, CUDA, 40.0) == FloorBudget(AUTO_SHARE * 40.0)
    assert budget_for(auto, CUDA, 1.0) == FloorBudget(AUTO_MIN_S)  # never below the minimum
    assert budget_for(auto, CUDA, None) is None  # Inductor's own was not compiled first: unbounded
    assert budget_for(auto, CPU, 40.0) is None  # no compile-time bound on the CPU
    assert budget_for(Options.of({"budget": 3}), CPU, None) == FloorBudget(3.0)  # given: everywhere
    assert budget_for(Options.of({"budget": None}), CUDA, 40.0) is None
    assert budget_for(Options.of({"floor": False, "budget": 3}), CUDA, 40.0) is None  # nothing measured


def test_a_budget_is_spent_once_over_its_graphs() -> None:
    b = FloorBudget(2.0)
    b.spent_s += 1.5
    assert b.left_s == pytest.approx(0.5)
    b.spent_s += 1.5
    assert b.left_s == 0.0


def _compile(model: Any, x: Any, options: dict[str, Any]) -> tuple[Any, list[Any]]:
    torch._dynamo.reset()
    with torch.no_grad(), collecting() as rows:
        got = torch.compile(model, backend=partial(fusegraph_backend, options=options))(x)
    return got, rows


def _counted(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], list[str]]:
    """The step check's forced times (regions can win: the bound is 3 ms) and a list of the
    plans built."""
    step: dict[str, Any] = request.getfixturevalue("step_clock")
    step["own_ms"], step["eager_ms"], step["trace_ms"] = 100.0, 200.0, 50.0
    built: list[str] = []
    real_build = partition.PLANS.get

    def counted(key: Any, *args: Any, **kwargs: Any) -> Any:
        built.append(str(key))
        return real_build(key, *args, **kwargs)

    monkeypatch.setattr(partition.PLANS, "get", counted)
    return step, built


def test_a_spent_budget_leaves_regions_to_a_later_compile(request: pytest.FixtureRequest,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """budget=0: every region runs Inductor's code unmeasured (no plan built, none measured),
    the output is Inductor's own; the next compile, unbounded, measures them and keeps them.
    Were the first compile's verdict stored, the second would go straight to Inductor's own."""
    _, built = _counted(request, monkeypatch)
    model = LNBlock().eval()
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        want = torch.compile(model)(x)
    got, rows = _compile(model, x, {**OPTIONS, "budget": 0})
    regions = [r for r in rows if r.region is not None]
    assert regions and not any(r.fusegraph for r in rows)
    assert all("budget (0 s) was spent" in r.why and "unmeasured" in r.why for r in regions), regions[0].why
    assert not built  # nothing built for them
    assert torch.equal(got, want)
    built.clear()
    got, rows = _compile(model, x, {**OPTIONS, "budget": None})
    kept = [r for r in rows if r.fusegraph]
    assert kept and not any("budget" in r.why for r in rows), [r.why for r in rows]
    assert built
    assert _rel(got, want) < 1e-5


def test_measuring_is_spread_over_two_compiles_at_most(request: pytest.FixtureRequest,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A second compile that leaves regions unmeasured too has its verdict stored, its rows
    saying no later compile measures them; a third compile is Inductor's own at once, with
    no trace, no build and no step timing (until a verdict is stored, each compile traced
    the graph and spent the budget again)."""
    from fusegraph.torch.compile_backend import NOT_MEASURED
    from fusegraph.torch.dynamo_verdict import STORED_OWN

    step, built = _counted(request, monkeypatch)
    model = LNBlock().eval()
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        want = torch.compile(model)(x)
    whys = []
    for _ in range(2):
        got, rows = _compile(model, x, {**OPTIONS, "budget": 0})
        assert torch.equal(got, want) and not any(r.fusegraph for r in rows)
        whys.append({r.why for r in rows if r.region is not None})
    assert all("unmeasured" in w and "a later session (or compile) measures it" in w for w in whys[0]), whys[0]
    assert all("unmeasured" in w and NOT_MEASURED in w for w in whys[1]), whys[1]
    timed = step["calls"]
    got, rows = _compile(model, x, {**OPTIONS, "budget": 0})
    assert torch.equal(got, want)
    assert rows and all(STORED_OWN in r.why for r in rows), {r.why for r in rows}
    assert step["calls"] == timed  # nothing timed: the stored verdict decides
    assert not built


def test_where_no_measured_region_won_the_first_compiles_verdict_is_stored(request: pytest.FixtureRequest,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Regions measured (here stored by an earlier model's compile) and all losing, others
    left unmeasured by the budget: the compile's verdict is stored at once, its unmeasured
    rows saying so, and the next compile is Inductor's own; no second compile traces the
    graph to measure regions unlikely to win (none of five benchmark models' did on an H200)."""
    from torch import nn

    from fusegraph.torch.compile_backend import NONE_WON
    from fusegraph.torch.dynamo_verdict import STORED_OWN

    step: dict[str, Any] = request.getfixturevalue("step_clock")
    step["own_ms"], step["eager_ms"], step["trace_ms"] = 100.0, 200.0, 50.0
    state: dict[str, float] = request.getfixturevalue("clock")
    # every region's incumbent costs 1 against the region call's 3: every region loses
    monkeypatch.setattr(partition, "_incumbent_call",
                        lambda region, inputs, opts: lambda: state.__setitem__("now", state["now"] + 1.0))
    x = torch.randn(2, 8, 32)
    _, rows = _compile(LNBlock().eval(), x, {**OPTIONS, "budget": None})  # its regions measured, stored
    assert any(r.region is not None for r in rows) and not any(r.fusegraph for r in rows)
    model = nn.Sequential(LNBlock(), nn.Linear(32, 48)).eval()  # the same regions, and a new one
    with torch.no_grad():
        want = torch.compile(model)(x)
    got, rows = _compile(model, x, {**OPTIONS, "budget": 0})
    assert _rel(got, want) < 1e-5
    left = [r for r in rows if r.region is not None and "unmeasured" in r.why]
    assert left and all(NONE_WON in r.why for r in left), [r.why for r in left]
    assert any(r.region is not None and "cached" in r.why for r in rows), [r.why for r in rows]
    timed = step["calls"]
    got, rows = _compile(model, x, {**OPTIONS, "budget": 0})
    assert rows and all(STORED_OWN in r.why for r in rows), {r.why for r in rows}
    assert step["calls"] == timed and _rel(got, want) < 1e-5


def test_an_unmeasured_row_names_the_whole_budget(request: pytest.FixtureRequest,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The screen spends the budget first and the chooser gets what it left: the rows of the
    regions neither reached name the budget given (it read "0 s", what was left)."""
    _counted(request, monkeypatch)
    _, rows = _compile(LNBlock().eval(), torch.randn(2, 8, 32), {**OPTIONS, "budget": 0.001})
    left = [r for r in rows if r.region is not None and "unmeasured" in r.why]
    assert left and all("budget (0.001 s) was spent" in r.why for r in left), [r.why for r in left]
