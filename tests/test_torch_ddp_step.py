"""The step check in DDP's graph split (fusegraph/torch/ddp_split.py): DDP's first call hands
a piece fake inputs and reads fake outputs, so the piece's candidates are timed alone at
its first real call, and the split's pieces are then chosen together on the loop's own
steps. Here the candidates are plain functions, the timing alone is forced (the step clock
of tests/test_torch_step_floor.py) and the loop's clock is virtual: each side's call costs
what the test says. DDP itself runs in tests/test_torch_ddp.py."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch.compile backend needs torch")

from test_torch_step_floor import step_timer  # noqa: E402

from fusegraph.regions.verdicts import Verdict  # noqa: E402
from fusegraph.torch import ddp_split, loop_trial, step_floor  # noqa: E402


class _Side:
    """A candidate that counts its calls, fake and real, costs ``cost`` seconds of the loop's
    clock per real call, and may lay its output out transposed (same values, other strides)."""

    def __init__(self, loop_clock: Any, cost: float = 1.0, transposed: bool = False) -> None:
        self.loop, self.cost = loop_clock, cost
        self.fake = self.real = 0
        self.transposed = transposed

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(x, FakeTensor):
            self.fake += 1
        else:
            self.real += 1
            self.loop.now += self.cost
        y = torch.tanh(x @ w)
        return (y.t().contiguous().t() if self.transposed else y,)


def _piece(sides: dict[str, _Side], default: str = step_floor.OWN) -> tuple[ddp_split.Deferred, list[Verdict]]:
    recorded: list[Verdict] = []
    return ddp_split.Deferred(sides, default, margin=0.03, warmup_s=0.0, record=recorded.append), recorded


def _args() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 6), torch.randn(6, 5, requires_grad=True)


def _fake_call(fn: ddp_split.Deferred, x: torch.Tensor, w: torch.Tensor) -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        return fn(mode.from_tensor(x), mode.from_tensor(w))


def _loop_steps(pieces: list[ddp_split.Deferred], x: torch.Tensor, w: torch.Tensor, steps: int) -> None:
    """``steps`` training steps: each piece's forward, then the backward of them all (as
    ``torch.autograd.grad``, so the caller's ``w.grad`` stays unset), then a torch.optim step."""
    opt = torch.optim.SGD([w], lr=0.0)  # its step changes nothing: w.grad stays unset
    for _ in range(steps):
        outs = [piece(x, w)[0] for piece in pieces]
        torch.autograd.grad(sum(o.sum() for o in outs), [w])
        opt.step()


def test_alone_the_trace_wins_but_the_loops_steps_give_the_piece_to_eager(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any, loop_clock: Any) -> None:
    clock = step_timer(monkeypatch, tmp_path)
    clock.update(own_ms=2.0, eager_ms=2.2, trace_ms=1.8)  # alone: the trace, then Inductor's own
    sides = {step_floor.OWN: _Side(loop_clock, 2.0), step_floor.EAGER: _Side(loop_clock, 1.0), step_floor.TRACE: _Side(loop_clock, 3.0)}
    piece, recorded = _piece(sides, default=step_floor.TRACE)
    x, w = _args()
    fake = _fake_call(piece, x, w)
    # DDP's call: every AOTAutograd side's fake result taken, eager's graph not run
    assert (sides["own"].fake, sides["trace"].fake, sides["eager"].fake) == (1, 1, 0)
    assert clock["calls"] == 0 and not recorded and tuple(fake[0].shape) == (8, 5)
    out = piece(x, w)  # the first real step: the piece checked alone, its winner runs
    assert clock["calls"] == 1 and clock["backward"] == dict.fromkeys(sides, True), clock
    assert piece.own_winner == step_floor.TRACE and not recorded
    torch.testing.assert_close(out[0], torch.tanh(x @ w), rtol=0, atol=0)
    assert out[0].requires_grad  # the caller's own call keeps its autograd graph
    # three choices (every piece own, every piece eager, each its winner: the trace), each
    # timed on SAMPLES of the loop's steps, then the decision at the next step's start
    _loop_steps([piece], x, w, 3 * loop_trial.SAMPLES + 2)
    assert len(recorded) == 1, recorded
    verdict = recorded[0]
    assert step_floor.winner(verdict) == step_floor.EAGER and not verdict.fusegraph, verdict
    assert "training loop" in verdict.why and "eager 1000.000 ms" in verdict.why, verdict.why
    assert "the piece alone:" in verdict.why and "fusegraph's trace 1.800 ms" in verdict.why
    assert verdict.incumbent_ms == 1000.0 and verdict.incumbent == "eager"  # the whole step as chosen
    before = {name: side.real for name, side in sides.items()}
    _loop_steps([piece], x, w, 2)
    after = {name: side.real for name, side in sides.items()}
    assert after == {**before, "eager": before["eager"] + 2}, (before, after)
    assert clock["calls"] == 1 and len(recorded) == 1
    # the caller's tensors were left alone by the check
    assert w.grad is None


def test_a_splits_pieces_are_chosen_together_on_whole_steps(monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
                                                              loop_clock: Any) -> None:
    """Alone, each piece goes to Inductor's own; on the loop's steps every piece eager is
    faster only together (the second piece's eager costs more alone than it saves)."""
    clock = step_timer(monkeypatch, tmp_path)
    clock.update(own_ms=1.0, eager_ms=1.2)  # alone: Inductor's own, eager within loop_trial.BAND of it
    trial = loop_trial.Trial(0.03)
    monkeypatch.setattr(ddp_split, "of_split", lambda margin, samples: trial)
    a_sides = {step_floor.OWN: _Side(loop_clock, 5.0), step_floor.EAGER: _Side(loop_clock, 2.0)}
    b_sides = {step_floor.OWN: _Side(loop_clock, 1.0), step_floor.EAGER: _Side(loop_clock, 2.0)}
    a, a_recorded = _piece(a_sides)
    b, b_recorded = _piece(b_sides)
    assert trial.pieces == [a, b]
    x, w = _args()
    _fake_call(a, x, w)
    _fake_call(b, x, w)
    # the first real step, then one choice per step (EACH gives what ALL_OWN gives: two choices)
    _loop_steps([a, b], x, w, 1 + 2 * loop_trial.SAMPLES + 2)
    assert set(trial.periods) == {loop_trial.ALL_OWN, loop_trial.ALL_EAGER}, trial.periods
    assert trial.periods[loop_trial.ALL_OWN] == [6000.0] * loop_trial.SAMPLES, trial.periods
    assert trial.periods[loop_trial.ALL_EAGER] == [4000.0] * loop_trial.SAMPLES, trial.periods
    assert [step_floor.winner(v) for v in a_recorded + b_recorded] == [step_floor.EAGER] * 2
    assert [v.incumbent_ms for v in a_recorded + b_recorded] == [4000.0] * 2


def test_a_side_laid_out_otherwise_than_ddps_fake_outputs_never_runs(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Any, loop_clock: Any) -> None:
    clock = step_timer(monkeypatch, tmp_path)
    clock.update(own_ms=2.0, eager_ms=1.0)  # eager faster, but its output has other strides
    sides = {step_floor.OWN: _Side(loop_clock, 2.0), step_floor.EAGER: _Side(loop_clock, 1.0, transposed=True)}
    piece, recorded = _piece(sides)
    x, w = _args()
    _fake_call(piece, x, w)
    eager_before = sides["eager"].real
    out = piece(x, w)
    assert out[0].stride() == (5, 1)
    _loop_steps([piece], x, w, 3)  # one choice left: decided at the first loop step
    assert sides["eager"].real == eager_before + 1  # its one step in the check alone
    assert len(recorded) == 1 and step_floor.winner(recorded[0]) == step_floor.OWN, recorded
    assert "eager failed" in recorded[0].why and "strides" in recorded[0].why, recorded[0].why


def test_where_the_check_cannot_run_the_default_side_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
                                                          loop_clock: Any) -> None:
    clock = step_timer(monkeypatch, tmp_path)

    def broken(candidates: Any, **_: Any) -> Any:
        raise RuntimeError("no clock here")

    clock["timer"] = broken
    sides = {step_floor.OWN: _Side(loop_clock), step_floor.EAGER: _Side(loop_clock), step_floor.TRACE: _Side(loop_clock)}
    piece, recorded = _piece(sides, default=step_floor.TRACE)
    x, w = _args()
    _fake_call(piece, x, w)
    piece(x, w)  # the check's own first steps run each side once, then its timing fails
    real = {name: side.real for name, side in sides.items()}
    _loop_steps([piece], x, w, 3)
    assert sides["trace"].real == real["trace"] + 3
    assert sides["own"].real == real["own"] and sides["eager"].real == real["eager"]
    assert len(recorded) == 1 and recorded[0].fusegraph and "the piece alone" not in recorded[0].why

