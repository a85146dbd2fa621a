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
(loop_trial.Trial, kept on DDP's own per-split context): the choices to weigh are every
piece on Inductor's own compile, every piece eager, and each piece on its own check's
winner. Each piece's side is then stored as its verdict, and a later compile reads it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fusegraph.regions.verdicts import Verdict
from fusegraph.torch import graph_floor, step_floor
from fusegraph.torch.loop_trial import SAMPLES, Piece, Trial
from fusegraph.torch.step_floor import (
    EAGER,
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


def defer(compile_own: Callable[[], Callable[..., Any]], eager: Callable[..., Any],
          trace: Callable[..., Any] | None, *, margin: float, warmup_s: float, samples: int,
          record: Callable[[Verdict], None] | None) -> step_floor.Settled:
    """A piece of DDP's graph split (step_floor.FAKIFIED): Inductor's own compiled at once,
    uncalled, and a Deferred function returned, whose real calls take the verdict and hand
    it to ``record``; the side named is the one DDP's fake call reads."""
    candidates = step_floor.compiled_sides(compile_own, eager, trace)
    if candidates is None:  # Inductor's own failed: the trace stands (compiled_sides raises without one)
        assert trace is not None
        return step_floor.Settled(TRACE, trace)
    default = TRACE if trace is not None else OWN
    fn = Deferred(candidates, default, margin=margin, warmup_s=warmup_s, samples=samples, record=record)
    return step_floor.Settled(default, fn, candidates)


def _is_fake(x: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


def of_split(margin: float, samples: int) -> Trial:
    """The Trial of the DDP split being compiled, kept on DDP's own per-split context (a new
    one where there is none)."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    split = getattr(context, "ddp_optimizer_ctx", None) if context is not None else None
    trial = getattr(split, "fusegraph_trial", None)
    if not isinstance(trial, Trial):
        trial = Trial(margin, samples)
        if split is not None:
            split.fusegraph_trial = trial
    return trial


class Deferred(Piece):
    """A piece of DDP's graph split. DDP's first call, on fake inputs, gets the fake outputs
    of the ``default`` candidate; every AOTAutograd candidate's fake first result is taken
    there, so none returns one later. The first real call times the candidates as steps on
    copies of its inputs (step_floor.time_steps): a candidate whose outputs are laid out
    otherwise than the fake ones DDP compiled the next piece for is never run again, and
    where the check cannot run only the default runs. Then the piece's Trial (its split's
    pieces together) chooses its side on the user's steps, and ``record`` stores the verdict."""

    def __init__(self, candidates: Mapping[str, Callable[..., Any]], default: str, *, margin: float,
                 warmup_s: float, samples: int = SAMPLES, record: Callable[[Verdict], None] | None) -> None:
        super().__init__(candidates, default, of_split(margin, samples), record=record)
        self.default = default
        self.margin, self.warmup_s = margin, warmup_s
        self.expected: list[object] | None = None
        self.seen = False  # whether a real call came

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
        return self.run(args)

    def _check(self, args: Sequence[Any]) -> None:
        cannot = graph_floor.room(args, device_of(args), copies=len(self.candidates))
        if cannot:
            log.info("the DDP piece's step was not timed: %s; %s runs it", cannot, NAMES[self.default])
            self.runnable = {self.default}
            return
        try:
            check = time_steps(self.candidates, args, margin=self.margin, warmup_s=self.warmup_s,
                               expected=self.expected)
        except Exception as exc:  # never the user's step
            log.warning("the DDP piece's step check did not run (%s: %s); %s runs it", type(exc).__name__, exc,
                        NAMES[self.default], exc_info=log.isEnabledFor(logging.DEBUG))
            self.runnable = {self.default}
            return
        log.info("DDP piece: %s", reason(check.verdict))
        self.checked, self.own_winner = check.verdict, winner(check.verdict)
        self.times, self.saved = dict(check.times), dict(check.saved)
        self.runnable -= set(check.failed)
