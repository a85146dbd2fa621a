"""The step check's choice weighed again on the user's own steps (fusegraph/torch/loop_trial.py).
The candidates are plain functions whose real calls cost what the test says on a virtual
loop clock; the compile-time check is a Check built here. What is asserted: where a step
starts (a call after the graph's backward ran, never inside a backward, never twice in a
step for a graph called many times), that every call in a step runs the turn's side, what
is weighed (BAND, failed sides, loop_steps 0, no backward), the verdict stored, and one
trial at a time. The backend's own path: the last test, on the real clock."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch.compile backend needs torch")

from test_torch_incumbent_path import regions_lose  # noqa: E402, F401  (regions lose: nothing claimed)
from test_torch_step_floor import step_timer  # noqa: E402

from fusegraph.regions.verdicts import Verdict  # noqa: E402
from fusegraph.torch import loop_trial, step_floor  # noqa: E402
from fusegraph.torch.step_floor import EAGER, OWN, TRACE, Check  # noqa: E402

MARGIN = 0.03


class _Side:
    """A candidate costing ``cost`` seconds of the loop's clock per call; it notes which side
    ran each call in the loop's ``ran``."""

    def __init__(self, loop_clock: Any, name: str, cost: float, ran: list[str]) -> None:
        self.loop, self.name, self.cost, self.ran = loop_clock, name, cost, ran

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        self.loop.now += self.cost
        self.ran.append(self.name)
        return (torch.tanh(x @ w),)


def _check(times: dict[str, float], backward: bool = True, failed: dict[str, str] | None = None) -> Check:
    failed = failed or {}
    return Check(step_floor._verdict(times, failed, MARGIN), times, failed, backward)


def _graph(loop_clock: Any, costs: dict[str, float], alone: dict[str, float], *, backward: bool = True,
           failed: dict[str, str] | None = None, samples: int = loop_trial.SAMPLES
           ) -> tuple[Any, list[str], list[Verdict]]:
    ran: list[str] = []
    recorded: list[Verdict] = []
    sides = {name: _Side(loop_clock, name, cost, ran) for name, cost in costs.items()}
    fn = loop_trial.weigh(sides, _check(alone, backward, failed), margin=MARGIN, samples=samples,
                          record=recorded.append)
    return fn, ran, recorded


def _w() -> torch.Tensor:
    return torch.randn(6, 6, requires_grad=True)


def _steps(fn: Any, w: torch.Tensor, steps: int, calls: int = 1, backward: bool = True,
           checkpoint: bool = False, micro: int = 1, optimizer: bool = True) -> None:
    """``steps`` training steps, each of ``micro`` micro-steps (gradient accumulation) that
    call ``fn`` ``calls`` times in a chain (blocks compiled alone; ``checkpoint``: each under
    activation checkpointing), then the backward (``torch.autograd.grad``: the caller's
    ``w.grad`` stays unset); then a torch.optim step (one that changes nothing)."""
    from torch.utils.checkpoint import checkpoint as recompute

    opt = torch.optim.SGD([w], lr=0.0)
    for _ in range(steps):
        for _ in range(micro):
            y = torch.randn(4, 6)
            for _ in range(calls):
                y = recompute(lambda t: fn(t, w)[0], y, use_reentrant=False) if checkpoint else fn(y, w)[0]
            if backward:
                torch.autograd.grad(y.sum(), [w])
        if optimizer:
            opt.step()


def _sides_per_step(ran: list[str], calls: int) -> list[tuple[str, ...]]:
    """The sides run, ``calls`` at a time."""
    return [tuple(ran[i:i + calls]) for i in range(0, len(ran), calls)]


def test_a_graph_called_three_times_a_step_is_chosen_on_whole_steps(loop_clock: Any) -> None:
    """Alone, Inductor's own wins by a tie's width; on the loop's steps eager is faster: the
    verdict goes to eager, every call in a step ran the turn's side, and a step starts once
    per step (three calls, one backward)."""
    fn, ran, recorded = _graph(loop_clock, {OWN: 2.0, EAGER: 1.0}, {OWN: 1.0, EAGER: 1.02})
    assert isinstance(fn, loop_trial.Piece) and fn.own_winner == OWN
    w = _w()
    _steps(fn, w, 2 * loop_trial.SAMPLES + 2, calls=3)
    trial = fn.trial
    assert trial.periods == {loop_trial.ALL_OWN: [6000.0] * loop_trial.SAMPLES,
                             loop_trial.ALL_EAGER: [3000.0] * loop_trial.SAMPLES}, trial.periods
    steps = _sides_per_step(ran, 3)
    assert all(len(set(s)) == 1 for s in steps), steps  # one side a step
    # the check's winner first, twice: the trial's first period is not kept
    assert steps[0] == steps[1] == (OWN,) * 3 and steps[2] == (EAGER,) * 3, steps
    assert len(recorded) == 1, recorded
    verdict = recorded[0]
    assert step_floor.winner(verdict) == EAGER and verdict.incumbent_ms == 3000.0, verdict
    assert "training loop's own steps timed: eager 3000.000 ms vs Inductor's own" in verdict.why, verdict.why
    assert "the piece alone: Inductor's own" in verdict.why, verdict.why
    before = len(ran)
    _steps(fn, w, 2, calls=3)
    assert ran[before:] == [EAGER] * 6 and len(recorded) == 1 and w.grad is None


class _Cycling(_Side):
    """A candidate whose calls cost ``costs`` in turn (a step that varies: a stall, a log)."""

    def __init__(self, loop_clock: Any, name: str, costs: list[float], ran: list[str]) -> None:
        super().__init__(loop_clock, name, costs[0], ran)
        self.costs, self.calls = costs, 0

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        self.cost = self.costs[self.calls % len(self.costs)]
        self.calls += 1
        return super().__call__(x, w)


def _cycling(loop_clock: Any, eager: list[float], samples: int = loop_trial.SAMPLES
             ) -> tuple[Any, list[str], list[Verdict]]:
    """Inductor's own at 1 s a step, eager at ``eager``'s costs in turn; alone eager came
    within the margin of Inductor's own, so Inductor's own is the check's winner."""
    ran: list[str] = []
    recorded: list[Verdict] = []
    sides = {OWN: _Side(loop_clock, OWN, 1.0, ran), EAGER: _Cycling(loop_clock, EAGER, eager, ran)}
    fn = loop_trial.weigh(sides, _check({OWN: 1.0, EAGER: 1.02}), margin=MARGIN, samples=samples,
                          record=recorded.append)
    assert isinstance(fn, loop_trial.Piece) and fn.own_winner == OWN
    return fn, ran, recorded


@pytest.mark.parametrize(("samples", "wins", "p"), [(loop_trial.SAMPLES, "14 of 20", "0.058"), (2, "6 of 8", "0.14")])
def test_a_median_win_within_the_noise_times_up_to_samples_max_then_keeps_inductors_own(
        loop_clock: Any, samples: int, wins: str, p: str) -> None:
    """Eager's step costs 0.9 s twice, then 1.2 s (a stall every third step): its median is
    10% below Inductor's own 1 s, but it is slower in a third of the paired rounds, which no
    look from ``samples`` to 4x ``samples`` rounds separates from chance (sign test > 0.05).
    The trial goes on past ``samples`` (still in the QUEUE), and at the cap Inductor's own
    runs, the stored verdict saying why with the numbers."""
    fn, ran, recorded = _cycling(loop_clock, [0.9, 0.9, 1.2], samples)
    most = 4 * samples
    w = _w()
    _steps(fn, w, 2 * samples + 2)  # where medians alone decided
    assert not fn.trial.done and loop_trial.QUEUE.running is fn.trial and not recorded
    _steps(fn, w, 2 * (most - samples))
    assert fn.trial.done and [len(t) for t in fn.trial.periods.values()] == [most, most], fn.trial.periods
    assert fn.trial.periods[loop_trial.ALL_EAGER] == pytest.approx(([900.0, 900.0, 1200.0] * most)[:most])
    assert len(recorded) == 1 and step_floor.winner(recorded[0]) == OWN, recorded
    why = recorded[0].why
    assert (f"eager 900.000 ms vs Inductor's own compile 1000.000 ms (medians of {most}; " in why
            and f": eager faster in {wins} paired steps (sign test p={p} > 0.05): not beyond the noise, "
                "Inductor's own compile runs" in why), why
    assert recorded[0].incumbent_ms == 1000.0, recorded[0]
    before = len(ran)
    _steps(fn, w, 3)
    assert ran[before:] == [OWN] * 3 and len(recorded) == 1


def test_a_win_in_every_paired_round_decides_after_samples(loop_clock: Any) -> None:
    """A clean, consistent 10% win: 5 of 5 paired rounds (p = 1/32) displaces Inductor's own
    at the first decision."""
    fn, ran, recorded = _cycling(loop_clock, [0.9])
    _steps(fn, _w(), 2 * loop_trial.SAMPLES + 2)
    assert fn.trial.done and fn.trial.periods == {loop_trial.ALL_OWN: [1000.0] * loop_trial.SAMPLES,
                                                  loop_trial.ALL_EAGER: pytest.approx([900.0] * loop_trial.SAMPLES)}
    assert len(recorded) == 1 and step_floor.winner(recorded[0]) == EAGER, recorded
    assert "eager faster in 5 of 5 paired steps (sign test p=0.031 <= 0.05); eager" in recorded[0].why, recorded[0].why
    assert ran[-1] == EAGER and ran[:3] == [OWN, OWN, EAGER], ran  # the deciding step ran eager


def test_a_win_that_needs_more_rounds_decides_before_the_cap(loop_clock: Any) -> None:
    """Eager is slower only in its second round: 4 of 5 (p = 0.19) is not enough, and the
    trial decides after each full round from then: 5 of 6 (0.11), 6 of 7 (0.063), 7 of 8
    (0.035) displaces Inductor's own, 12 rounds short of the cap."""
    fn, ran, recorded = _cycling(loop_clock, [0.9, 1.2] + [0.9] * 30)
    w = _w()
    _steps(fn, w, 1 + 2 * 7 + 1)  # the dropped first step, seven rounds, and the step after them
    assert not fn.trial.done and not recorded
    _steps(fn, w, 2)  # eager's turn of the eighth round, and the step after it
    assert fn.trial.done and [len(t) for t in fn.trial.periods.values()] == [8, 8], fn.trial.periods
    assert len(recorded) == 1 and step_floor.winner(recorded[0]) == EAGER, recorded
    assert "(medians of 8; " in recorded[0].why, recorded[0].why
    assert "eager faster in 7 of 8 paired steps (sign test p=0.035 <= 0.05); eager" in recorded[0].why, recorded[0].why
    before = len(ran)
    _steps(fn, w, 2)
    assert ran[before:] == [EAGER] * 2 and len(recorded) == 1, ran


def test_a_recompute_inside_the_backward_starts_no_step(loop_clock: Any) -> None:
    """Activation checkpointing calls the graph again inside the backward: one step still
    counts one period, and each recompute runs the side its forward ran."""
    fn, ran, recorded = _graph(loop_clock, {OWN: 2.0, EAGER: 1.0}, {OWN: 1.0, EAGER: 1.1})
    w = _w()
    _steps(fn, w, 2 * loop_trial.SAMPLES + 2, calls=2, checkpoint=True)
    assert [len(p) for p in fn.trial.periods.values()] == [loop_trial.SAMPLES] * 2, fn.trial.periods
    steps = _sides_per_step(ran, 4)  # two forwards, two recomputes
    assert all(len(set(s)) == 1 for s in steps), steps
    # a step's period: its forwards and its recomputes, on one side
    assert fn.trial.periods[loop_trial.ALL_OWN] == [8000.0] * loop_trial.SAMPLES, fn.trial.periods
    assert len(recorded) == 1 and step_floor.winner(recorded[0]) == EAGER


def test_gradient_accumulations_micro_steps_start_no_step(loop_clock: Any) -> None:
    """Three micro-steps per optimizer step (DDP's no_sync until the last): each period holds
    a whole cycle and every micro-step of it runs the same side."""
    fn, ran, recorded = _graph(loop_clock, {OWN: 2.0, EAGER: 1.0}, {OWN: 1.0, EAGER: 1.1})
    _steps(fn, _w(), 2 * loop_trial.SAMPLES + 2, micro=3)
    assert fn.trial.by_optimizer is True
    assert fn.trial.periods == {loop_trial.ALL_OWN: [6000.0] * loop_trial.SAMPLES,
                                loop_trial.ALL_EAGER: [3000.0] * loop_trial.SAMPLES}, fn.trial.periods
    assert all(len(set(s)) == 1 for s in _sides_per_step(ran, 3)), ran
    assert len(recorded) == 1 and step_floor.winner(recorded[0]) == EAGER


def test_a_loop_without_torch_optim_is_timed_on_its_backwards(loop_clock: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop_trial, "NO_OPTIMIZER", 3)
    fn, ran, recorded = _graph(loop_clock, {OWN: 2.0, EAGER: 1.0}, {OWN: 1.0, EAGER: 1.1})
    _steps(fn, _w(), 3, optimizer=False)
    assert fn.trial.by_optimizer is None and not any(fn.trial.periods.values()) and ran == [OWN] * 3
    _steps(fn, _w(), 2 * loop_trial.SAMPLES + 2, optimizer=False)
    assert fn.trial.by_optimizer is False, fn.trial.by_optimizer
    # the three steps before the switch (one period spanning them) are dropped
    assert fn.trial.periods == {loop_trial.ALL_OWN: [2000.0] * loop_trial.SAMPLES,
                                loop_trial.ALL_EAGER: [1000.0] * loop_trial.SAMPLES}, fn.trial.periods
    assert len(recorded) == 1 and step_floor.winner(recorded[0]) == EAGER


def test_without_a_backward_no_step_ends_and_the_checks_winner_runs(loop_clock: Any) -> None:
    fn, ran, recorded = _graph(loop_clock, {OWN: 2.0, EAGER: 1.0}, {OWN: 1.0, EAGER: 1.1})
    assert isinstance(fn, loop_trial.Piece)
    with torch.no_grad():
        _steps(fn, _w(), 12, backward=False)
    assert ran == [OWN] * 12 and not recorded and not fn.trial.done


@pytest.mark.parametrize("case", ["band", "failed", "loop_steps-0", "inference"])
def test_what_is_not_weighed_runs_the_checks_winner_as_it_is(loop_clock: Any, case: str) -> None:
    alone = {OWN: 1.0, EAGER: 1.3 if case == "band" else 1.1}
    fn, ran, recorded = _graph(loop_clock, {OWN: 2.0, EAGER: 1.0}, alone,
                               failed={EAGER: "RuntimeError: made to fail"} if case == "failed" else None,
                               samples=0 if case == "loop_steps-0" else loop_trial.SAMPLES,
                               backward=case != "inference")
    assert isinstance(fn, _Side) and fn.name == OWN, fn
    _steps(fn, _w(), 3)
    assert ran == [OWN] * 3 and not recorded


def test_the_trace_is_weighed_only_where_it_won_alone(loop_clock: Any) -> None:
    costs = {OWN: 2.0, EAGER: 3.0, TRACE: 1.0}
    fn, ran, recorded = _graph(loop_clock, costs, {OWN: 1.0, EAGER: 1.1, TRACE: 0.9})
    _steps(fn, _w(), 3 * loop_trial.SAMPLES + 2)
    assert set(fn.trial.periods) == set(loop_trial.CHOICES)
    assert recorded[0].fusegraph and "fusegraph's trace 1000.000 ms" in recorded[0].why, recorded[0].why
    fn, ran, recorded = _graph(loop_clock, costs, {OWN: 1.0, EAGER: 1.1, TRACE: 1.05})
    _steps(fn, _w(), 2 * loop_trial.SAMPLES + 2)
    assert set(fn.trial.periods) == {loop_trial.ALL_OWN, loop_trial.ALL_EAGER} and TRACE not in ran
    assert not recorded[0].fusegraph and step_floor.winner(recorded[0]) == OWN  # the loop: own 2 s, eager 3 s


def test_one_trial_at_a_time_and_a_stale_one_gives_way(loop_clock: Any) -> None:
    first, _, rec_a = _graph(loop_clock, {OWN: 2.0, EAGER: 1.0}, {OWN: 1.0, EAGER: 1.1})
    second, ran_b, rec_b = _graph(loop_clock, {OWN: 1.0, EAGER: 2.0}, {OWN: 1.1, EAGER: 1.0})
    w = _w()
    opt = torch.optim.SGD([w], lr=0.0)
    for _ in range(2 * loop_trial.SAMPLES + 2):
        y = first(torch.randn(4, 6), w)[0]
        y = second(y, w)[0]
        torch.autograd.grad(y.sum(), [w])
        opt.step()
    assert rec_a and not rec_b and ran_b == [EAGER] * len(ran_b)  # the second waited, on its winner
    for _ in range(2 * loop_trial.SAMPLES + 2):
        y = first(torch.randn(4, 6), w)[0]
        y = second(y, w)[0]
        torch.autograd.grad(y.sum(), [w])
        opt.step()
    assert rec_b and step_floor.winner(rec_b[0]) == OWN, rec_b
    # a trial whose graph stops being called gives way, unstored, after STALE_S
    stale, ran_s, rec_s = _graph(loop_clock, {OWN: 2.0, EAGER: 1.0}, {OWN: 1.0, EAGER: 1.1})
    other, ran_o, rec_o = _graph(loop_clock, {OWN: 1.0, EAGER: 2.0}, {OWN: 1.0, EAGER: 1.1})
    _steps(stale, w, 3)
    assert not stale.trial.done
    _steps(other, w, 1)
    assert ran_o == [OWN] and loop_trial.QUEUE.running is stale.trial
    loop_clock.now += loop_trial.STALE_S
    _steps(other, w, 2 * loop_trial.SAMPLES + 2)
    assert stale.trial.done and not rec_s and loop_trial.QUEUE.running is other.trial
    assert rec_o and step_floor.winner(rec_o[0]) == OWN
    before = len(ran_s)
    _steps(stale, w, 2)
    assert ran_s[before:] == [OWN, OWN]  # its check's winner, for good


@pytest.mark.usefixtures("regions_lose")
def test_the_backend_weighs_close_sides_on_the_loop_and_stores_that_verdict(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Through torch.compile: the check alone finds eager within BAND of Inductor's own
    (forced times), the graph reports the loop trial and stores nothing until it decides on
    the real clock; losses match eager's throughout; a second compile reads the verdict and
    times nothing."""
    from test_torch_step_floor import _stored

    from fusegraph.torch.compile_backend import collecting, fusegraph_backend

    monkeypatch.setattr(loop_trial, "QUEUE", loop_trial._Queue())
    clock = step_timer(monkeypatch, tmp_path)
    clock.update(own_ms=1.0, eager_ms=1.1)
    options = {"warmup_s": 0.0}

    def run(compiled: bool, first: bool = False) -> list[float]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
        step = torch.compile(model, backend=partial(fusegraph_backend, options=options)) if compiled else model
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for i in range(2 * loop_trial.SAMPLES_MAX + 3):  # the real clock's steps may need every round
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
            loss = step(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            if first and i == 0:
                assert not _stored(), "stored before the loop's steps decided"
        return losses

    want = run(False)
    torch._dynamo.reset()
    with collecting() as rows:
        got = run(True, first=True)
    assert rows and all(loop_trial.LOOPED in r.why for r in rows), rows[0].why
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    stored = _stored()
    assert len(stored) == 1 and "training loop's own steps timed" in stored[0]["why"], stored
    calls = clock["calls"]
    torch._dynamo.reset()
    with collecting() as rows:
        run(True)
    assert clock["calls"] == calls and rows and all("a stored verdict chose it" in r.why for r in rows), rows[0].why


@pytest.mark.gpu
def test_on_cuda_bf16_channels_last_training_tracks_eager_through_the_trial(tmp_path: Any,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """conv + batch norm + ReLU, channels-last, bf16 autocast, SGD steps as users compile it
    (the default options but the budget, the real clock): the losses track eager's whichever
    sides the trial runs in turn, and the verdict stored says where it came from (the loop's
    steps where the rows say the graph was weighed there, else the check alone)."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU: run on the GPU machine with `pytest -m gpu`")
    from test_torch_step_candidates import cuda_bf16_training_tracks_eager
    from test_torch_step_floor import _stored

    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(loop_trial, "QUEUE", loop_trial._Queue())
    # decided within these steps whatever the noise (the sign test's extra rounds are tested
    # on the virtual clock): a longer bf16 run would drift further from eager's losses
    monkeypatch.setattr(loop_trial, "SAMPLES_MAX", loop_trial.SAMPLES)
    rows = cuda_bf16_training_tracks_eager(3 * loop_trial.SAMPLES + 3, {"budget": None}, lr=0.005)
    stored = _stored()
    assert len(stored) == 1 and stored[0]["source"] == "measured", stored
    weighed = any(loop_trial.LOOPED in r.why for r in rows)
    assert ("training loop's own steps timed" in stored[0]["why"]) == weighed, (weighed, stored[0]["why"])


def test_the_queue_keeps_no_trial_whose_graph_is_gone(loop_clock: Any) -> None:
    import gc

    fn, _, _ = _graph(loop_clock, {OWN: 2.0, EAGER: 1.0}, {OWN: 1.0, EAGER: 1.1})
    _steps(fn, _w(), 2)
    assert loop_trial.QUEUE.running is fn.trial and not fn.trial.done
    del fn
    gc.collect()
    assert loop_trial.QUEUE.running is None
    other, ran, _ = _graph(loop_clock, {OWN: 2.0, EAGER: 1.0}, {OWN: 1.0, EAGER: 1.1})
    _steps(other, _w(), 3)
    assert ran == [OWN, OWN, EAGER]  # admitted at once: its check's winner (twice), then the next turn


@pytest.mark.parametrize("bad", [-1, 2.5, True, "5"])
def test_loop_steps_refuses_with_its_name(bad: Any) -> None:
    from fusegraph.errors import OptionError
    from fusegraph.torch.partition import Options

    assert Options.of({"loop_steps": 0}).loop_steps == 0
    with pytest.raises(OptionError, match="loop_steps"):
        Options.of({"loop_steps": bad})


def test_a_side_without_room_on_the_device_is_left_out(loop_clock: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager saved 40 MiB for its backward in the check, Inductor's own 10 MiB; the graph is
    called twice a step and 64 MiB are free: eager's turn (80 MiB) is left out before it
    runs, and with it the trial (nothing else to weigh): the check's winner, nothing stored."""
    monkeypatch.setattr(loop_trial, "_free", lambda device: 64 * 2**20)
    ran: list[str] = []
    sides = {name: _Side(loop_clock, name, 1.0, ran) for name in (OWN, EAGER)}
    check = Check(step_floor._verdict({OWN: 1.0, EAGER: 1.1}, {}, MARGIN), {OWN: 1.0, EAGER: 1.1}, {}, True,
                  {OWN: 10 * 2**20, EAGER: 40 * 2**20})
    recorded: list[Verdict] = []
    fn = loop_trial.weigh(sides, check, margin=MARGIN, samples=loop_trial.SAMPLES, record=recorded.append)
    _steps(fn, _w(), 6, calls=2)
    assert EAGER not in ran and fn.trial.done, ran
    assert len(recorded) == 1 and "room on the device" in recorded[0].why, recorded
    assert step_floor.winner(recorded[0]) == OWN
    # with room (a step's 80 MiB within 80% of 128 MiB) eager takes its turns
    monkeypatch.setattr(loop_trial, "_free", lambda device: 128 * 2**20)
    ran.clear()
    fn = loop_trial.weigh(sides, check, margin=MARGIN, samples=loop_trial.SAMPLES, record=recorded.append)
    _steps(fn, _w(), 4, calls=2)
    assert EAGER in ran, ran


def test_a_forward_out_of_memory_stops_the_trial_on_the_checks_winner(loop_clock: Any) -> None:
    ran: list[str] = []

    class _Oom(_Side):
        def __call__(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
            raise torch.OutOfMemoryError("made to run out in this test")

    sides = {OWN: _Side(loop_clock, OWN, 1.0, ran), EAGER: _Oom(loop_clock, EAGER, 1.0, ran)}
    recorded: list[Verdict] = []
    fn = loop_trial.weigh(sides, _check({OWN: 1.0, EAGER: 1.1}), margin=MARGIN, samples=loop_trial.SAMPLES,
                          record=recorded.append)
    w = _w()
    _steps(fn, w, 6)  # the third step is eager's first turn: its forward fails, Inductor's own runs it
    assert ran == [OWN] * 6 and fn.trial.done and not recorded, (ran, recorded)


def test_the_check_counts_what_each_side_saves_for_its_backward(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Any) -> None:
    """Distinct storages saved in the first step's forward, the inputs' left out: a side that
    saves only its inputs counts nothing."""
    step_timer(monkeypatch, tmp_path)

    def own(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        return (x * w,)  # saves x and w: inputs

    def eager(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        h = torch.exp(x * w)  # saves its 64 x 32 float32 result (8 KiB), and x * w for sin
        return (torch.sin(h) * h,)

    x, w = torch.randn(64, 32), torch.randn(64, 32, requires_grad=True)
    check = step_floor.time_steps({OWN: own, EAGER: eager}, [x, w], margin=MARGIN, warmup_s=0.0)
    assert check.backward and check.saved[OWN] == 0, check.saved
    assert check.saved[EAGER] >= 2 * 64 * 32 * 4, check.saved
