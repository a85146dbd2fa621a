"""The step check in a piece of DDP's graph split (step_floor.Deferred): DDP's first call
hands the piece fake inputs and reads fake outputs, so the candidates are timed at the
first real call instead. Here the candidates are plain functions and the timing is forced
(the step clock of tests/test_torch_step_floor.py); DDP itself runs in
tests/test_torch_ddp.py."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch.compile backend needs torch")

from test_torch_step_floor import step_timer  # noqa: E402

from fusegraph.regions.verdicts import Verdict  # noqa: E402
from fusegraph.torch import step_floor  # noqa: E402


class _Side:
    """A candidate that counts its calls, fake and real, and may lay its output out
    transposed (same values, other strides)."""

    def __init__(self, transposed: bool = False) -> None:
        self.fake = self.real = 0
        self.transposed = transposed

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(x, FakeTensor):
            self.fake += 1
        else:
            self.real += 1
        y = torch.tanh(x @ w)
        return (y.t().contiguous().t() if self.transposed else y,)


def _deferred(sides: dict[str, _Side], default: str = step_floor.OWN
              ) -> tuple[step_floor.Deferred, list[Verdict]]:
    recorded: list[Verdict] = []
    return step_floor.Deferred(sides, default, margin=0.03, warmup_s=0.0, record=recorded.append), recorded


def _args(requires_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 6), torch.randn(6, 5, requires_grad=requires_grad)


def _fake_call(fn: step_floor.Deferred, x: torch.Tensor, w: torch.Tensor) -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        return fn(mode.from_tensor(x), mode.from_tensor(w))


def test_the_first_real_call_times_the_sides_and_the_fastest_answers_every_later_call(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    clock = step_timer(monkeypatch, tmp_path)
    clock.update(own_ms=2.0, eager_ms=1.0, trace_ms=3.0)
    sides = {step_floor.OWN: _Side(), step_floor.EAGER: _Side(), step_floor.TRACE: _Side()}
    fn, recorded = _deferred(sides, default=step_floor.TRACE)
    x, w = _args()
    fake = _fake_call(fn, x, w)
    # DDP's call: every AOTAutograd side's fake result taken, eager's graph not run
    assert (sides["own"].fake, sides["trace"].fake, sides["eager"].fake) == (1, 1, 0)
    assert clock["calls"] == 0 and not recorded
    assert tuple(fake[0].shape) == (8, 5)
    out = fn(x, w)
    assert clock["calls"] == 1 and clock["backward"] == dict.fromkeys(sides, True), clock
    assert len(recorded) == 1 and step_floor.winner(recorded[0]) == step_floor.EAGER, recorded
    assert "eager 1.000 ms" in recorded[0].why
    torch.testing.assert_close(out[0], torch.tanh(x @ w), rtol=0, atol=0)
    assert out[0].requires_grad  # the caller's own call keeps its autograd graph
    before = {name: side.real for name, side in sides.items()}
    fn(x, w)
    after = {name: side.real for name, side in sides.items()}
    assert after == {**before, "eager": before["eager"] + 1}, (before, after)
    assert clock["calls"] == 1 and len(recorded) == 1


def test_the_steps_run_on_copies_and_leave_the_callers_tensors_alone(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Any) -> None:
    step_timer(monkeypatch, tmp_path)
    fn, _ = _deferred({step_floor.OWN: _Side(), step_floor.EAGER: _Side()})
    x, w = _args()
    _fake_call(fn, x, w)
    w0 = w.detach().clone()
    fn(x, w)
    assert w.grad is None and torch.equal(w.detach(), w0)


def test_a_side_laid_out_otherwise_than_ddps_fake_outputs_loses(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Any) -> None:
    clock = step_timer(monkeypatch, tmp_path)
    clock.update(own_ms=2.0, eager_ms=1.0)  # eager faster, but its output has other strides
    sides = {step_floor.OWN: _Side(), step_floor.EAGER: _Side(transposed=True)}
    fn, recorded = _deferred(sides)
    x, w = _args()
    _fake_call(fn, x, w)
    out = fn(x, w)
    assert len(recorded) == 1 and step_floor.winner(recorded[0]) == step_floor.OWN, recorded
    assert "eager failed" in recorded[0].why and "strides" in recorded[0].why, recorded[0].why
    assert out[0].stride() == (5, 1)


def test_where_the_check_cannot_run_the_default_side_runs_and_nothing_is_stored(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    clock = step_timer(monkeypatch, tmp_path)

    def broken(candidates: Any, **_: Any) -> Any:
        raise RuntimeError("no clock here")

    clock["timer"] = broken
    sides = {step_floor.OWN: _Side(), step_floor.EAGER: _Side(), step_floor.TRACE: _Side()}
    fn, recorded = _deferred(sides, default=step_floor.TRACE)
    x, w = _args()
    _fake_call(fn, x, w)
    fn(x, w)
    real = {name: side.real for name, side in sides.items()}
    fn(x, w)
    assert sides["trace"].real == real["trace"] + 1 and not recorded
    assert sides["own"].real == real["own"] and sides["eager"].real == real["eager"]


def test_settle_defers_only_inside_ddps_split(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """settle() returns a Deferred function in a piece DDP fakes the first call of (its
    own compile done at once, inside the compile), and times at once elsewhere."""
    clock = step_timer(monkeypatch, tmp_path)
    gm = torch.fx.symbolic_trace(lambda x, w: (torch.tanh(x @ w),))
    x, w = _args()
    own = _Side()
    compiled: list[int] = []

    def compile_own() -> _Side:
        compiled.append(1)
        return own

    monkeypatch.setattr(step_floor, "fakified_first_call", lambda: True)
    side, fn, verdict = step_floor.settle(gm, [x, w], compile_own, gm.forward, margin=0.03, warmup_s=0.0)
    assert isinstance(fn, step_floor.Deferred) and side == step_floor.OWN and verdict is None
    assert compiled == [1] and clock["calls"] == 0
    monkeypatch.setattr(step_floor, "fakified_first_call", lambda: False)
    side, fn, verdict = step_floor.settle(gm, [x, w], compile_own, gm.forward, margin=0.03, warmup_s=0.0)
    assert not isinstance(fn, step_floor.Deferred) and verdict is not None and clock["calls"] == 1
