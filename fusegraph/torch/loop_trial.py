"""The step check's choice weighed again on the user's own training steps.

A Dynamo graph timed alone as a step (step_floor.py) can misjudge the step it is part of:
what runs beside it is not there. Under FSDP2, as its recipes compile it (each transformer
block's ``module.compile``: one graph called twelve times a step), the block's step alone
gave Inductor's own compile 2.135 ms against eager's 2.200 (a tie, so Inductor's own ran),
while whole steps ran 59.98 ms eager against 63.53 under Inductor (2x H200, GPT-2-sized,
bf16): eager's backward readies each gradient for FSDP2's reduce-scatter as it comes, a
compiled backward all of them at its end. DDP's graph split has the same blind spot
(ddp_split.py).

So where the check leaves more than one side within BAND of the fastest alone, and the
step has a backward, the graph (a Piece) runs those sides in turn on the user's steps, one
choice a step for every call of the graph in it, SAMPLES steps each, and keeps the fastest
median (ties within the margin go to Inductor's own, then eager, as in the check). The
user's steps vary (evaluation, logging, data stalls, another process on the device), so a
median can come out faster by chance, and the verdict is kept for good: a side displaces
the incumbent (the earliest in CHOICES timed) only where it was faster in enough of their
paired rounds that chance alone would do so with probability at most ALPHA (a one-sided
sign test). Short of that, turns go on, a decision after each full round, up to
SAMPLES_MAX steps each; the incumbent runs where even those leave it within the noise. A step
is timed from one start to the next, the device synchronized there, so a period holds the
whole step: forward, backward, communication, optimizer, data. A step starts at a call of
the trial's first graph made outside a backward after that graph's backward ran and, once
the process has taken a ``torch.optim`` step, after another such step: a graph called many
times a step (per-block compile), again inside the backward (activation checkpointing's
recompute), or in each micro-step of gradient accumulation (DDP's ``no_sync``: only the
last all-reduces) starts one step per optimizer step, so every period holds whole cycles. A
loop with no ``torch.optim`` step in its first NO_OPTIMIZER backwards is timed on its
backwards alone. A graph whose backward never runs (inference, a frozen feature extractor)
starts no step after its first and keeps running its check's winner, the first turn.

A side runs its turn only where the tensors it saved for the backward in the check, times
the graph's calls a step, fit in ROOM of the device memory free at the step's start: the
user's memory is fuller than at the check (the optimizer's state comes at its first step),
and an eager backward that ran out of memory would fail the user's step where nothing can
catch it. A forward that runs out of memory stops the trial, which keeps the check's winner.

One trial runs at a time in a process (QUEUE): trials in lockstep would time each other's
turns. The verdict is stored once the trial decides, so a process stopped before that
leaves the graph to be checked again."""

from __future__ import annotations

import logging
import math
import statistics
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fusegraph.regions.verdicts import Verdict
from fusegraph.select import timing
from fusegraph.torch import graph_floor
from fusegraph.torch.step_floor import EAGER, ENGINE, NAMES, OWN, TRACE, Check, device_of, winner

log = logging.getLogger("fusegraph.torch")

# the choices, in the order ties go: Inductor's own (the incumbent), eager (what the user
# could call without fusegraph), each graph's own check's winner
ALL_OWN, ALL_EAGER, EACH = "every piece Inductor's own compile", "every piece eager", "each piece its own check's winner"
CHOICES = (ALL_OWN, ALL_EAGER, EACH)
SAMPLES = 5  # the user's steps timed per choice before the first decision (the backend's option ``loop_steps``)
# steps per choice at most while no side beats the incumbent beyond the noise (loop_steps scales it)
SAMPLES_MAX = 4 * SAMPLES
ALPHA = 0.05  # the sign test's level: how often chance alone may let a side no faster displace the incumbent
BAND = 1.25  # a choice whose graphs took longer than this times the fastest's alone is not weighed
STALE_S = 60.0  # a trial whose graph started no step for this long gives way to the next
NO_OPTIMIZER = 32  # backwards without a torch.optim step after which a trial times backwards alone
ROOM = 0.8  # a turn runs where its steps' saved tensors take at most this share of the device's free memory
LOOPED = ("then weighed on the training loop's own steps against the other sides within "
          f"{BAND - 1:.0%} of the fastest alone")


def _clock() -> float:
    """The loop's clock, looked up at each step; tests replace this."""
    return time.perf_counter()


def _free(device: torch.device) -> int | None:
    """Bytes free for a step on ``device`` (graph_floor.free_memory; None off a GPU: no
    limit weighed). Tests replace this."""
    return graph_floor.free_memory(device) if device.type == "cuda" else None


def sign_p(wins: int, rounds: int) -> float:
    """How often a side no faster than the other would be faster in at least ``wins`` of
    ``rounds`` paired rounds by chance: P(W >= wins) for W ~ Binomial(rounds, 1/2)."""
    return sum(math.comb(rounds, k) for k in range(wins, rounds + 1)) / 2.0**rounds


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (a call from there
    is a recompute, not a new step)."""
    task = getattr(torch._C, "_current_graph_task_id", None)  # private: a torch without it counts none
    return task is not None and bool(task() != -1)


class Piece:
    """A compiled graph whose side a Trial chooses: ``candidates`` (name -> compiled graph),
    ``own_winner`` (its check's winner, run before and where the trial cannot choose),
    ``checked``, ``times`` and ``saved`` (that check's verdict, and each side's step time
    alone and bytes saved for its backward, where it ran), ``record`` (where the trial's
    verdict is stored)."""

    def __init__(self, candidates: Mapping[str, Callable[..., Any]], own_winner: str, trial: Trial, *,
                 record: Callable[[Verdict], None] | None, checked: Verdict | None = None,
                 times: Mapping[str, float] | None = None, saved: Mapping[str, int] | None = None) -> None:
        self.candidates = dict(candidates)
        self.own_winner = own_winner
        self.record = record
        self.checked = checked
        self.times = dict(times or {})
        self.saved = dict(saved or {})  # bytes each side's forward saved for its backward, in the check
        self.runnable = set(self.candidates)  # the candidates that did not fail the check
        self.chosen: Callable[..., Any] | None = None
        self.trial = trial
        trial.join(self)

    def __call__(self, *args: Any) -> Any:
        if self.chosen is not None:
            return self.chosen(*args)
        return self.run(args)

    def run(self, args: Sequence[Any]) -> Any:
        """A real call while the trial goes on: the side of the step's turn."""
        side = self.trial.side(self, args)
        if self.chosen is not None:  # the trial decided at this step's start
            return self.chosen(*args)
        try:
            out = self.candidates[side](*args)
        except torch.OutOfMemoryError:
            if side == self.own_winner:
                raise
            # the forward of a side the trial tried; a backward's cannot be caught here
            # (Trial._room keeps sides that would not fit from running at all)
            self.trial.stop(f"{NAMES[side]} ran out of device memory")
            assert self.chosen is not None
            return self.chosen(*args)
        if self is self.trial.pieces[0] and not self.trial.done:
            self.trial.watch(out)
        return out

    def settle(self, side: str, why: str, ms: float | None = None, own_ms: float | None = None,
               store: bool = True) -> None:
        """Run ``side`` from now on, the losers let go; store the verdict saying so (``ms``:
        the whole step's median as chosen, ``own_ms``: with every piece on Inductor's own;
        without them, this piece's own check's times)."""
        self.chosen = self.candidates[side]
        self.candidates.clear()
        if self.record is None or not store:
            return
        checked = self.checked
        own_check = f"; the piece alone: {checked.why}" if checked is not None else ""
        if ms is None and checked is not None:
            ms, own_ms = (checked.fusegraph_ms if side == TRACE else checked.incumbent_ms), checked.incumbent_ms
        verdict = Verdict(side == TRACE, "measured", f"{why}{own_check}", ENGINE, ms if side == TRACE else None,
                          own_ms if side == TRACE else ms, NAMES[OWN] if side == TRACE else NAMES[side])
        try:
            self.record(verdict)
        except Exception as exc:  # the choice still stands for this process
            log.warning("the step's verdict was not stored (%s: %s)", type(exc).__name__, exc)


class Trial:
    """Pieces chosen together on the user's steps (module docstring): one graph, or the
    pieces of one DDP split (ddp_split.py), which must run the same way to be weighed."""

    def __init__(self, margin: float, samples: int = SAMPLES) -> None:
        self.margin, self.samples = margin, samples
        self.most = samples * SAMPLES_MAX // SAMPLES  # periods per choice at most
        self.pieces: list[Piece] = []
        self.periods: dict[str, list[float]] = {}
        self.turn: str | None = None  # the choice the current step runs
        self.since: float | None = None  # when the current step began (synchronized)
        self.last = _clock()  # when a step last began (or the trial was made)
        self.backward = False  # whether the first piece's backward ran since the step began
        self.stepped = 0  # OPTIMIZER.count when the step began
        self.by_optimizer: bool | None = None  # steps end at optimizer steps (None: none seen yet)
        self.waited = 0  # backwards seen without an optimizer step, while by_optimizer is None
        self.calls = 0  # calls of the first piece in the current step (outside a backward)
        self.per_step = 1  # the most such calls a step has made (a block compiled alone: its blocks)
        self.done = False

    def join(self, piece: Piece) -> None:
        self.pieces.append(piece)

    def sides(self, choice: str) -> tuple[str, ...]:
        def side(piece: Piece) -> str:
            want = {ALL_OWN: OWN, ALL_EAGER: EAGER}.get(choice, piece.own_winner)
            return want if want in piece.runnable else piece.own_winner
        return tuple(side(p) for p in self.pieces)

    def weighed(self) -> list[str]:
        """The choices to time on the loop's steps, each once (two giving the same sides are
        one, named as ties go), without those whose pieces took longer than BAND times the
        fastest choice's alone (where every piece's check timed the sides it runs). The
        checks' winners come first: a trial whose steps never end (no backward comes) runs
        what the checks chose."""
        distinct: dict[tuple[str, ...], str] = {}
        for choice in CHOICES:
            distinct.setdefault(self.sides(choice), choice)
        checks = self.sides(EACH)
        distinct = dict(sorted(distinct.items(), key=lambda item: item[0] != checks))
        alone = {c: sum(p.times[s] for p, s in zip(self.pieces, sides, strict=True))
                 for sides, c in distinct.items()
                 if all(s in p.times for p, s in zip(self.pieces, sides, strict=True))}
        if len(alone) < len(distinct) or not alone:
            return list(distinct.values())
        fastest = min(alone.values())
        return [c for c in distinct.values() if alone[c] <= BAND * fastest]

    def label(self, choice: str) -> str:
        """A choice as the verdict names it: the side itself where one graph is weighed."""
        return NAMES[self.sides(choice)[0]] if len(self.pieces) == 1 else choice

    def side(self, piece: Piece, args: Sequence[Any]) -> str:
        """The side ``piece`` runs in the current step: the turn's choice (its check's winner
        while the trial waits for its first step, or for its turn in the QUEUE)."""
        first = piece is self.pieces[0] and not in_backward()
        if first and (self.turn is None or self.backward) and QUEUE.admits(self) and self._step_ends():
            self._tick(device_of(args))
        self.calls += first
        if self.turn is None or self.done:
            return piece.own_winner
        return self.sides(self.turn)[self.pieces.index(piece)]

    def watch(self, out: Any) -> None:
        """Note when the backward of ``out`` (the first piece's outputs) begins: the next
        call of the first piece outside a backward starts a step."""
        from torch.utils._pytree import tree_leaves

        node = next((o.grad_fn for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.grad_fn is not None),
                    None)
        if node is not None:
            node.register_prehook(self._backward_began)

    def _backward_began(self, grad_outputs: Any) -> None:
        self.backward = True

    def _step_ends(self) -> bool:
        """Whether the current call starts a step (the first piece called outside a
        backward, after its backward ran): always at the trial's start (its first period,
        which may begin inside a step, is not kept); after an optimizer
        step since the last start once one was seen (a micro-step of gradient accumulation
        starts none); on backwards alone after NO_OPTIMIZER of them with no optimizer step,
        the period so far dropped (it spans many steps)."""
        if self.turn is None:
            OPTIMIZER.watch()
            return True
        self.backward = False
        if OPTIMIZER.count > self.stepped:
            self.by_optimizer = True
            return True
        if self.by_optimizer is None:
            self.waited += 1
            if self.waited < NO_OPTIMIZER:
                return False
            self.by_optimizer, self.since = False, None
            log.info("the loop trial saw no torch.optim step in %d backwards: its steps end at backwards", NO_OPTIMIZER)
        return self.by_optimizer is False

    def _tick(self, device: torch.device) -> None:
        """A step begins: the last one's period is kept and the next choice takes its turn.
        Turns go to the first choice with the fewest periods, a period dropped (the trial's
        first; the one spanning the wait before steps end at backwards) is run again by the
        same choice, and a choice left out is deleted whole: so the i-th period of every
        choice comes from the same round of consecutive steps, the pairing the sign test
        (_weigh) relies on."""
        if not self.periods:
            self.periods = {choice: [] for choice in self.weighed()}
            if len(self.periods) == 1 or self.samples <= 0:  # nothing to weigh
                self._decide()
                return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = _clock()
        if self.turn is not None and self.since is not None:
            self.periods[self.turn].append((now - self.since) * 1e3)
        self.backward, self.last, self.stepped = False, now, OPTIMIZER.count
        self.per_step, self.calls = max(self.per_step, self.calls), 0
        first = self.turn is None
        while True:
            if len(self.periods) == 1 or self._decided():
                self._decide()
                return
            choices = list(self.periods)
            turn = choices[sum(len(p) for p in self.periods.values()) % len(choices)]
            cannot = self._room(turn, device) if turn != choices[0] else ""
            if not cannot:
                break
            log.info("the loop trial leaves out %s: %s", turn, cannot)
            del self.periods[turn]
        self.turn = turn
        # the trial's first call may fall inside a step (a micro-step of accumulation): the
        # period up to the next start is not kept, the turn runs it and the next one again
        self.since = None if first else now

    def _room(self, choice: str, device: torch.device) -> str:
        """Why ``choice`` cannot run a step on this device now ('' where it can): the
        tensors its pieces saved for their backwards in the check, times the calls a step
        makes, must take at most ROOM of the memory free at the step's start (the device's
        own and what PyTorch's allocator holds unused). A side that saves more than the one
        running could otherwise run out of memory in a backward, where nothing can catch it."""
        free = _free(device)
        need = self.per_step * sum(p.saved.get(s, 0) for p, s in zip(self.pieces, self.sides(choice), strict=True))
        if free is None or not need or need <= ROOM * free:
            return ""
        return (f"its steps would save {need / 2**20:.0f} MiB for their backwards, more than {ROOM:.0%} of the "
                f"{free / 2**20:.0f} MiB free on the device")

    def _decided(self) -> bool:
        """Whether the trial decides now: at the end of a full round (every choice as many
        periods) once there are ``samples`` of them, where the median's choice is the
        incumbent or beats it beyond the noise, or at ``most`` periods whatever they say."""
        counts = {len(p) for p in self.periods.values()}
        if len(counts) != 1 or (rounds := counts.pop()) < self.samples:
            return False
        if rounds >= self.most:
            return True
        _, why, stands = self._weigh()
        if not stands and rounds == self.samples:
            log.info("the loop trial times more steps: %s", why)
        return stands

    def _weigh(self) -> tuple[str, str, bool]:
        """The choice the periods so far give, why, and whether it stands: ``best`` (the
        fastest median, ties within the margin to the earlier in CHOICES) where it is the
        incumbent ``pref`` (the earliest timed) or was faster than it in enough paired rounds
        (the i-th periods of both, _tick) that sign_p <= ALPHA; else ``pref``, not standing
        (more rounds may separate them). Between ``best`` and another choice than ``pref``
        the medians alone decide."""
        timed = {c: p for c, p in self.periods.items() if p}
        medians = {c: statistics.median(p) for c, p in timed.items()}
        best = timing.fastest({c: timing.Timing(c, t, t, (t,)) for c, t in medians.items()}, order=CHOICES,
                              tie_margin=self.margin)
        pref = next(c for c in CHOICES if c in timed)
        steps = " vs ".join(f"{self.label(c)} {medians[c]:.3f} ms" for c in sorted(medians, key=medians.__getitem__))
        why = (f"the training loop's own steps timed: {steps} (medians of {len(timed[pref])}; ties within "
               f"{self.margin:.0%} go to Inductor's own, then eager)")
        if best == pref:
            return best, f"{why}; {self.label(best)}", True
        pairs = list(zip(timed[best], timed[pref], strict=False))
        wins = sum(b < p for b, p in pairs)
        p = sign_p(wins, len(pairs))
        why = (f"{why}: {self.label(best)} faster in {wins} of {len(pairs)} paired steps (sign test "
               f"p={p:.2g} {'<=' if p <= ALPHA else '>'} {ALPHA:g})")
        if p <= ALPHA:
            return best, f"{why}; {self.label(best)}", True
        return pref, f"{why}: not beyond the noise, {self.label(pref)} runs", False

    def _decide(self) -> None:
        self.done = True
        OPTIMIZER.release()
        timed = {c: p for c, p in self.periods.items() if p}
        ms: float | None = None
        own_ms: float | None = None
        if len(timed) > 1:
            choice, why, _ = self._weigh()
            ms = statistics.median(timed[choice])
            own_ms = statistics.median(timed[ALL_OWN]) if ALL_OWN in timed else ms
        else:
            choice = EACH
            why = (f"the check alone chose: no other choice of sides came within {BAND - 1:.0%} of it alone and "
                   "had room on the device" if self.samples > 0 else "the check alone chose (loop_steps 0)")
        log.info("%s", why)
        for piece, side in zip(self.pieces, self.sides(choice), strict=True):
            piece.settle(side, why, ms, own_ms)

    def stop(self, why: str) -> None:
        """Stopped before it decided (``why``: STALE_S without a step, a side out of memory):
        each piece keeps its check's winner, unstored, so a later compile checks it again."""
        self.done = True
        OPTIMIZER.release()
        log.info("the loop trial stopped (%s): each piece keeps its check's winner, unstored", why)
        for piece in self.pieces:
            piece.settle(piece.own_winner, "", store=False)


class _OptimizerSteps:
    """How many ``torch.optim`` steps the process took while a trial ran (a global
    post-step hook, held only then)."""

    def __init__(self) -> None:
        self.count = 0
        self._handle: Any = None

    def watch(self) -> None:
        if self._handle is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._handle = register_optimizer_step_post_hook(self._stepped)

    def release(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.count += 1


OPTIMIZER = _OptimizerSteps()


class _Queue:
    """The one trial running in this process; the others wait their turn. It is held weakly:
    a trial whose graphs are gone (``torch._dynamo.reset()``, a model deleted) keeps
    neither them nor the queue."""

    def __init__(self) -> None:
        self._running: weakref.ref[Trial] | None = None

    @property
    def running(self) -> Trial | None:
        return self._running() if self._running is not None else None

    def admits(self, trial: Trial) -> bool:
        running = self.running
        if running is not None and running is not trial and not running.done:
            if _clock() - running.last < STALE_S:
                return False
            running.stop(f"no step for {STALE_S:.0f} s")
        self._running = weakref.ref(trial)
        return True


QUEUE = _Queue()


def weigh(candidates: Mapping[str, Callable[..., Any]], check: Check, *, margin: float, samples: int,
          record: Callable[[Verdict], None] | None) -> Callable[..., Any]:
    """What runs a graph its step check chose ``check.verdict`` for: the winner alone, or a
    Piece in a Trial of its own where the step has a backward and another side came within
    BAND of the fastest alone."""
    won = winner(check.verdict)
    runnable = {n: fn for n, fn in candidates.items() if n not in check.failed}
    if samples <= 0 or not check.backward or len(runnable) < 2:
        return candidates[won]
    trial = Trial(margin, samples)
    piece = Piece(runnable, won, trial, record=record, checked=check.verdict, times=check.times, saved=check.saved)
    if len(trial.weighed()) < 2:
        return candidates[won]
    return piece
