"""The one way fusegraph times things: `fusegraph bench`, ``autotune`` and benchmarks/ call it.

Why a shared routine: a tuner that counts a candidate's first calls (a thread pool
starting, oneDNN creating its primitives, a CUDA context, a JIT) as its speed stores the
wrong winner, and every later build of the graph inherits it (issue 25: torch recorded at
4.29 ms and IREE kept at 0.51 ms, where interleaved steady-state timing gives 0.466 vs
0.526 ms). So every candidate is first *warmed to a steady state* -- called until the
median of its last few calls stops falling, bounded by ``warmup_s`` -- and only then timed,
in *interleaved rounds*: each round times one block of calls of every candidate, the
order rotating from round to round, so that load spikes on a shared machine and clock
drift hit them all alike. One untimed call precedes each block (it absorbs the switch
from the previous candidate: caches, another library's thread pool). ``sync`` (e.g.
``torch.cuda.synchronize``) is called before and after each timed block, so GPU work is
counted whole and only once, and a sample is the block's time per call. Without a sync
(host work, which ends when the call returns) every call of a block is its own sample: on
a machine shared with other work, a thread of a multi-threaded library descheduled for a
scheduler quantum (milliseconds) stalls the calls it lands in, and the median over calls
leaves those out where a block's mean would carry them. The reported figure is the median
of the samples.

A ``device_clock`` times a synced block on the device instead: it stalls the device for
longer than the host takes to issue the block, then reads the device's own timer around
it, so a sample is device time alone -- what a call costs where its host work overlaps
other device work (a region inside a replayed CUDA graph, or in a graph whose host runs
ahead of the GPU). Host time then has to be judged elsewhere: by whoever times the whole.

Nothing here imports torch or anything above select/; the clock can be replaced (tests
drive fake candidates on a virtual clock, so no test asserts wall-clock times).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

# Warm-up: a window's median must not fall below (1 - STEADY_TOLERANCE) x the previous
# window's for the candidate to count as steady.
STEADY_WINDOW = 3
STEADY_TOLERANCE = 0.05
MIN_WARMUP_CALLS = 2
MAX_WARMUP_CALLS = 2000
# per_round=None: each candidate's block holds enough calls to last about this long
# (timer resolution and the sync's own cost vanish next to it), within these bounds.
TARGET_BLOCK_S = 2e-3
MAX_PER_ROUND = 1000
# a device-timed block is issued while the device stalls: short enough that its launches
# fit the device's queue (the host would otherwise wait and the device run dry)
MAX_PER_DEVICE_BLOCK = 128


class DeviceClock(Protocol):
    """The device's own timer: ``start(host_ms)`` keeps the device busy for longer than
    ``host_ms`` (the host's time to issue the block) and marks the block's start behind
    that; ``stop()`` marks its end, waits for it, and returns the device milliseconds
    between the two marks."""

    def start(self, host_ms: float) -> None: ...

    def stop(self) -> float: ...


@dataclass(frozen=True)
class Timing:
    """One candidate's steady-state time. ``samples`` are milliseconds per call, in the
    order taken: one per round (a synced block's time over its calls), or, for host work
    timed without a sync, one per call."""

    name: str
    median_ms: float
    min_ms: float
    samples: tuple[float, ...]
    per_round: int = 1
    warmup_calls: int = 0
    warmup_ms: float = 0.0  # what the warm-up calls took, all together
    first_call_ms: float = math.nan  # the very first call: what a cold timer would have seen
    steady: bool = True  # False: warm-up ended on its bound with the times still falling
    rounds: int = 0

    @property
    def spread(self) -> float:
        """Interquartile range over the median: how noisy the samples were (0 = not at all)."""
        if len(self.samples) < 4 or self.median_ms <= 0:
            return 0.0
        q = statistics.quantiles(self.samples, n=4)
        return (q[2] - q[0]) / self.median_ms

    def ratio(self, other: Timing) -> float:
        """This candidate's median over ``other``'s (below 1: this one is faster)."""
        return ratio(self, other)


def ratio(a: Timing, b: Timing) -> float:
    """``a``'s median over ``b``'s: 0.5 means ``a`` takes half ``b``'s time."""
    if b.median_ms <= 0:
        return math.inf if a.median_ms > 0 else 1.0
    return a.median_ms / b.median_ms


def fastest(timings: Mapping[str, Timing], order: Sequence[str] | None = None, *, tie_margin: float = 0.0) -> str:
    """The name to pick: the lowest median, except that a candidate within ``tie_margin``
    (a fraction: 0.02 = 2%) of the lowest that comes earlier in ``order`` (a preference
    order, e.g. the heuristic's) wins the tie -- between times that differ only by noise,
    the faster sample is luck, and the preferred candidate is the better bet."""
    if not timings:
        raise ValueError("no timings to choose from")
    names = [n for n in (order or ()) if n in timings] + [n for n in timings if n not in (order or ())]
    best = min(t.median_ms for t in timings.values())
    return next(n for n in names if timings[n].median_ms <= best * (1.0 + tie_margin))


def time_candidates(
    candidates: Mapping[str, Callable[[], object]],
    *,
    sync: Callable[[], None] | Mapping[str, Callable[[], None] | None] | None = None,
    warmup_s: float = 1.0,
    min_warmup: int = MIN_WARMUP_CALLS,
    min_rounds: int = 5,
    per_round: int | None = None,
    budget_s: float | None = None,
    steady: bool = True,
    max_rounds: int = 200,
    drop_slower_than: float | None = None,
    on_error: Callable[[str, Exception], None] | None = None,
    on_round: Callable[[int, int], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    device_clock: DeviceClock | None = None,
) -> dict[str, Timing]:
    """Times every candidate (a no-argument callable) as the module docstring says.

    ``sync``: one function for all, or one per candidate name (a plan's own
    ``synchronize``); it is called inside the timed span, so it should wait for the device
    and do nothing else. ``warmup_s``: the most time one candidate's warm-up may take (it stops sooner once
    steady; it always makes at least ``min_warmup`` calls). ``steady=False`` skips the
    steadiness test: just the ``min_warmup`` calls. ``min_rounds``: rounds always run.
    ``per_round``: calls per timed block; None sizes each candidate's block from its
    warm-up to last about TARGET_BLOCK_S. ``budget_s``: the whole call's wall time, warm-up
    included; rounds continue past ``min_rounds`` until it is spent (or ``max_rounds``);
    None runs exactly ``min_rounds``. ``drop_slower_than``: after ``min_rounds``, a
    candidate whose median is over this multiple of the best stops being timed (its
    samples stand). ``on_error``: where given, a candidate that raises is reported to it and
    left out of the result; otherwise the exception propagates. ``on_round(done, planned)``
    follows progress (planned is ``max_rounds`` when a budget decides). ``device_clock``:
    synced blocks are timed by it (device time; see the module docstring)."""
    if min_rounds < 1:
        raise ValueError(f"min_rounds must be at least 1, got {min_rounds}")
    if per_round is not None and per_round < 1:
        raise ValueError(f"per_round must be at least 1 (or None for automatic), got {per_round}")
    syncs: dict[str, Callable[[], None] | None] = (
        {n: sync.get(n) for n in candidates} if isinstance(sync, Mapping) else dict.fromkeys(candidates, sync)
    )
    t_start = clock()
    deadline = math.inf if budget_s is None else t_start + budget_s
    live: dict[str, Callable[[], object]] = dict(candidates)
    warm: dict[str, _Warmup] = {}
    for name, fn in list(live.items()):
        try:
            warm[name] = _warm_up(fn, syncs[name], warmup_s if steady else 0.0, steady, max(1, min_warmup), clock)
        except Exception as exc:
            if on_error is None:
                raise
            on_error(name, exc)
            del live[name]
    blocks = {name: per_round or _block_size(warm[name].fast_ms) for name in live}
    if device_clock is not None:
        blocks = {name: min(b, MAX_PER_DEVICE_BLOCK) for name, b in blocks.items()}
    samples: dict[str, list[float]] = {name: [] for name in live}
    done = dict.fromkeys(live, 0)  # rounds each candidate was timed in
    timed = dict(live)  # still being timed (drop_slower_than may retire some)
    planned = min_rounds if budget_s is None else max(min_rounds, max_rounds)
    names = list(timed)
    rnd = 0
    while timed and rnd < planned:
        shift = rnd % len(names)
        for name in names[shift:] + names[:shift]:
            call = timed.get(name)
            if call is None:
                continue
            wait = syncs[name]
            try:
                call()  # untimed: absorbs the switch from the previous candidate
                if wait is not None:
                    wait()
                block = blocks[name]
                if wait is None:  # host work: each call is a sample
                    got = samples[name]
                    t0 = clock()
                    for _ in range(block):
                        call()
                        t1 = clock()
                        got.append((t1 - t0) * 1e3)
                        t0 = t1
                elif device_clock is not None:
                    device_clock.start(block * warm[name].fast_ms)
                    for _ in range(block):
                        call()
                    samples[name].append(device_clock.stop() / block)
                else:
                    t0 = clock()
                    for _ in range(block):
                        call()
                    wait()
                    samples[name].append((clock() - t0) * 1e3 / block)
                done[name] += 1
            except Exception as exc:
                if on_error is None:
                    raise
                on_error(name, exc)
                del timed[name], live[name], samples[name]
        rnd += 1
        if on_round is not None:
            on_round(rnd, planned)
        if rnd >= min_rounds:
            if clock() >= deadline:
                break
            if drop_slower_than is not None and len(timed) > 1:
                medians = {c: statistics.median(samples[c]) for c in timed}
                best = min(medians.values())
                for c, med in medians.items():
                    if med > drop_slower_than * best:
                        del timed[c]
    return {name: _timing(name, samples[name], blocks[name], done[name], warm[name]) for name in live if samples[name]}


@dataclass(frozen=True)
class _Warmup:
    calls: int
    total_ms: float
    first_ms: float
    fast_ms: float  # the fastest call: what a block is sized by (a stall must not shrink it to one call)
    steady: bool


def _warm_up(
    fn: Callable[[], object],
    sync: Callable[[], None] | None,
    warmup_s: float,
    check: bool,
    min_calls: int,
    clock: Callable[[], float],
) -> _Warmup:
    """Calls ``fn`` until the median of its last STEADY_WINDOW calls no longer falls below
    the previous window's by more than STEADY_TOLERANCE, or ``warmup_s`` is spent."""
    times: list[float] = []
    t_begin = clock()
    is_steady = not check
    while len(times) < max(MAX_WARMUP_CALLS, min_calls):
        if sync is not None:
            sync()
        t0 = clock()
        fn()
        if sync is not None:
            sync()
        t1 = clock()
        times.append((t1 - t0) * 1e3)
        if len(times) < min_calls:
            continue
        if not check:
            break
        if len(times) >= 2 * STEADY_WINDOW:
            last = statistics.median(times[-STEADY_WINDOW:])
            before = statistics.median(times[-2 * STEADY_WINDOW : -STEADY_WINDOW])
            if last >= (1.0 - STEADY_TOLERANCE) * before:
                is_steady = True
                break
        if t1 - t_begin >= warmup_s:
            break
    return _Warmup(len(times), sum(times), times[0], min(times), is_steady)


def _block_size(call_ms: float) -> int:
    if call_ms <= 0:
        return MAX_PER_ROUND
    return max(1, min(MAX_PER_ROUND, math.ceil(TARGET_BLOCK_S * 1e3 / call_ms)))


def _timing(name: str, samples: list[float], per_round: int, rounds: int, w: _Warmup) -> Timing:
    return Timing(
        name=name,
        median_ms=statistics.median(samples),
        min_ms=min(samples),
        samples=tuple(samples),
        per_round=per_round,
        warmup_calls=w.calls,
        warmup_ms=w.total_ms,
        first_call_ms=w.first_ms,
        steady=w.steady,
        rounds=rounds,
    )
