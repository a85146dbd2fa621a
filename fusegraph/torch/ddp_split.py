"""The step check inside DDP's graph split, where it waits for real inputs and then for the
user's own steps.

DDP's optimizer splits a Dynamo graph at its gradient buckets and compiles each piece
alone, calling each compiled piece once on fake inputs to read its outputs' layout
(step_floor.FAKIFIED). So each piece's candidates (Inductor's own compile, eager, fusegraph's
trace) are compiled at once and timed at the piece's first real call (Deferred), on copies
of its inputs, as step_floor times a whole graph.

That isolated timing cannot see what DDP does between the pieces: it all-reduces a bucket's
gradients while the backward goes on, as soon as they are ready. Eager's backward readies
them one at a time; a compiled piece's backward, all at its end. On two H200s (a 4-layer
GPT, bf16, 12 pieces over two ranks) the isolated checks gave most pieces to Inductor's own
compile, while whole steps, interleaved, ran 15.18 ms eager against 16.84 ms under
Inductor. So the pieces of one split are then chosen together, on the user's own steps
(Trial): the choices to weigh are every piece on Inductor's own compile, every piece eager,
and each piece on its own check's winner; the steps take them in turn, each timed from the
first piece's call to its next (the device synchronized there, so a period is one whole
step: forward, backward, all-reduce, optimizer, data), and the fastest by median is kept.
Each piece's side is then stored as its verdict, and a later compile reads it."""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fusegraph.regions.verdicts import Verdict
from fusegraph.select import timing
from fusegraph.torch import graph_floor, step_floor
from fusegraph.torch.step_floor import (
    EAGER,
    ENGINE,
    NAMES,
    OWN,
    TRACE,
    device_of,
    layout,
    reason,
    time_steps,
    winner,
)

log = logging.getLogger("fusegraph.torch")

DEFERRED = ("the step check runs at the piece's first real call (DDP's graph split fakes the first), then "
            "on the training loop's own steps with the split's other pieces")

# the choices weighed on the user's steps, in the order ties go: Inductor's own (the
# incumbent), eager (what the user could call without fusegraph), each piece's own winner
ALL_OWN, ALL_EAGER, EACH = "every piece Inductor's own compile", "every piece eager", "each piece its own check's winner"
CHOICES = (ALL_OWN, ALL_EAGER, EACH)
SAMPLES = 5  # the user's steps timed per choice


def settle(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], compile_own: Callable[[], Callable[..., Any]],
           eager: Callable[..., Any], trace: Callable[..., Any] | None = None, *, margin: float,
           warmup_s: float, record: Callable[[Verdict], None] | None = None
           ) -> tuple[str, Callable[..., Any], Verdict | None]:
    """step_floor.settle, except in a piece of DDP's graph split (step_floor.FAKIFIED, where
    nothing else forbids the check): there Inductor's own is compiled at once, uncalled, and
    the function returned is a Deferred one, whose real calls take the verdict and hand it
    to ``record``; the side named is the one DDP's fake call reads."""
    sides = 3 if trace is not None else 2
    if not step_floor.fakified_first_call() or step_floor.why_not(gm, example_inputs, sides) != step_floor.FAKIFIED:
        return step_floor.settle(gm, example_inputs, compile_own, eager, trace, margin=margin, warmup_s=warmup_s)
    candidates = step_floor.compiled_sides(compile_own, eager, trace)
    if candidates is None:  # Inductor's own failed: the trace stands (compiled_sides raises without one)
        assert trace is not None
        return TRACE, trace, None
    default = TRACE if trace is not None else OWN
    return default, Deferred(candidates, default, margin=margin, warmup_s=warmup_s, record=record), None


def _clock() -> float:
    """The loop's clock, looked up at each step; tests replace this."""
    return time.perf_counter()


def _is_fake(x: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


class Deferred:
    """A piece of DDP's graph split. DDP's first call, on fake inputs, gets the fake outputs
    of the ``default`` candidate; every AOTAutograd candidate's fake first result is taken
    there, so none returns one later. The first real call times the candidates as steps on
    copies of its inputs (step_floor.time_steps): a candidate whose outputs are laid out
    otherwise than the fake ones DDP compiled the next piece for is never run again, and
    where the check cannot run only the default runs. Then the piece's Trial (its split's
    pieces together) chooses its side on the user's steps, and ``record`` stores the verdict."""

    def __init__(self, candidates: Mapping[str, Callable[..., Any]], default: str, *, margin: float,
                 warmup_s: float, record: Callable[[Verdict], None] | None) -> None:
        self.candidates = dict(candidates)
        self.default = default
        self.margin, self.warmup_s, self.record = margin, warmup_s, record
        self.expected: list[object] | None = None
        self.chosen: Callable[..., Any] | None = None
        self.checked: Verdict | None = None  # the first real call's check
        self.own_winner = default  # that check's winner (the default where it did not run)
        self.runnable = set(self.candidates)  # the candidates that did not fail the check
        self.seen = False  # whether a real call came
        self.trial = Trial.of_split(margin)
        self.trial.join(self)

    def __call__(self, *args: Any) -> Any:
        if self.chosen is not None:
            return self.chosen(*args)
        if any(_is_fake(a) for a in args):
            out = None
            for name, fn in self.candidates.items():
                if name != EAGER:  # eager's graph is not AOTAutograd's: no fake result held
                    result = fn(*args)
                    out = result if name == self.default else out
            self.expected = layout(out)
            return out
        if not self.seen:  # the first real step: each piece checked alone
            self.seen = True
            self._check(args)
            return self.candidates[self.own_winner](*args)
        side = self.trial.side(self, args)
        if self.chosen is not None:  # the trial decided at this step's start
            return self.chosen(*args)
        return self.candidates[side](*args)

    def _check(self, args: Sequence[Any]) -> None:
        cannot = graph_floor.room(args, device_of(args), copies=len(self.candidates))
        if cannot:
            log.info("the DDP piece's step was not timed: %s; %s runs it", cannot, NAMES[self.default])
            self.runnable = {self.default}
            return
        failed: dict[str, str] = {}
        try:
            verdict = time_steps(self.candidates, args, margin=self.margin, warmup_s=self.warmup_s,
                                 expected=self.expected, failed=failed)
        except Exception as exc:  # never the user's step
            log.warning("the DDP piece's step check did not run (%s: %s); %s runs it", type(exc).__name__, exc,
                        NAMES[self.default], exc_info=log.isEnabledFor(logging.DEBUG))
            self.runnable = {self.default}
            return
        log.info("DDP piece: %s", reason(verdict))
        self.checked, self.own_winner = verdict, winner(verdict)
        self.runnable -= set(failed)

    def settle(self, side: str, why: str, ms: float | None = None, own_ms: float | None = None) -> None:
        """Run ``side`` from now on, the losers let go; store the verdict saying so (``ms``:
        the whole step's median as chosen, ``own_ms``: with every piece on Inductor's own;
        without them, this piece's own check's times)."""
        self.chosen = self.candidates[side]
        self.candidates.clear()
        if self.record is None:
            return
        checked = self.checked
        own_check = f"; the piece alone: {checked.why}" if checked is not None else ""
        if ms is None and checked is not None:
            ms, own_ms = (checked.fusegraph_ms if side == TRACE else checked.incumbent_ms), checked.incumbent_ms
        verdict = Verdict(side == TRACE, "measured", f"{why}{own_check}", ENGINE, ms if side == TRACE else None,
                          own_ms if side == TRACE else ms, NAMES[EAGER] if side == EAGER else NAMES[OWN])
        try:
            self.record(verdict)
        except Exception as exc:  # the choice still stands for this process
            log.warning("the DDP piece's verdict was not stored (%s: %s)", type(exc).__name__, exc)


@dataclasses.dataclass
class Trial:
    """The pieces of one DDP graph split chosen together on the user's steps (module
    docstring). Kept on DDP's own per-split context, so each split has one."""

    margin: float
    pieces: list[Deferred] = dataclasses.field(default_factory=list)
    periods: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    turn: str | None = None  # the choice the current step runs
    since: float | None = None  # when the current step began (its first piece's call, synchronized)
    done: bool = False

    @staticmethod
    def of_split(margin: float) -> Trial:
        from torch._guards import TracingContext

        context = TracingContext.try_get()
        split = getattr(context, "ddp_optimizer_ctx", None) if context is not None else None
        trial = getattr(split, "fusegraph_trial", None)
        if not isinstance(trial, Trial):
            trial = Trial(margin)
            if split is not None:
                split.fusegraph_trial = trial
        return trial

    def join(self, piece: Deferred) -> None:
        self.pieces.append(piece)

    def sides(self, choice: str) -> tuple[str, ...]:
        def side(piece: Deferred) -> str:
            want = {ALL_OWN: OWN, ALL_EAGER: EAGER}.get(choice, piece.own_winner)
            return want if want in piece.runnable else piece.own_winner
        return tuple(side(p) for p in self.pieces)

    def side(self, piece: Deferred, args: Sequence[Any]) -> str:
        """The side ``piece`` runs in the current step (a step after the first, in which the
        pieces were checked alone): the turn's choice."""
        if piece is self.pieces[0]:
            self._tick(device_of(args))
        if self.turn is None:
            return piece.own_winner
        return self.sides(self.turn)[self.pieces.index(piece)]

    def _tick(self, device: torch.device) -> None:
        """A step begins: the last one's period is kept and the next choice takes its turn."""
        if not self.periods:
            distinct: dict[tuple[str, ...], str] = {}
            for choice in CHOICES:
                distinct.setdefault(self.sides(choice), choice)
            self.periods = {choice: [] for choice in distinct.values()}
            if len(self.periods) == 1:  # nothing to weigh
                self._decide()
                return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = _clock()
        if self.turn is not None and self.since is not None:
            self.periods[self.turn].append((now - self.since) * 1e3)
        if all(len(p) >= SAMPLES for p in self.periods.values()):
            self._decide()
            return
        choices = list(self.periods)
        self.turn = choices[sum(len(p) for p in self.periods.values()) % len(choices)]
        self.since = now

    def _decide(self) -> None:
        self.done = True
        timed = {c: p for c, p in self.periods.items() if p}
        ms: float | None = None
        own_ms: float | None = None
        if timed:
            medians = {c: statistics.median(p) for c, p in timed.items()}
            choice = timing.fastest({c: timing.Timing(c, t, t, (t,)) for c, t in medians.items()}, order=CHOICES,
                                    tie_margin=self.margin)
            steps = " vs ".join(f"{c} {medians[c]:.3f} ms" for c in sorted(medians, key=medians.__getitem__))
            why = (f"the DDP split's steps timed in the training loop: {steps} (medians of {SAMPLES}; ties within "
                   f"{self.margin:.0%} go to Inductor's own, then eager); {choice}")
            ms, own_ms = medians[choice], medians.get(ALL_OWN, medians[choice])
        else:
            choice, why = EACH, "each piece its own check's winner: the other choices gave the same sides"
        log.info("%s", why)
        for piece, side in zip(self.pieces, self.sides(choice), strict=True):
            piece.settle(side, why, ms, own_ms)
