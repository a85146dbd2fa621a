"""The one timing routine (fusegraph/select/timing.py), driven by fake candidates on a
virtual clock: each call advances the clock by the candidate's cost, so these tests check
the method (warm-up to a steady state, interleaving, medians), never wall-clock times."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
from engine_fakes import Clock

from fusegraph.select import timing
from fusegraph.select.timing import Timing, fastest, ratio, time_candidates


def fake(clock: Clock, costs_ms: Callable[[int], float], log: list[str] | None = None, name: str = "") -> Callable[[], None]:
    """A candidate whose i-th call (from 0) takes ``costs_ms(i)`` virtual milliseconds."""
    calls = [0]

    def call() -> None:
        clock.now += costs_ms(calls[0]) / 1e3
        calls[0] += 1
        if log is not None:
            log.append(name)

    return call


def test_slow_first_calls_do_not_lose_to_a_steadily_slower_candidate() -> None:
    # Issue 25's case: torch's first calls (thread pool start, primitive creation) take
    # milliseconds, then it runs in 0.466 ms; IREE runs every call in 0.526 ms.
    clock = Clock()
    torch_like = fake(clock, lambda i: [20.0, 8.0, 4.0, 1.5, 0.9, 0.6][i] if i < 6 else 0.466)
    iree_like = fake(clock, lambda i: 0.526)
    got = time_candidates({"torch": torch_like, "iree": iree_like}, clock=clock)
    assert fastest(got) == "torch"
    assert got["torch"].median_ms == pytest.approx(0.466)
    assert got["iree"].median_ms == pytest.approx(0.526)
    assert got["torch"].steady and got["torch"].first_call_ms == pytest.approx(20.0)
    assert got["torch"].warmup_calls > got["iree"].warmup_calls  # it needed longer to settle
    assert ratio(got["torch"], got["iree"]) == pytest.approx(0.466 / 0.526)
    assert got["torch"].ratio(got["iree"]) < 1.0


def test_warm_up_without_the_steady_test_counts_slow_first_calls() -> None:
    """The control for the test above: with a fixed two-call warm-up and single-call blocks,
    the slow start is timed, and the steadily slower candidate wins -- the tuner's old bug."""
    clock = Clock()
    torch_like = fake(clock, lambda i: 5.0 if i < 30 else 0.466)
    iree_like = fake(clock, lambda i: 0.526)
    got = time_candidates({"torch": torch_like, "iree": iree_like}, clock=clock, steady=False, per_round=1, min_rounds=5)
    assert fastest(got) == "iree"


def test_warm_up_is_bounded_and_says_when_it_never_settled() -> None:
    clock = Clock()
    forever_falling = fake(clock, lambda i: 100.0 * 0.8**i + 0.1)
    got = time_candidates({"a": forever_falling}, clock=clock, warmup_s=0.5, min_rounds=2, per_round=1)
    t = got["a"]
    assert not t.steady
    assert 0.5e3 <= t.warmup_ms < 0.5e3 + 100.0  # stopped at the first call past the bound
    assert t.rounds == 2


def test_rounds_interleave_and_rotate() -> None:
    clock = Clock()
    log: list[str] = []
    cands = {n: fake(clock, lambda i: 1.0, log, n) for n in ("a", "b", "c")}
    time_candidates(cands, clock=clock, min_rounds=3, per_round=2, steady=False)
    warm_calls = timing.MIN_WARMUP_CALLS * 3
    rounds = log[warm_calls:]
    blocks = [rounds[i] for i in range(0, len(rounds), 3)]  # one switch call + 2 timed per block
    assert blocks == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


def test_sync_brackets_every_timed_block() -> None:
    clock = Clock()
    events: list[str] = []

    def gpu_like() -> None:
        events.append("call")
        clock.now += 1e-3

    def sync() -> None:
        events.append("sync")

    time_candidates({"g": gpu_like}, sync=sync, clock=clock, min_rounds=2, per_round=3, steady=False)
    timed = events[3 * timing.MIN_WARMUP_CALLS :]  # warm-up: sync, call, sync per call
    assert timed == ["call", "sync", "call", "call", "call", "sync"] * 2


def test_samples_are_per_call_medians_over_rounds() -> None:
    clock = Clock()
    # every 4th round is slowed down (a load spike): the median ignores it
    spikes: Sequence[float] = [1.0, 1.0, 1.0, 9.0]
    n = [0]

    def noisy() -> None:  # 2 warm-up calls, then 1 switch call + 3 timed calls per round
        rnd = max(0, n[0] - timing.MIN_WARMUP_CALLS) // 4
        clock.now += spikes[rnd % 4] / 1e3
        n[0] += 1

    got = time_candidates({"x": noisy}, clock=clock, min_rounds=8, per_round=3, steady=False)
    t = got["x"]
    assert t.rounds == 8 and t.per_round == 3
    assert t.median_ms == pytest.approx(1.0) and t.min_ms == pytest.approx(1.0)
    assert max(t.samples) == pytest.approx(9.0)  # the spike was seen, just not reported as the speed


def test_automatic_block_size_targets_a_couple_of_milliseconds() -> None:
    clock = Clock()
    got = time_candidates(
        {"tiny": fake(clock, lambda i: 0.01), "big": fake(clock, lambda i: 50.0)}, clock=clock, min_rounds=1
    )
    want = timing.TARGET_BLOCK_S * 1e3 / 0.01  # 200 calls, give or take the clock's rounding
    assert abs(got["tiny"].per_round - want) <= 1
    assert got["big"].per_round == 1


def test_budget_extends_rounds_and_slow_candidates_drop_out() -> None:
    clock = Clock()
    got = time_candidates(
        {"fast": fake(clock, lambda i: 1.0), "slow": fake(clock, lambda i: 5.0)},
        clock=clock,
        min_rounds=3,
        per_round=1,
        budget_s=1.0,
        drop_slower_than=2.0,
        steady=False,
    )
    assert got["slow"].rounds == 3  # retired after the minimum; its samples stand
    assert got["fast"].rounds > 3
    assert clock.now < 1.2  # the budget bounds the whole call (one block may overrun it)


def test_errors_propagate_or_are_reported() -> None:
    clock = Clock()

    def broken() -> None:
        raise RuntimeError("kernel launch failed")

    cands = {"ok": fake(clock, lambda i: 1.0), "broken": broken}
    with pytest.raises(RuntimeError, match="kernel launch"):
        time_candidates(cands, clock=clock, min_rounds=1)
    seen: dict[str, str] = {}
    got = time_candidates(cands, clock=clock, min_rounds=1, on_error=lambda n, e: seen.__setitem__(n, str(e)))
    assert set(got) == {"ok"} and seen == {"broken": "kernel launch failed"}


def test_fastest_breaks_ties_by_preference_order() -> None:
    a = Timing("a", 1.00, 1.0, (1.0,))
    b = Timing("b", 1.015, 1.0, (1.015,))
    assert fastest({"a": a, "b": b}) == "a"
    assert fastest({"a": a, "b": b}, ["b", "a"], tie_margin=0.02) == "b"  # within 2%: preferred one
    assert fastest({"a": a, "b": b}, ["b", "a"], tie_margin=0.01) == "a"  # outside 1%: fastest


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="min_rounds"):
        time_candidates({}, min_rounds=0)
    with pytest.raises(ValueError, match="per_round"):
        time_candidates({}, per_round=0)
    with pytest.raises(ValueError, match="no timings"):
        fastest({})


def test_real_clock_smoke() -> None:
    """The default clock: two trivially cheap callables give finite positive medians."""
    got = time_candidates({"a": lambda: sum(range(50)), "b": lambda: None}, warmup_s=0.05, min_rounds=2)
    assert all(t.median_ms > 0 and math.isfinite(t.median_ms) for t in got.values())


def test_host_work_is_sampled_per_call_so_stalls_stay_out_of_the_median() -> None:
    """A multi-threaded library on a busy machine: one call in three is stalled by a
    scheduler quantum (16 ms). Per-call samples keep the median at the clean 0.5 ms; a
    synced block's mean (the GPU way) would carry a stall in every block."""
    clock = Clock()
    stalled = fake(clock, lambda i: 16.5 if i % 3 == 2 else 0.5)
    host = time_candidates({"x": stalled}, clock=clock, min_rounds=6, per_round=4, steady=False)["x"]
    assert len(host.samples) == 6 * 4 and host.rounds == 6
    assert host.median_ms == pytest.approx(0.5)
    synced = time_candidates({"x": fake(clock, lambda i: 16.5 if i % 3 == 2 else 0.5)}, sync=lambda: None,
                             clock=clock, min_rounds=6, per_round=4, steady=False)["x"]
    assert len(synced.samples) == 6 and synced.median_ms > 4.0


class _FakeDevice:
    """A device whose work runs behind the host: each call costs the host ``host_ms`` on the
    virtual clock and queues ``device_ms`` of device work; stop() reports the queued work
    since start() -- what a device timer behind a stall sees."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.queued = 0.0
        self.started_at: float | None = None
        self.stalls: list[float] = []

    def candidate(self, host_ms: float, device_ms: float) -> Callable[[], None]:
        def call() -> None:
            self.clock.now += host_ms / 1e3
            self.queued += device_ms

        return call

    def start(self, host_ms: float) -> None:
        self.stalls.append(host_ms)
        self.started_at = self.queued

    def stop(self) -> float:
        assert self.started_at is not None, "stop() without start()"
        got, self.started_at = self.queued - self.started_at, None
        return got


def test_a_device_clock_times_device_work_and_not_the_hosts() -> None:
    # a region whose call costs 0.08 ms of host time around a 0.03 ms kernel, against an
    # incumbent with 0.02 ms of host time around a 0.05 ms kernel: on the host clock the
    # region loses, on the device it wins -- the device clock must give the device's answer
    clock = Clock()
    dev = _FakeDevice(clock)
    cands = {"region": dev.candidate(0.08, 0.03), "incumbent": dev.candidate(0.02, 0.05)}
    on_host = time_candidates(cands, clock=clock, sync=lambda: None)
    assert fastest(on_host) == "incumbent"
    got = time_candidates(cands, clock=clock, sync=lambda: None, device_clock=dev)
    assert fastest(got) == "region"
    assert got["region"].median_ms == pytest.approx(0.03) and got["incumbent"].median_ms == pytest.approx(0.05)
    # blocks are capped so that their launches fit the device's queue, and each stall is
    # told how long the host will take to issue its block
    assert max(t.per_round for t in got.values()) <= timing.MAX_PER_DEVICE_BLOCK
    assert min(dev.stalls) > 0 and max(dev.stalls) >= got["region"].per_round * 0.08 * 0.99
