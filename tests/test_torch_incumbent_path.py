"""With nothing claimed, ``backend="fusegraph"`` (rest on Inductor) runs Inductor's own
compile of the Dynamo graph, not a trace of its own: fusegraph traces with the ops it
converts kept whole, which changed what AOTAutograd's partitioner saved for the backward
(a conv + batch norm net's forward saved more tensors than under Inductor) and cost a few
percent with nothing claimed. Here every region loses its measurement (a virtual clock:
the incumbent always faster), and the training step's ATen graphs, the tensors saved for
the backward, the loss and the gradients are Inductor's, bit for bit; the report says why.
A graph that keeps regions, and one whose backward alone claims, still run claimed."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch.compile backend needs torch")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from test_torch_graph_floor import clock  # noqa: E402, F401  (the virtual clock fixture)

from fusegraph.select import timing  # noqa: E402
from fusegraph.torch import partition  # noqa: E402
from fusegraph.torch.compile_backend import INDUCTORS_OWN, STORED_OWN, collecting, fusegraph_backend  # noqa: E402

# The floor's budget off: these tests (and those importing FLOOR) need every region measured
# in the first compile, which on a GPU the default bounds by wall time
# (tests/test_torch_floor_budget.py tests the budget).
# the step check's verdict taken at compile time (loop_steps 0): these tests follow the
# region and graph verdicts; the loop's own steps: tests/test_torch_loop_trial.py
FLOOR = {"floor": True, "warmup_s": 0.02, "budget": None, "loop_steps": 0}


class ConvBN(nn.Module):
    """conv + batch norm + ReLU twice, a residual add, pooling and a linear head: the
    batch norm is kept whole for fusegraph, decomposed by Inductor."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: Any) -> Any:
        y = F.relu(self.b1(self.c1(x)))
        y = F.relu(self.b2(self.c2(y)) + y)
        return self.fc(y.mean((2, 3)))


class LNBlock(nn.Module):
    """Pre-norm MLP block: layer norm (kept whole for fusegraph), linear, GELU, linear."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: Any) -> Any:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


@pytest.fixture
def regions_lose(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Every region measures slower than its incumbent (1 ms against 2), without running
    either side (this machine's load would drown real timings, and the incumbent's Inductor
    compile per region costs seconds). The step check (step_floor.py) times every one of its
    candidates at 2 ms: Inductor's own compile takes the tie with eager."""
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))

    def lose(candidates: Any, **_: Any) -> dict[str, timing.Timing]:
        ms = {name: 1.0 if name == "incumbent" else 2.0 for name in candidates}
        return {name: timing.Timing(name, t, t, (t,)) for name, t in ms.items()}

    monkeypatch.setattr(partition, "_incumbent_call", lambda region, inputs, opts: lambda: None)
    monkeypatch.setattr(timing, "time_candidates", lose)


@pytest.fixture
def graphs() -> Iterator[list[str]]:
    """The text of every ATen graph Inductor lowers (after AOTAutograd's partition, before
    Inductor's own passes), in compile order."""
    import torch._inductor.config as inductor_config

    seen: list[str] = []
    with inductor_config.patch(post_grad_custom_pre_pass=lambda g: seen.append(str(g)), fx_graph_cache=False):
        yield seen


def _rel(a: Any, b: Any) -> float:
    assert not torch.isnan(a).any()
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _step(model: nn.Module, compiled: Callable[..., Any], x: Any, g: Any) -> tuple[Any, list[Any], int, float]:
    """One forward + backward; the loss, the gradients, how many tensors the compiled
    forward saved for the backward, and the loss's scale (sum of |term|: the loss sums
    terms of both signs, so its own size says nothing of float32 rounding)."""
    saved: list[int] = []

    def pack(t: Any) -> Any:
        saved.append(1)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        terms = compiled(x) * g
        loss = terms.sum()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    return loss.detach(), grads, len(saved), float(terms.detach().abs().sum())


def _side_by_side(make: Callable[[], nn.Module], shape: tuple[int, ...], graphs: list[str],
                  options: dict[str, Any]) -> tuple[Any, Any, list[Any]]:
    """The same model and data trained one step under Inductor, then under the backend; per
    side: (loss, gradients, saved count), the ATen graphs' text, and the backend's rows."""
    inductor_model = make()
    fusegraph_model = copy.deepcopy(inductor_model)
    x = torch.randn(shape)
    torch._dynamo.reset()
    out_shape = inductor_model(x).shape
    g = torch.randn(out_shape)
    start = len(graphs)
    want = _step(inductor_model, torch.compile(inductor_model), x, g)
    inductor_graphs = graphs[start:]
    torch._dynamo.reset()
    compiled = torch.compile(fusegraph_model, backend=partial(fusegraph_backend, options=options))
    start = len(graphs)
    with collecting() as rows:
        got = _step(fusegraph_model, compiled, x, g)
    return (want, inductor_graphs), (got, graphs[start:]), rows


@pytest.mark.parametrize(("make", "shape"), [(ConvBN, (4, 3, 8, 8)), (LNBlock, (2, 8, 32))])
def test_with_nothing_claimed_the_training_step_is_inductors_own(
        make: Callable[[], nn.Module], shape: tuple[int, ...], regions_lose: None, graphs: list[str]) -> None:
    (want, want_graphs), (got, got_graphs), rows = _side_by_side(make, shape, graphs, FLOOR)
    assert len(want_graphs) == 2, len(want_graphs)  # forward, backward
    assert got_graphs == want_graphs  # the same ATen graphs went to Inductor
    assert got[2] == want[2], (got[2], want[2])  # the same tensors saved for the backward
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a, b), float((a - b).abs().max())
    # the report still says, node by node, where it ran and why
    assert rows and {r.node.split(":", 1)[0].rstrip("0123456789") for r in rows} == {"fw", "bw"}
    assert all(r.where == "inductor" and r.why.endswith(INDUCTORS_OWN) for r in rows), rows[:3]
    measured = [r for r in rows if r.region is not None]
    # each measured: against Inductor's code, or screened against its ATen ops (partition._screen)
    assert measured and all("the incumbent" in r.why or "screened:" in r.why for r in measured), [r.why for r in measured]


def test_with_nothing_claimed_inference_and_a_dynamic_batch_are_inductors_own(
        regions_lose: None, graphs: list[str]) -> None:
    model = LNBlock().eval()
    outs: dict[str, list[Any]] = {}
    texts: dict[str, list[str]] = {}
    xs = [torch.randn(b, 8, 32) for b in (2, 3, 5)]
    for name, backend in (("inductor", "inductor"), ("fusegraph", partial(fusegraph_backend, options=FLOOR))):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        start = len(graphs)
        with torch.no_grad(), collecting() as rows:
            outs[name] = []
            for x in xs:
                x = x.clone()
                torch._dynamo.mark_dynamic(x, 0)
                outs[name].append(compiled(x))
        texts[name] = graphs[start:]
        if name == "fusegraph":
            assert rows and all(r.why.endswith(INDUCTORS_OWN) for r in rows), rows[:3]
    assert len(texts["inductor"]) == 1 and texts["fusegraph"] == texts["inductor"]  # one graph for every batch
    for a, b in zip(outs["fusegraph"], outs["inductor"], strict=True):
        assert torch.equal(a, b), float((a - b).abs().max())


def test_a_model_with_claimed_regions_runs_them(graphs: list[str]) -> None:
    """Every region claimed (floor off): the backend's own trace runs, fusegraph's region
    calls in both graphs, Inductor's loss and gradients (float32 tolerances)."""
    (want, _), (got, got_graphs), rows = _side_by_side(LNBlock, (2, 8, 32), graphs, {"floor": False})
    assert len(got_graphs) == 2 and all("fusegraph.region" in t for t in got_graphs)
    assert abs(float(got[0]) - float(want[0])) < 1e-5 * want[3], (got[0], want[0], want[3])
    for a, b in zip(got[1], want[1], strict=True):
        assert _rel(a, b) < 1e-4
    assert any(r.fusegraph for r in rows) and not any(r.why.endswith(INDUCTORS_OWN) for r in rows)
    nodes = [r.node for r in rows]
    assert len(nodes) == len(set(nodes))  # each node reported once


def _max_pool_step(options: dict[str, Any], caplog: pytest.LogCaptureFixture) -> tuple[Any, Any, list[Any]]:
    """Max pooling trained one step under the backend with ``options``: its gradient checked
    against eager's on fresh data; the input, the compiled output and the report rows."""

    def fn(x: Any) -> Any:
        return F.max_pool2d(x, 2)

    x = torch.randn(2, 4, 8, 8)
    g = torch.randn(2, 4, 4, 4)
    a = x.clone().requires_grad_()
    b = x.clone().requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=partial(fusegraph_backend, options=options))
    with collecting() as rows, caplog.at_level(logging.INFO, logger="fusegraph.torch"):
        out = compiled(a)
        out.backward(g)
    fn(b).backward(g)
    assert a.grad is not None and b.grad is not None
    assert float((a.grad - b.grad).norm() / b.grad.norm()) < 1e-6
    return x, out, rows


def test_a_backward_that_claims_where_its_forward_claimed_nothing(graphs: list[str],
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Max pooling's forward is refused in training (its indices are saved for the
    backward); the backward is claimed. The first pass skipped the forward's compile, so
    the Dynamo graph is traced again, both graphs compiled: the backward runs fusegraph's
    region, the gradients are eager's."""

    x, out, rows = _max_pool_step({"floor": False}, caplog)
    assert "traced again" in caplog.text, caplog.text
    assert torch.equal(out.detach(), F.max_pool2d(x, 2))
    claimed = [r for r in rows if r.fusegraph]
    assert claimed and all(r.node.startswith("bw") for r in claimed), [(r.node, r.where) for r in rows]
    assert any(r.node.startswith("fw") for r in rows) and not any(r.why.endswith(INDUCTORS_OWN) for r in rows)
    nodes = [r.node for r in rows]
    assert len(nodes) == len(set(nodes))  # the first pass's rows are dropped
    assert len(graphs) >= 2 and "fusegraph.region" in graphs[-1]


@pytest.mark.gpu
def test_on_cuda_with_nothing_claimed_bf16_channels_last_training_is_inductors_own(
        regions_lose: None, graphs: list[str]) -> None:
    """The ResNet-style step as bench_torch.py runs it on a GPU: channels-last, bf16 autocast."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    cuda = torch.device("cuda")
    sides = []
    model = ConvBN().to(cuda).to(memory_format=torch.channels_last)
    x = torch.randn(8, 3, 16, 16, device=cuda).to(memory_format=torch.channels_last)
    g = torch.randn(8, 10, device=cuda)
    for backend in ("inductor", partial(fusegraph_backend, options=FLOOR)):
        twin = copy.deepcopy(model)
        torch._dynamo.reset()
        compiled = torch.compile(twin, backend=backend)
        start = len(graphs)
        with torch.autocast("cuda", torch.bfloat16):
            loss, grads, saved, scale = _step(twin, compiled, x, g)
        sides.append((loss, grads, saved, scale, graphs[start:]))
    (want_loss, want_grads, want_saved, _, want_graphs), (loss, grads, saved, scale, got_graphs) = sides
    assert len(want_graphs) == 2 and got_graphs == want_graphs
    assert saved == want_saved
    assert abs(float(loss) - float(want_loss)) <= 1e-6 * scale
    for a, b in zip(grads, want_grads, strict=True):
        assert _rel(a, b) < 1e-5


@pytest.mark.gpu
def test_on_cuda_reduce_overhead_with_nothing_claimed_replays_inductors_graphs(regions_lose: None) -> None:
    """mode="reduce-overhead": Inductor's own compile under CUDA graphs; three steps (the
    third replays) give the losses of ``torch.compile(mode="reduce-overhead")``."""
    cuda = torch.device("cuda")
    model = LNBlock().to(cuda)
    xs = [torch.randn(4, 16, 32, device=cuda) for _ in range(3)]
    losses = []
    for backend in ("inductor", partial(fusegraph_backend, options=FLOOR)):
        twin = copy.deepcopy(model)
        opt = torch.optim.SGD(twin.parameters(), lr=0.1)
        torch._dynamo.reset()
        compiled = torch.compile(twin, backend=backend, mode="reduce-overhead")
        side = []
        with collecting() as rows:
            for x in xs:
                opt.zero_grad(set_to_none=True)
                loss = compiled(x).square().mean()
                loss.backward()
                opt.step()
                side.append(loss.detach().clone())
        if backend != "inductor":
            assert rows and all(r.why.endswith(INDUCTORS_OWN) for r in rows), rows[:3]
        losses.append(torch.stack(side))
    assert _rel(losses[1], losses[0]) < 1e-6, losses


@pytest.mark.usefixtures("clock")
def test_regions_the_graph_check_hands_back_leave_inductors_own(
        graphs: list[str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every region wins alone and the whole-graph check hands them back (the virtual clock
    of tests/test_torch_graph_floor.py): Inductor's own compile runs, the rows say both
    verdicts. Compiled again, the Dynamo graph's stored verdict (no region kept) sends it
    straight to Inductor's own compile. Without that verdict, the forward's stored graph
    verdict spares its two compiles; the backward is timed once more, its saved inputs'
    strides no longer those of a compiled forward (a new key); from then on, nothing is
    compiled twice."""
    from test_torch_compile import ConvNet
    from torch._inductor import compile_fx as inductor

    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    first_pass: list[bool] = []  # is_backward of each
    real = inductor.compile_fx_inner

    def spy(gm: Any, inputs: Any, **kw: Any) -> Any:  # the backend's own compiles, not Inductor's own path
        first_pass.append(bool(kw.get("is_backward")))
        return real(gm, inputs, **kw)

    monkeypatch.setattr(inductor, "compile_fx_inner", spy)
    options = {**FLOOR, "warmup_s": 0.0}
    (want, want_graphs), (got, got_graphs), rows = _side_by_side(ConvNet, (2, 3, 8, 8), graphs, options)
    # the first two lowered are Inductor's own, timed against eager before the trace (after
    # them, the first pass's four: each graph claimed and unclaimed, compiled to be timed)
    assert got_graphs[:2] == want_graphs and got[2] == want[2]
    assert torch.equal(got[0], want[0])
    handed = [r for r in rows if "handed back with the whole graph" in r.why]
    assert handed and {r.node[:2] for r in handed} == {"fw", "bw"}, [r.why for r in rows]
    assert all(r.where == "inductor" and r.why.endswith(INDUCTORS_OWN) for r in rows)
    assert first_pass, "the first compile times the claimed graphs against the unclaimed ones"
    first_pass.clear()
    (want, want_graphs), (again, again_graphs), rows = _side_by_side(ConvNet, (2, 3, 8, 8), graphs, options)
    assert not first_pass, first_pass
    assert again_graphs == want_graphs and again[2] == want[2] and torch.equal(again[0], want[0])
    assert rows and all(r.where == "inductor" and r.why.startswith(STORED_OWN) for r in rows), rows[:3]
    # the Dynamo graph's verdict set aside: the ATen graphs' stored verdicts
    from fusegraph.torch import compile_backend

    monkeypatch.setattr(compile_backend.DynamoVerdict, "lookup", lambda self: None)
    (_, _), (again, again_graphs), rows = _side_by_side(ConvNet, (2, 3, 8, 8), graphs, options)
    assert first_pass == [True, True], first_pass  # the backward's two sides, timed
    assert again_graphs[:2] == want_graphs and again[2] == want[2]
    first_pass.clear()
    (want, want_graphs), (third, third_graphs), rows = _side_by_side(ConvNet, (2, 3, 8, 8), graphs, options)
    assert not first_pass, first_pass
    assert third_graphs == want_graphs and third[2] == want[2] and torch.equal(third[0], want[0])
    handed = [r for r in rows if "handed back with the whole graph" in r.why]
    assert handed and {r.node[:2] for r in handed} == {"fw", "bw"}, [r.why for r in rows]
    assert all("graph: cached" in r.why for r in handed), [r.why for r in handed]


def test_a_first_pass_that_fails_falls_back_to_the_single_trace(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Whatever breaks the first pass (here: reading the stored graph verdicts), the Dynamo
    graph is traced once more the way it was before the first pass existed: every graph
    compiled as it comes, the model right, each node reported once."""
    from fusegraph.torch import compile_backend

    def broken(*args: Any) -> Any:
        raise RuntimeError("made to fail in this test")

    monkeypatch.setattr(compile_backend, "_stored_hand_back", broken)
    eager = LNBlock()
    twin = copy.deepcopy(eager)
    x = torch.randn(2, 8, 32)
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend=partial(fusegraph_backend, options={"floor": False}))
    with collecting() as rows, caplog.at_level(logging.WARNING, logger="fusegraph.torch"):
        got = compiled(x)
        got.sum().backward()
    want = eager(x)
    want.sum().backward()
    assert "the first pass failed (RuntimeError: made to fail in this test)" in caplog.text, caplog.text
    assert _rel(got.detach(), want.detach()) < 1e-5
    for p, q in zip(twin.parameters(), eager.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None and _rel(p.grad, q.grad) < 1e-4
    nodes = [r.node for r in rows]
    assert any(r.fusegraph for r in rows) and len(nodes) == len(set(nodes))


@pytest.mark.parametrize("graph_extra", [0.0, 100.0])
def test_a_backward_timed_whole_after_a_skipped_forward(
        graph_extra: float, request: pytest.FixtureRequest, tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Max pooling: the forward claims nothing (skipped), the backward's region wins alone
    (the virtual clock). Timed whole in the first pass: handed back (0), the Dynamo graph
    runs Inductor's own compile, no second trace; kept (100: the unclaimed graph made
    slower), it is traced again, every graph compiled, and the step check (forced: the
    trace 1 ms, Inductor's own 2, eager 3) keeps the trace: the backward runs the region.
    Gradients: eager's."""
    from test_torch_step_floor import step_timer

    from fusegraph.torch import step_floor

    step = step_timer(monkeypatch, tmp_path)
    step["trace_ms"], step["own_ms"] = 1.0, 2.0
    request.getfixturevalue("clock")["graph_extra"] = graph_extra

    _, _, rows = _max_pool_step({**FLOOR, "warmup_s": 0.0}, caplog)
    regions = [r for r in rows if r.region is not None]
    assert regions and all(r.node.startswith("bw") for r in regions), [(r.node, r.why) for r in rows]
    # kept: Inductor's own and eager timed before the trace, then the three together
    assert step["calls"] == (1 if graph_extra == 0.0 else 2), step
    if graph_extra == 0.0:
        assert "traced again" not in caplog.text and sorted(step["backward"]) == ["eager", "own"]
        assert all(r.where == "inductor" and r.why.endswith(INDUCTORS_OWN) for r in rows), [r.why for r in rows]
        assert all("handed back with the whole graph" in r.why for r in regions if r.compute)
    else:
        assert "traced again" in caplog.text and sorted(step["backward"]) == ["eager", "own", "trace"]
        assert any(r.fusegraph for r in regions) and not any(r.why.endswith(INDUCTORS_OWN) for r in rows)
        assert all(step_floor.TRACE_WON in r.why for r in rows if r.fusegraph), [r.why for r in rows]
