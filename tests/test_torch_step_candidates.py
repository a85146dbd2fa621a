"""Eager among the step check's candidates (fusegraph/torch/step_floor.py, issue 23): with
the floor on and no CUDA graphs, a Dynamo graph runs the fastest of Inductor's own compile,
eager (the Dynamo graph module as it is, as ``backend="eager"`` runs it) and fusegraph's
trace where it kept regions. The step's verdict is forced by tests/test_torch_step_floor.py's
timer (each test says which side wins; regions win or lose on the virtual clocks of
tests/test_torch_graph_floor.py and tests/test_torch_incumbent_path.py); one test runs the
check on the real clock and asserts agreement only."""

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
    ConvBN,
    LNBlock,
    _rel,
    _step,
    graphs,
    regions_lose,
)
from test_torch_step_floor import step_clock, step_timer  # noqa: E402, F401  (the step check's forced timer)

from fusegraph.regions.report import Report  # noqa: E402
from fusegraph.regions.verdicts import Verdict  # noqa: E402
from fusegraph.torch import compile_backend, step_floor  # noqa: E402
from fusegraph.torch.compile_backend import (  # noqa: E402
    INDUCTORS_OWN,
    NO_REGION_EAGER,
    STORED_EAGER,
    collecting,
    fusegraph_backend,
)

OPTIONS = {**FLOOR, "warmup_s": 0.0}


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """What each compile of the backend did: ``claims`` the ATen graphs fusegraph's trace
    claimed regions in ("fw"/"bw"), ``inductor`` one entry per ``compile_fx`` call of the
    backend (its trace and Inductor's own compile alike)."""
    from torch._inductor import compile_fx as inductor

    seen: dict[str, list[str]] = {"claims": [], "inductor": []}
    real_claim, real_compile = compile_backend._claim, inductor.compile_fx

    def claim(gm: Any, opts: Any, kind: str, *args: Any, **kwargs: Any) -> Any:
        seen["claims"].append(kind)
        return real_claim(gm, opts, kind, *args, **kwargs)

    def compile_fx(*args: Any, **kwargs: Any) -> Any:
        seen["inductor"].append("compile_fx")
        return real_compile(*args, **kwargs)

    monkeypatch.setattr(compile_backend, "_claim", claim)
    monkeypatch.setattr(inductor, "compile_fx", compile_fx)
    return seen


def _capturing(returned: list[tuple[Any, Any]], options: dict[str, Any] = OPTIONS,
               mode: str | None = None) -> Callable[..., Any]:
    """The backend, each Dynamo graph and the callable returned for it kept in ``returned``."""
    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        fn = fusegraph_backend(gm, inputs, options=options, mode=mode)
        returned.append((gm, fn))
        return fn

    return backend


def _stored() -> list[dict[str, Any]]:
    from fusegraph.regions.verdicts import VerdictStore

    path = VerdictStore().path
    table = json.loads(path.read_text()) if path.exists() else {}
    return [v for v in table.values() if v.get("source") == "concluded" or v.get("engine") == step_floor.ENGINE]


def _train(make: Callable[[], nn.Module], shape: tuple[int, ...], backend: Any) -> tuple[Any, Any, list[Any]]:
    """One training step of a fresh model under ``backend`` and of its eager twin, on the
    same fresh data: ((loss, gradients, saved count, scale) per side, the rows)."""
    model = make()
    twin = copy.deepcopy(model)
    x = torch.randn(shape)
    g = torch.randn(model(x).shape)
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend=backend)
    with collecting() as rows:
        got = _step(twin, compiled, x, g)
    return _step(model, model, x, g), got, rows


def _is_the_graph_module(fn: Any, gm: torch.fx.GraphModule) -> bool:
    """``fn`` is a Dynamo graph module's own forward, ``gm``'s code: nothing compiled."""
    module = getattr(fn, "__self__", None)
    return (isinstance(module, torch.fx.GraphModule) and getattr(fn, "__func__", None) is type(module).forward
            and module.code == gm.code)


def _close(want: Any, got: Any) -> None:
    """The loss within 1e-5 of its terms' scale, each gradient within 1e-4 relative."""
    assert abs(float(got[0]) - float(want[0])) <= 1e-5 * want[3], (got[0], want[0])
    for a, b in zip(got[1], want[1], strict=True):
        assert _rel(a, b) < 1e-4


def _clock(kept: bool, request: pytest.FixtureRequest, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The step's virtual clock: every region winning (the trace keeps them) or losing."""
    if kept:
        step: dict[str, Any] = request.getfixturevalue("step_clock")
        return step
    request.getfixturevalue("regions_lose")
    return step_timer(monkeypatch, tmp_path)


def _equal(want: Any, got: Any) -> None:
    """Eager's loss, gradients and saved-tensor count, bit for bit."""
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a, b), float((a - b).abs().max())
    assert got[2] == want[2], (got[2], want[2])


@pytest.mark.parametrize("kept", [True, False], ids=["regions-kept", "no-region"])
def test_eager_faster_runs_the_graph_module_and_a_second_compile_compiles_nothing(
        kept: bool, request: pytest.FixtureRequest, tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
        compiles: dict[str, list[str]]) -> None:
    """Eager forced the fastest, where the trace kept regions (every region winning) and
    where it kept none (every region losing): the compiled step is the Dynamo graph module,
    eager's loss and gradients bit for bit, every row on ``torch.eager`` (coverage 0). The
    second compile reads the verdict and calls neither Inductor nor fusegraph's trace."""
    step = _clock(kept, request, tmp_path, monkeypatch)
    step["eager_ms"] = 0.5
    returned: list[tuple[Any, Any]] = []
    want, got, rows = _train(ConvBN if kept else LNBlock, (4, 3, 8, 8) if kept else (2, 8, 32), _capturing(returned))
    # kept: Inductor's own and eager timed before the trace, then the three together
    assert step["calls"] == 1 + kept and step["backward"] == ({"own": True, "eager": True, "trace": True} if kept
                                                      else {"own": True, "eager": True}), step
    assert compiles["claims"] and compiles["inductor"] == ["compile_fx"] * 2  # the trace, Inductor's own
    assert len(returned) == 1 and _is_the_graph_module(returned[0][1], returned[0][0])
    _equal(want, got)
    assert rows and all(r.where == "torch.eager" and step_floor.EAGER_WON in r.why for r in rows), rows[0].why
    assert all("eager 0.500 ms vs Inductor's own compile 1.000 ms" in r.why for r in rows), rows[0].why
    assert kept or all(r.why.endswith(NO_REGION_EAGER) for r in rows), rows[0].why
    assert Report(tuple(rows)).coverage == 0.0
    stored = _stored()
    assert len(stored) == 1 and stored[0]["incumbent"] == "eager" and stored[0]["source"] == "measured", stored
    assert (stored[0]["fusegraph_ms"] == 2.0) == kept, stored
    # compiled again: the graph module itself, nothing traced, compiled or timed
    compiles["claims"].clear()
    compiles["inductor"].clear()
    returned.clear()
    want, got, rows = _train(ConvBN if kept else LNBlock, (4, 3, 8, 8) if kept else (2, 8, 32), _capturing(returned))
    assert step["calls"] == 1 + kept and compiles == {"claims": [], "inductor": []}, compiles
    gm, fn = returned[0]
    assert fn == gm.forward
    _equal(want, got)
    assert rows and all(r.where == "torch.eager" and r.why.startswith(STORED_EAGER) for r in rows), rows[0].why
    assert all("cached" in r.why for r in rows), rows[0].why


@pytest.mark.usefixtures("regions_lose")
def test_eager_faster_serves_a_dynamic_batch_under_autocast(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inference under ``mark_dynamic`` and bf16 autocast, nothing kept, eager forced the
    fastest: timed once at the first batch's size, every batch then eager's output bit for
    bit with no recompile."""
    step = step_timer(monkeypatch, tmp_path)
    step["eager_ms"] = 0.5
    model = LNBlock().eval()
    returned: list[tuple[Any, Any]] = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=_capturing(returned))
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16), collecting() as rows:
        for b in (2, 3, 5):
            x = torch.randn(b, 8, 32)
            torch._dynamo.mark_dynamic(x, 0)
            got = compiled(x)
            want = model(x)
            assert got.dtype == want.dtype and torch.equal(got, want), b
    assert step["calls"] == 1 and step["backward"] == {"own": False, "eager": False}, step
    assert len(returned) == 1 and _is_the_graph_module(returned[0][1], returned[0][0])
    assert rows and all(r.where == "torch.eager" for r in rows)


@pytest.mark.usefixtures("regions_lose")
def test_inductors_own_faster_than_eager_runs_it(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                 request: pytest.FixtureRequest) -> None:
    """Nothing kept, Inductor's own forced the fastest (eager 3 ms against 1): Inductor's own
    step bit for bit, the rows give both times; eager within the margin of Inductor's own
    (1.02 ms against 1) also leaves Inductor's own."""
    seen: list[str] = request.getfixturevalue("graphs")
    step = step_timer(monkeypatch, tmp_path)
    for eager_ms in (3.0, 1.02):
        step["eager_ms"] = eager_ms
        monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path / str(eager_ms)))
        model = LNBlock()
        x = torch.randn(2, 8, 32)
        g = torch.randn(2, 8, 32)
        sides = []
        for backend in ("inductor", partial(fusegraph_backend, options=OPTIONS)):
            twin = copy.deepcopy(model)
            torch._dynamo.reset()
            start = len(seen)
            with collecting() as rows:
                sides.append((_step(twin, torch.compile(twin, backend=backend), x, g), seen[start:]))
        (want, want_graphs), (got, got_graphs) = sides
        assert got_graphs == want_graphs
        _equal(want, got)
        times = f"Inductor's own compile 1.000 ms vs eager {eager_ms:.3f} ms"
        assert rows and all(r.where == "inductor" and times in r.why and r.why.endswith(INDUCTORS_OWN)
                            for r in rows), rows[0].why
    assert step["calls"] == 2


def test_the_trace_faster_than_eager_and_inductors_own_keeps_its_regions(request: pytest.FixtureRequest) -> None:
    """Regions kept and the trace forced the fastest of the three (1 ms, Inductor's own 2,
    eager 3): the regions run, the model right within float32 tolerances."""
    step: dict[str, Any] = request.getfixturevalue("step_clock")
    step["trace_ms"], step["own_ms"] = 1.0, 2.0
    want, got, rows = _train(LNBlock, (2, 8, 32), partial(fusegraph_backend, options=OPTIONS))
    claimed = [r for r in rows if r.fusegraph]
    assert claimed and all(step_floor.TRACE_WON in r.why and "eager 3.000 ms" in r.why for r in claimed)
    _close(want, got)


@pytest.mark.parametrize("kept", [True, False], ids=["regions-kept", "no-region"])
def test_reduce_overhead_times_no_step(kept: bool, request: pytest.FixtureRequest, tmp_path: Any,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``mode="reduce-overhead"`` (CUDA graphs: every side would be captured): no step is
    timed, eager is no candidate even where it would win; the trace stands where it kept
    regions, else Inductor's own compile (here on the CPU, where Inductor skips the capture)."""
    step = _clock(kept, request, tmp_path, monkeypatch)
    step["eager_ms"] = 0.5
    returned: list[tuple[Any, Any]] = []
    want, got, rows = _train(LNBlock, (2, 8, 32), _capturing(returned, mode="reduce-overhead"))
    assert step["calls"] == 0 and rows
    assert not any(step_floor.TIMED in r.why or r.where == "torch.eager" for r in rows), rows[0].why
    assert any(r.fusegraph for r in rows) == kept
    assert not _is_the_graph_module(returned[0][1], returned[0][0])
    _close(want, got)


@pytest.mark.parametrize("kept", [True, False], ids=["regions-kept", "no-region"])
def test_a_failing_eager_run_is_reported_and_loses(kept: bool, request: pytest.FixtureRequest, tmp_path: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager candidate raises inside its step (forced the fastest otherwise): it loses,
    the rows and the stored verdict say why, Inductor's own compile runs (the trace where
    it kept regions and beat Inductor's own)."""
    step = _clock(kept, request, tmp_path, monkeypatch)
    if kept:
        step["trace_ms"], step["own_ms"] = 1.0, 2.0
    step["eager_ms"] = 0.5
    real = step_floor.settle

    def broken_eager(gm: Any, inputs: Any, compile_own: Any, eager: Any, *args: Any, **kwargs: Any) -> Any:
        def fails(*a: Any) -> Any:
            eager(*a)
            raise RuntimeError("made to fail in this test")

        return real(gm, inputs, compile_own, fails, *args, **kwargs)

    monkeypatch.setattr(step_floor, "settle", broken_eager)
    model = LNBlock().eval()
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        want = torch.compile(model)(x)
        torch._dynamo.reset()
        with collecting() as rows:
            got = torch.compile(model, backend=partial(fusegraph_backend, options=OPTIONS))(x)
    assert step["calls"] == 1 + kept and "eager" not in step["backward"], step  # kept: timed before the trace too
    failed = "eager failed: RuntimeError: made to fail in this test"
    assert rows and all(failed in r.why for r in rows if r.fusegraph or not kept), rows[0].why
    if kept:
        assert any(r.fusegraph for r in rows) and _rel(got, want) < 1e-5
    else:
        assert all(r.where == "inductor" for r in rows) and torch.equal(got, want)
    stored = _stored()
    assert len(stored) == 1 and stored[0]["fusegraph"] == kept and failed in stored[0]["why"], stored


@pytest.mark.usefixtures("regions_lose")
def test_a_verdict_without_eager_is_checked_once(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                 compiles: dict[str, list[str]]) -> None:
    """A verdict under the key of before (no ``candidates``: stored before eager was a
    candidate) is not read: the graph is traced again. A "no region kept" stored where
    the step could not be timed is read, and eager is timed against Inductor's own once,
    without a trace; the third compile reads that and compiles nothing."""
    from fusegraph.regions.verdicts import Verdict
    from fusegraph.torch.partition import Options

    step = step_timer(monkeypatch, tmp_path)
    step["eager_ms"] = 0.5
    model = LNBlock().eval()
    x = torch.randn(2, 8, 32)
    captured: list[tuple[Any, Any]] = []

    def capture(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        captured.append((gm, list(inputs)))
        return gm.forward

    def run() -> list[Any]:
        torch._dynamo.reset()
        with torch.no_grad(), collecting() as rows:
            assert torch.equal(torch.compile(model, backend=partial(fusegraph_backend, options=OPTIONS))(x), model(x))
        return rows

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=capture)(x)
    gm, inputs = captured[0]
    concluded = Verdict(False, "concluded", "made in this test", incumbent=step_floor.NAMES["own"])
    with torch.no_grad():
        old = compile_backend.DynamoVerdict.of(gm, inputs, Options.of(OPTIONS), None, False)
        new = compile_backend.DynamoVerdict.of(gm, inputs, Options.of(OPTIONS), None, True)
    old.store.record(old.key, concluded)
    old.store.flush()
    run()
    assert compiles["claims"] == ["fw"] and step["calls"] == 1  # traced again: the old key is not read
    new.store.record(new.key, concluded)  # as where the check could not run
    new.store.flush()
    compiles["claims"].clear()
    compiles["inductor"].clear()
    rows = run()
    assert compiles["claims"] == [] and compiles["inductor"] == ["compile_fx"] and step["calls"] == 2, compiles
    assert rows and all(r.where == "torch.eager" and step_floor.EAGER_WON in r.why and "made in this test" in r.why
                        for r in rows), rows[0].why
    compiles["inductor"].clear()
    rows = run()
    assert compiles == {"claims": [], "inductor": []} and step["calls"] == 2, compiles
    assert rows and all(r.why.startswith(STORED_EAGER) for r in rows), rows[0].why


@pytest.mark.usefixtures("regions_lose")
def test_a_step_without_room_is_not_timed(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                          compiles: dict[str, list[str]], caplog: pytest.LogCaptureFixture) -> None:
    """Where the step cannot be timed (here: the device memory check made to refuse), nothing
    kept, Inductor's own compile runs and "no region kept" is stored, the log says why; the
    next compile reads it, traces nothing, tries the check again (still refused) and runs
    Inductor's own."""
    import logging

    from fusegraph.torch import graph_floor

    step = step_timer(monkeypatch, tmp_path)
    step["eager_ms"] = 0.5
    monkeypatch.setattr(graph_floor, "room", lambda *args, **kwargs: "no room (made in this test)")
    model = LNBlock().eval()
    x = torch.randn(2, 8, 32)
    outs = []
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="fusegraph.torch"):
        want = torch.compile(model)(x)
        for _ in range(2):
            torch._dynamo.reset()
            with collecting() as rows:
                outs.append(torch.compile(model, backend=partial(fusegraph_backend, options=OPTIONS))(x))
            assert rows and all(r.where == "inductor" for r in rows), rows[0].why
    assert step["calls"] == 0 and compiles["claims"] == ["fw"], (step, compiles)
    assert all(torch.equal(out, want) for out in outs)
    assert caplog.text.count("not timed against eager and Inductor's own compile: no room (made in this test)") == 2
    assert "a stored verdict found no region kept" in rows[0].why, rows[0].why
    stored = _stored()
    assert len(stored) == 1 and stored[0]["source"] == "concluded", stored

def test_the_check_on_the_real_clock_agrees_with_eager(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end on this machine's clock (regions measured against PyTorch eager, so no
    region costs an Inductor compile): whichever side wins, the training step agrees with
    eager, the rows name the side and give every candidate's step time, and the verdict is
    stored and read back by the next compile without timing again."""
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    # the compile-time verdict stored (loop_steps 0): close sides are otherwise weighed on
    # the loop's steps first (tests/test_torch_loop_trial.py), which two steps here do not end
    options = {"floor": True, "incumbent": "eager", "warmup_s": 0.02, "loop_steps": 0}
    timings: list[list[str]] = []
    real = step_floor._time

    def counted(candidates: Any, **kwargs: Any) -> Any:
        timings.append(sorted(candidates))
        return real(candidates, **kwargs)

    monkeypatch.setattr(step_floor, "_time", counted)
    for again in (False, True):
        want, got, rows = _train(LNBlock, (2, 8, 32), partial(fusegraph_backend, options=options))
        assert abs(float(got[0]) - float(want[0])) <= 1e-5 * want[3], (got[0], want[0])
        for a, b in zip(got[1], want[1], strict=True):
            assert _rel(a, b) < 1e-4
        assert len(timings) == 1 and set(timings[0]) >= {"own", "eager"}, timings
        stored = _stored()
        assert len(stored) == 1 and stored[0]["source"] == "measured", stored
        side = step_floor.winner(Verdict(**stored[0]))
        if side == "trace":
            assert any(r.fusegraph for r in rows)
        else:
            assert rows and all(r.where == step_floor.WHERE[side] for r in rows), (side, rows[0])
        if not again:
            assert all(f"{step_floor.NAMES[n]} " in stored[0]["why"] for n in timings[0]), stored
            assert all(step_floor.RUNS[side] in r.why for r in rows if r.fusegraph or side != "trace"), rows[0].why
        else:
            assert all("cached" in r.why for r in rows if r.fusegraph or side != "trace"), rows[0].why


def cuda_bf16_training_tracks_eager(steps: int, options: dict[str, Any], lr: float = 0.05) -> list[Any]:
    """conv + batch norm + ReLU, channels-last, bf16 autocast, ``steps`` SGD steps under eager
    and then compiled with ``options`` (the real clock): the compiled losses must track
    eager's within bf16 tolerance; the compiled run's report rows are returned. The caller
    sets the cache directory. The loss is linear in the outputs, so a long run at a large
    ``lr`` amplifies bf16's rounding differences between sides step after step."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    cuda = torch.device("cuda")
    model = ConvBN().to(cuda).to(memory_format=torch.channels_last)
    xs = [torch.randn(16, 3, 16, 16, device=cuda).to(memory_format=torch.channels_last) for _ in range(steps)]
    gs = [torch.randn(16, 10, device=cuda) for _ in range(steps)]
    losses: list[list[tuple[float, float]]] = []  # per step: the loss and its scale (sum of |term|)
    rows: list[Any] = []
    for compiled_side in (False, True):
        twin = copy.deepcopy(model)
        opt = torch.optim.SGD(twin.parameters(), lr=lr, momentum=0.9)
        torch._dynamo.reset()
        run = torch.compile(twin, backend=partial(fusegraph_backend, options=options)) if compiled_side else twin
        side = []
        with collecting() as seen:
            for x, g in zip(xs, gs, strict=True):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", torch.bfloat16):
                    terms = run(x).float() * g
                    loss = terms.sum()
                loss.backward()
                opt.step()
                side.append((float(loss.detach()), float(terms.detach().abs().sum())))
        losses.append(side)
        rows = seen
    for i, ((want, scale), (got, _)) in enumerate(zip(losses[0], losses[1], strict=True)):
        if abs(got - want) > 2e-2 * scale:
            pytest.fail(f"step {i}: loss {got} against eager's {want} (scale {scale}); eager {losses[0]}; "
                        f"compiled {losses[1]}")
    return rows


@pytest.mark.gpu
def test_on_cuda_bf16_channels_last_training_tracks_eager_whichever_side_wins(tmp_path: Any,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Three SGD steps as users compile it (floor on, real clock): the losses track eager's,
    whichever candidate the step check chose (the rows say which)."""
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    rows = cuda_bf16_training_tracks_eager(3, FLOOR)
    assert rows and any(step_floor.TIMED in r.why for r in rows), rows[0].why


def test_the_steps_run_on_copies_of_the_callers_values() -> None:
    """The step's inputs copy the examples' values where they hold some (random N(0, 1)
    weights pushed a CPU GELU backward into denormals, Inductor's side 2-3x slower than on
    the module's weights) and never alias them; a fake example gets random data, an
    expanded one (stride 0) a random stand-in of its layout."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    w = nn.Parameter(torch.randn(8, 4) * 0.01)
    x = torch.randn(3, 8)
    wide = torch.randn(4, 1).expand(4, 5)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.empty(2, 3))
    args = step_floor._fresh([w, x, wide, fake, 3])
    assert torch.equal(args[0], w.detach()) and args[0].requires_grad and args[0].is_leaf
    assert args[0].data_ptr() != w.data_ptr() and args[1].data_ptr() != x.data_ptr()
    assert torch.equal(args[1], x) and not args[1].requires_grad
    assert args[2].stride() == wide.stride() and args[2].data_ptr() != wide.data_ptr()
    assert type(args[3]) is torch.Tensor and args[3].shape == (2, 3) and float(args[3].abs().sum()) > 0
    assert args[4] == 3
    args[0].data.add_(1.0)
    assert float(w.detach().abs().max()) < 1.0  # the caller's weights untouched
