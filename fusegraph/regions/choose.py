"""Each candidate region's verdict: can fusegraph build it (else refused, with the
engines' reasons), and -- with the floor on -- is its plan faster than the incumbent
(verdict cache first, then measurement; regions/measure.py); with the floor off every
region fusegraph can build is claimed unmeasured. Front doors call ``choose`` with their
incumbent and their regions' example inputs."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fusegraph.engines.base import ExecutionPlan
from fusegraph.errors import FusegraphError
from fusegraph.regions.incumbent import Incumbent
from fusegraph.regions.measure import MARGIN, Timer, measure
from fusegraph.regions.split import Region
from fusegraph.regions.verdicts import Verdict, VerdictStore, verdict_key
from fusegraph.runtime.handle import Handle

log = logging.getLogger("fusegraph.regions")

# what an unmeasured verdict promises (a caller that ends the measuring says otherwise)
MEASURED_LATER = "a later session (or compile) measures it"

PENDING = "pending"  # the source of a deferred region's verdict (``choose_all(defer=True)``)


@dataclass
class Choice:
    """A region, its verdict, and fusegraph's plan for it where fusegraph runs it."""

    region: Region
    verdict: Verdict
    plan: ExecutionPlan | None = None

    @property
    def claimed(self) -> bool:
        return self.verdict.fusegraph and self.plan is not None


@dataclass
class Chooser:
    """The settings of one front door's choice: its device, its incumbent, the floor, the
    engine asked for (None: selection's heuristics), where verdicts live."""

    handle: Handle
    incumbent: Incumbent
    floor: bool = True
    engine: str | None = None
    margin: float = MARGIN
    store: VerdictStore | None = None
    sync: Callable[[], None] | None = None
    timer: Timer | None = None
    timing_options: Mapping[str, Any] = field(default_factory=dict)
    build_options: Mapping[str, Any] = field(default_factory=dict)
    key_options: Mapping[str, Any] = field(default_factory=dict)  # how it measures (a verdict's key holds it)
    builder: Callable[[Region], ExecutionPlan] | None = None  # the front door's own build (its plan cache)
    # A candidate tried first, with the floor on: where it builds and beats the incumbent,
    # the builder's plan is never built (an Inductor compile it would cost); where it loses
    # or cannot build, the builder's plan is measured as before. Its verdicts are its own.
    preferred: Callable[[Region], ExecutionPlan] | None = None
    # Candidates tried, in order, where the builder's plan lost or was refused, each with
    # verdicts of its own (``candidate=<name>`` in their keys): the ONNX door's float32
    # plan behind its split-product one, so a region the split slows down can still be
    # claimed by the plan it replaced.
    fallbacks: Sequence[tuple[str, Callable[[Region], ExecutionPlan]]] = ()
    # Which regions the fallbacks are for (None: all): elsewhere the builder's plan is the
    # only one, and trying a fallback would build and measure that same plan again.
    fallback_when: Callable[[Region], bool] | None = None
    # Seconds ``choose_all`` may spend building and measuring regions without a stored
    # verdict (None: no limit). Past it the rest go to the incumbent unmeasured and
    # unrecorded, so each later session measures more until every region has its verdict.
    budget_s: float | None = None
    # The whole budget a caller gave, where ``budget_s`` is what an earlier stage left of it
    # (the torch door's screen): the unmeasured rows name it (None: ``budget_s``).
    budget_total_s: float | None = None
    # Entered around each measurement (None: nothing): where regions are measured beside the
    # user's runs (the ONNX door's deferred choice, onnx/region_upgrade.py), the runs wait
    # while a region is timed, so neither side's kernels are in the other's samples.
    guard: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    # With ``choose_all(defer=True)``: a region whose stored verdict keeps a plan this says
    # is worth building later is deferred too, built off the user's path (the ONNX door on
    # a GPU: every such plan -- loading Triton's and cuDNN's kernels, an Inductor compile
    # with Dynamo's import, took 1.8-17.5 s of a warm open in a new process on an H200).
    build_later: Callable[[Verdict], bool] | None = None
    _versions: dict[str, str] | None = None

    def versions(self) -> dict[str, str]:
        if self._versions is None:
            from fusegraph.engines.registry import REGISTRY
            from fusegraph.select.tuning_db import engine_versions

            self._versions = engine_versions(REGISTRY.available_engines())
        return self._versions

    def key(self, region: Region, preferred: bool | str = False, *, incumbent: str | None = None,
            extra: Mapping[str, Any] | None = None) -> str:
        """The verdict key of a candidate: the builder's (False), the preferred one (True) or
        a fallback (its name); ``incumbent`` and ``extra`` settings for a verdict taken
        against another incumbent than the chooser's (the torch backend's screen)."""
        from fusegraph.select.device_id import device_id

        candidate = "preferred" if preferred is True else preferred or None
        settings = {"engine": self.engine or "auto", "margin": self.margin, **dict(self.build_options),
                    **dict(self.key_options), **({"candidate": candidate} if candidate else {}), **dict(extra or {})}
        return verdict_key(region.key, device_id(self.handle), incumbent or self.incumbent.name, self.versions(),
                           settings)

    def cached(self, region: Region, preferred: bool | str = False) -> Verdict | None:
        """The stored verdict on the region's candidate (the preferred one, the builder's or a
        fallback), where the floor is on and one was recorded."""
        if not self.floor or self.store is None:
            return None
        return self.store.lookup(self.key(region, preferred))

    def _tries_preferred(self, region: Region) -> bool:
        """Whether the preferred candidate is tried: not where it left no verdict (it was
        refused) and the builder's plan has one -- a warm session does not build again a
        preferred plan that could not be built."""
        if self.preferred is None:
            return False
        return not (self.cached(region, True) is None and self.cached(region) is not None)

    def stored(self, region: Region) -> bool:
        """Whether stored verdicts decide the region without measuring it."""
        own = self.cached(region)
        if own is not None and (own.fusegraph or not self._falls_back(region)):
            return True
        # the builder's plan lost, or was refused (refusals are not stored; a fallback's
        # verdict exists only where the builder's plan was tried): the fallbacks decide
        for name, _ in self.fallbacks:
            v = self.cached(region, name)
            if v is None:
                break
            if v.fusegraph or name == self.fallbacks[-1][0]:
                return True
        else:
            if own is not None:
                return True
        first = self.cached(region, True) if self.preferred is not None else None
        return first is not None and first.fusegraph

    def build(self, region: Region, fn: Callable[[Region], ExecutionPlan] | None = None) -> ExecutionPlan | Verdict:
        """fusegraph's plan for the region (by ``fn``, default the builder), or the refusal
        saying why there is none."""
        try:
            plan: ExecutionPlan = (
                fn(region) if fn is not None
                else self.builder(region) if self.builder is not None
                else region.graph.build(handle=self.handle, engine=self.engine, **self.build_options)
            )
        except FusegraphError as exc:
            return Verdict(False, "refused", f"{type(exc).__name__}: {exc}", incumbent=self.incumbent.name)
        return plan

    def choose(self, region: Region, inputs: Callable[[Region], Mapping[str, Any]] | None = None) -> Choice:
        return self._pick(region, inputs)[0]

    def _pick(self, region: Region,
              inputs: Callable[[Region], Mapping[str, Any]] | None) -> tuple[Choice, bool | str]:
        """The choice, and which candidate made it: True the preferred one, False the
        builder's (or none), else the fallback's name."""
        if self.floor and self._tries_preferred(region):
            assert self.preferred is not None
            first = self._choose(region, inputs, self.preferred, preferred=True)
            if first.claimed:
                return first, True
            choice, which = self._with_fallbacks(region, inputs)
            if not choice.claimed and first.verdict.source != "refused":  # both measured: say so
                why = f"{choice.verdict.why}; first tried: {first.verdict.engine}, {first.verdict.why}"
                choice = Choice(region, replace(choice.verdict, why=why), None)
            return choice, which
        return self._with_fallbacks(region, inputs)

    def _with_fallbacks(self, region: Region,
                        inputs: Callable[[Region], Mapping[str, Any]] | None) -> tuple[Choice, bool | str]:
        """The builder's plan, then (floor on) each fallback in turn where it lost or was
        refused; the last candidate's verdict says what the others said."""
        choice = self._choose(region, inputs, None)
        if choice.claimed or not self.floor or not self._falls_back(region):
            return choice, False
        tried = [choice]
        for name, fn in self.fallbacks:
            alt = self._choose(region, inputs, fn, preferred=name)
            if alt.claimed:
                return alt, name
            tried.append(alt)
        if len(tried) == 1:
            return choice, False
        last = tried[-1]
        others = "; ".join(f"{c.verdict.engine or 'not built'}: {c.verdict.why}" for c in tried[:-1])
        return Choice(region, replace(last.verdict, why=f"{last.verdict.why}; also tried: {others}"), None), False

    def _later_winner(self, region: Region) -> Verdict | None:
        """The stored verdict that keeps a plan ``build_later`` names, among the region's
        candidates (preferred, builder, fallbacks); None where there is none."""
        if self.build_later is None:
            return None
        which: list[bool | str] = [*([True] if self.preferred is not None else []), False,
                                   *(name for name, _ in self.fallbacks)]
        for w in which:
            v = self.cached(region, w)
            if v is not None and v.fusegraph:
                return v if self.build_later(v) else None
        return None

    def _falls_back(self, region: Region) -> bool:
        return bool(self.fallbacks) and (self.fallback_when is None or self.fallback_when(region))

    def candidate(self, which: bool | str) -> Callable[[Region], ExecutionPlan] | None:
        """The build function of a candidate named as ``_pick`` names it (None: the builder)."""
        if which is True:
            return self.preferred
        if which is False:
            return None
        return dict(self.fallbacks)[which]

    def _choose(self, region: Region, inputs: Callable[[Region], Mapping[str, Any]] | None,
                fn: Callable[[Region], ExecutionPlan] | None, preferred: bool | str = False) -> Choice:
        cached = self.cached(region, preferred)
        if cached is not None and not cached.fusegraph:  # a plan that lost is not built again
            return Choice(region, cached)
        built = self.build(region, fn)
        if isinstance(built, Verdict):
            return Choice(region, built)
        engine = str(built.config)
        if not self.floor:
            return Choice(region, Verdict(True, "claimed", "the floor is off: claimed without measuring",
                                          engine, incumbent=self.incumbent.name), built)
        if cached is not None:
            return Choice(region, cached, built)
        key = self.key(region, preferred)
        if inputs is None:
            raise ValueError("the floor is on: choose() needs the region's example inputs to measure")
        pack = dict(inputs(region))
        with self.guard() if self.guard is not None else contextlib.nullcontext():
            verdict = measure(
                lambda: built.execute(pack),
                self.incumbent.runnable(region, pack),
                incumbent=self.incumbent.name,
                engine=engine,
                margin=self.margin,
                sync=self.sync,
                timer=self.timer,
                **dict(self.timing_options),
            )
        log.info("region %d (%s): %s", region.index, region.pattern, verdict.describe())
        if self.store is not None:
            self.store.record(key, verdict)
        return Choice(region, verdict, built if verdict.fusegraph else None)

    def _budget_named(self) -> float:
        return self.budget_total_s if self.budget_total_s is not None else (self.budget_s or 0.0)

    def choose_all(
        self, regions: Sequence[Region], inputs: Callable[[Region], Mapping[str, Any]] | None = None,
        *, defer: bool = False, stop: Callable[[], bool] | None = None,
    ) -> list[Choice]:
        """Every region's choice; regions with one content key are measured once. ``defer``:
        a region that would need measuring is neither built nor measured but left to the
        incumbent with a ``pending`` verdict (never recorded), for the caller to choose later
        (with ``choose_all`` again, off the user's path). ``stop``: asked before each region;
        where it says so the choices so far are returned (fewer than the regions)."""
        by_key: dict[str, tuple[Verdict, bool | str]] = {}  # content key -> verdict, which candidate won
        out: list[Choice] = []
        spent = 0.0  # seconds on regions without a stored verdict
        for region in regions:
            if stop is not None and stop():
                break
            seen = by_key.get(region.key)
            if seen is not None and seen[0].source in ("measured", "cached"):
                verdict, first = seen
                plan = None
                if verdict.fusegraph:
                    built = self.build(region, self.candidate(first))
                    plan = built if isinstance(built, ExecutionPlan) else None
                out.append(Choice(region, verdict, plan))
                continue
            fresh = self.floor and not self.stored(region)
            if fresh and defer:
                out.append(Choice(region, Verdict(
                    False, PENDING, "not measured yet: built and measured in the background while the session "
                    "runs it op by op; the plan is upgraded when every region has its verdict",
                    incumbent=self.incumbent.name)))
                continue
            later = self._later_winner(region) if defer and not fresh else None
            if later is not None:
                out.append(Choice(region, Verdict(
                    False, PENDING, f"a stored verdict keeps fusegraph's plan ({later.engine}): built in the "
                    "background while the session runs it op by op", later.engine, incumbent=self.incumbent.name)))
                continue
            if fresh and self.budget_s is not None and spent >= self.budget_s:
                out.append(Choice(region, Verdict(
                    False, "unmeasured", f"the region floor's budget ({self._budget_named():g} s) was spent before "
                    f"it; {MEASURED_LATER}",
                    incumbent=self.incumbent.name)))
                continue
            t0 = time.perf_counter()
            choice, first = self._pick(region, inputs)
            if fresh:
                spent += time.perf_counter() - t0
                if stop is not None and self.store is not None:  # a background choice may be cut short
                    self.store.flush()
            by_key[region.key] = (choice.verdict, first)
            out.append(choice)
        if self.store is not None:
            self.store.flush()
        return out
