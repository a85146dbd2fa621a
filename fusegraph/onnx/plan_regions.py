"""A claimed unit run region by region (issue 24 items 1 and 3): its fusegraph Graph is
split into engine-sized regions by the region layer (fusegraph/regions/), each region is
given fusegraph's plan only where that plan beats the incumbent for the session's device --
the same nodes op by op on PyTorch (``TorchOpByOp``), never ONNX Runtime's CPU provider for
a GPU session -- with verdicts cached per region content, device and library versions
(regions/verdicts.py; the chooser's settings for the session are region_choice.py's). The
steps pass torch tensors, so intermediates stay on the device between regions; on a GPU
the whole unit is captured as one CUDA graph at its first run (shapes are static within a
session plan) and replayed from then on. A GPU session's regions without a stored verdict
start op by op and are chosen in the background (region_upgrade.py runs the thread,
region_rebuild.py rebuilds the plan with its choices).

On by default on a GPU; on the CPU behind ``regions=on`` (the CPU's floor is against ONNX
Runtime, plan.py). With regions the unit's own floor against ONNX Runtime is not taken:
the region floor replaces it (the ``floor`` option turns it off; ``floor=off`` claims
every region fusegraph can build, unmeasured).

The ``precision`` option (precision.py) acts here: with fp16 / bf16 each region's graph is
converted before it is chosen, unless it would overflow (region_precision.py); tf32 builds
with TF32 allowed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fusegraph.engines.base import ExecutionPlan
from fusegraph.errors import FusegraphError, UnsupportedError
from fusegraph.graph.graph import Graph
from fusegraph.onnx import (
    plan_build,
    region_choice,
    region_pieces,
    region_precision,
    region_rebuild,
    region_upgrade,
)
from fusegraph.onnx.importer import filter_layout_for
from fusegraph.onnx.model import ONode
from fusegraph.onnx.precision import Accuracy, Precision, tf32_allowed
from fusegraph.onnx.region_pieces import NoRegions, Piece
from fusegraph.onnx.region_values import declared as _declared
from fusegraph.onnx.region_values import laid_out as _laid_out
from fusegraph.onnx.region_values import random_laid_out, to_device_all
from fusegraph.onnx.region_values import rel_err as _rel_err
from fusegraph.onnx.region_values import to_device as _to_device
from fusegraph.onnx.report import RegionEntry
from fusegraph.onnx.units import FusegraphUnit, engine_cache
from fusegraph.regions import split
from fusegraph.regions.choose import PENDING, Choice, Chooser
from fusegraph.regions.incumbent import op_by_op_config
from fusegraph.regions.plan import RegionPlan, Step
from fusegraph.regions.split import Region
from fusegraph.regions.subgraph import Whole
from fusegraph.runtime.progress import working

if TYPE_CHECKING:
    from fusegraph.onnx.plan import SessionPlan

log = logging.getLogger("fusegraph.onnx")

AGREE = 1e-3  # a region's plan whose trial output is further from PyTorch's (relative) is refused (as floor.AGREE)


def region_unit(plan: SessionPlan, name: str, nodes: list[ONode], ins: list[str], outs: list[str]) -> FusegraphUnit:
    """A claimed group lowered and, unless ``lazy_compile``, split, chosen and built region by
    region; where that cannot be done, the group built whole (the reason in its notes)."""
    why = region_choice.unavailable()
    if not why:
        t0 = time.perf_counter()
        engine = plan.engine.name if plan.engine is not None else None
        origin: dict[str, str] = {}
        # pack=False: the weights stay as the model holds them; build() lays them out as the graph
        # declares while copying them to the device (on a GPU the transposes run there)
        base = plan_build.lower_unit(plan, name, nodes, ins, outs, engine, filter_layout_for(engine or "torch"),
                                     pack=False, origin=origin)
        unit = RegionUnit(base, origin, region_choice.chooser_for(plan))
        unit.precision = Precision(plan.opts.precision)
        if plan.opts.autotune > 0:  # a tuned plan's verdict is no verdict on the untuned one
            unit.tune_budget = plan.opts.autotune
            unit.chooser.build_options = {**unit.chooser.build_options, "autotuned": True}
        unit.defer = unit.chooser.floor and region_upgrade.deferred(plan.opts, plan.handle)
        if plan.opts.lazy_compile:
            return unit
        try:
            unit.build()
        except (NoRegions, FusegraphError) as exc:  # e.g. a region neither side can run
            why = f"{type(exc).__name__}: {exc}" if isinstance(exc, FusegraphError) else str(exc)
        else:
            plan.compile_s[name] = time.perf_counter() - t0
            if plan.dump is not None:
                plan.dump(f"{name}.json", unit.graph.to_json(indent=1))
            return unit
    log.info("%s runs whole, not region by region: %s", name, why)
    whole = plan_build.fusegraph_unit(plan, name, nodes, ins, outs)
    whole.engine_notes.append(f"not run region by region: {why}")
    return whole


class RegionUnit(FusegraphUnit):
    """A claimed unit whose graph runs as a region plan (regions/plan.py): each region on
    fusegraph's plan where it won, else op by op on PyTorch; weights bound once per step,
    activations torch tensors on the device from the unit's inputs to its outputs."""

    def __init__(self, base: FusegraphUnit, origin: Mapping[str, str], chooser: Chooser) -> None:
        super().__init__(base.name, base.nodes, base.graph, base._in, base.weights, base._out, base.handle,
                         base.engine, base.cache_dir)
        self.filter_layout = base.filter_layout
        self.fusions = dict(base.fusions)
        self.origin = dict(origin)
        self.by_name = {n.name: n for n in base.nodes}
        self.chooser = chooser
        self.rows: list[RegionEntry] = []
        self.capture_note = ""
        self.tune_budget = 0.0  # seconds for the unit (the ``autotune`` option): each region tuned across engines
        self.tune_s = 0.0  # ... per distinct region
        self._device: Any = None
        self._weights_dev: dict[str, Any] = {}
        self._cast: dict[tuple[str, Any], Any] = {}  # (weight, torch dtype) -> its copy in that type, cast once
        self.precision = Precision()  # the ``precision`` option (precision.py)
        self.kept_fp32: dict[tuple[str, ...], str] = {}  # a region's nodes -> why it keeps float32
        self._reduced: set[str] = set()  # content keys of the region graphs converted to the reduced type
        self._fp32: dict[tuple[str, ...], Graph] = {}  # a converted region's nodes -> its float32 graph
        self._tf32_regions = 0  # regions built with an engine's tf32 knob on
        self._sample: dict[str, Any] | None = None  # the unit's sample inputs (reduced precision) ...
        self._reference: dict[str, Any] | None = None  # ... and its outputs on the float32 path
        self.precision_note = ""
        self.accuracy: Accuracy | None = None  # fp16 / bf16: the built unit against its float32 path
        self._buffers = base.handle.device.is_gpu  # outputs live on the device: a copy to reach the host
        build = chooser.builder or (lambda r: r.graph.build(handle=chooser.handle, engine=chooser.engine))
        self._trial_passed: set[tuple[str, bool | str]] = set()  # (region content key, candidate) whose plan passed
        self._eager_configs: dict[tuple[str, bool, bool], Any] = {}  # (content key, tf32, provisional) -> op-by-op config
        # Deferred choice (region_upgrade.py): regions without a stored verdict start on the
        # incumbent and are chosen by a background thread, which swaps the upgraded plan in.
        self.defer = False
        self.gate = region_upgrade.gate_for(str(base.handle.device))
        chooser.guard = self.gate.measure  # measurements wait for the runs in flight (free where none are)
        self.upgrade: region_upgrade.Upgrade | None = None
        self._deferred: dict[tuple[str, ...], Region] = {}  # a pending piece's nodes -> its region
        self._later: tuple[list[Piece], list[int], list[Step]] | None = None  # what the upgrade rebuilds
        self._swapped = False  # the upgraded plan is in place
        self._measuring = False  # a deferred region is measured, not only built (it takes long)
        chooser.builder = self._checked(build)
        if chooser.preferred is not None:
            chooser.preferred = self._checked(chooser.preferred, preferred=True)
        chooser.fallbacks = tuple((name, self._checked(fn, preferred=name)) for name, fn in chooser.fallbacks)

    # ---- what the plan and the report read -----------------------------------------------------
    @property
    def engine_name(self) -> str:
        if not self.rows:
            return "regions (not built yet)"
        fg = sum(r.fusegraph for r in self.rows)
        return f"regions: {fg}/{len(self.rows)} on fusegraph"

    def floor_line(self) -> str:
        """One line for the report's floor column: how the regions were decided."""
        if not self.rows:
            return ""
        sources: dict[str, int] = {}
        for r in self.rows:
            if r.source:
                sources[r.source] = sources.get(r.source, 0) + 1
        told = ", ".join(f"{n} {s}" for s, n in sorted(sources.items()))
        incumbent = self.chooser.incumbent.name
        return f"regions against {incumbent} on {self.handle.device}: {told or 'none'}" + (
            f"; {self.capture_note}" if self.capture_note else "") + (
            f"; {self.precision_note}" if self.precision_note else "")

    def autotune(self, budget_s: float) -> float | None:
        """Per-region engines are chosen by the region floor; the unit is not tuned whole."""
        return None

    # ---- building ----------------------------------------------------------------------------
    def build(self, config: Any = None) -> None:
        if self.plan is not None:
            return
        import torch

        self._device = torch.device(str(self.handle.device))
        self._weights_dev = to_device_all({k: (v, self.graph.tensor_by_name(k)) for k, v in self.weights.items()},
                                          self._device)
        self.weights = {}  # the steps hold the device copies
        with engine_cache(self.cache_dir), torch.inference_mode(), tf32_allowed(self.precision.tf32):
            pieces = self._pieces()
        order = region_pieces.run_order(pieces, self.graph)
        steps = [self._step(f"r{k}", pieces[i]) for k, i in enumerate(order)]
        self.rows = [self._row(k, pieces[i]) for k, i in enumerate(order)]
        self.plan = RegionPlan(steps, [self._out[o] for o in self.outputs])
        if self._deferred:  # chosen in the background; the weights stay for the plans built there
            self._later = (pieces, order, steps)  # the thread starts after the first run's capture
            log.info("%s: %d regions, %d of them to be chosen in the background", self.name, len(steps),
                     len(self._deferred))
            return
        region_precision.state(self, len(pieces))
        self._weights_dev, self._cast = {}, {}  # the steps hold what they read
        log.info("%s: %d regions, %s", self.name, len(steps), self.engine_name)

    def _start_upgrade(self) -> None:
        """Starts the background choice of the deferred regions (once)."""
        if self._later is not None and self.upgrade is None:
            self.upgrade = region_upgrade.Upgrade(self.name, lambda cancel: region_rebuild.choose_later(self, cancel))

    def _capture(self, plan: RegionPlan, feed: Mapping[str, Any]) -> str:
        """The unit's plan captured as one CUDA graph; the report's note on it."""
        why = plan.capture(feed)
        note = "one CUDA graph" if not why else f"run step by step (not captured: {why})"
        log.info("%s: %s", self.name, note)
        return note

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the background choice (if any; started now where no run has started
        it) is done; True when nothing is pending."""
        self._start_upgrade()
        return self.upgrade is None or self.upgrade.wait(timeout)

    def stop_upgrade(self, timeout: float | None = None) -> bool:
        """Stops the background choice after its region at hand; True when the thread ended."""
        if self.upgrade is None:
            return True
        self.upgrade.stop(timeout)
        return self.upgrade.done

    def _pieces(self) -> list[Piece]:
        whole = Whole(self.graph)  # the regions and the cuts from one serialized graph
        found = split(self.graph, atoms=dict(self.origin), whole=whole)
        if self.tune_budget > 0:  # the unit's budget shared by its distinct regions
            self.tune_s = self.tune_budget / max(1, len({r.key for r in found.regions}))
        regions, cuts = list(found.regions), region_pieces.cuts(self.graph, found.rejected, whole)
        if self.precision.reduced is not None:
            regions, cuts = region_precision.reduce(self, regions, cuts)
        elif self.precision.tf32:  # only the float32 reference the report's accuracy is stated against
            region_precision.observe(self, [(r.nodes, r.graph, r.inputs, r.outputs) for r in regions]
                                     + [(c.nodes, c.graph, c.inputs, c.outputs) for c in cuts])
        choices = self._choose(regions)
        self._deferred = {c.region.nodes: c.region for c in choices if c.verdict.source == PENDING}
        # a pending region without a stored verdict is measured (seconds to minutes); one whose
        # stored verdict names its plan (``engine``) is only built
        self._measuring = any(not c.verdict.engine for c in choices if c.verdict.source == PENDING)
        # Until the upgrade, pieces op by op take cuDNN's deterministic pick instead of timing
        # each convolution at the first run (ConvNeXt-T's 22: ~1.5 s of a warm H200 session's
        # first run); the upgrade times them off the user's path (region_rebuild.rebench).
        provisional = bool(self._deferred)
        pieces = [self._chosen(c, provisional=provisional) for c in choices]
        for c in cuts:
            try:  # keyed as regions are: a model's repeated layers leave the same cuts (Swin-T: 69, 31 contents)
                plan = self._eager(c.graph, provisional=provisional, key=c.graph.key())
            except Exception as exc:
                orig = self._fp32.get(c.nodes)
                if orig is None:
                    raise
                self.kept_fp32[c.nodes] = f"does not run op by op in the reduced type ({exc})"
                c = dataclasses.replace(c, graph=orig)
                plan = self._eager(orig, provisional=provisional)
            pieces.append(Piece(c.nodes, c.graph, c.inputs, c.outputs, plan, self.chooser.incumbent.name, "",
                                c.reason, movement=c.movement))
        return pieces

    def _weight(self, parent: str, dtype: Any) -> Any:
        """Weight ``parent`` as a torch tensor of fusegraph type ``dtype`` (cast once)."""
        from fusegraph.engines.torch.convert import torch_dtype

        w = self._weights_dev[parent]
        want = torch_dtype(dtype)
        if w.dtype == want:
            return w
        key = (parent, want)
        if key not in self._cast:
            self._cast[key] = w.to(want)
        return self._cast[key]

    def _choose(self, regions: Sequence[Region]) -> list[Choice]:
        """The region layer's choices (a plan whose stored verdict lost is not even built:
        ``Chooser``); a sign of life while regions without a stored verdict are measured."""
        c = self.chooser
        if self.defer:  # nothing measured now: no sign of life to give (nor stored verdicts to count first)
            return c.choose_all(regions, self._example, defer=True)
        fresh = sum(1 for r in regions if c.floor and not c.stored(r))
        if not fresh:
            return c.choose_all(regions, self._example)
        with working(f"fusegraph {self.name}: {fresh} regions measured against {c.incumbent.name}"):
            return c.choose_all(regions, self._example)

    def _checked(self, build: Callable[[Region], ExecutionPlan],
                 preferred: bool | str = False) -> Callable[[Region], ExecutionPlan]:
        """``build``, and where the floor is on a trial run of its plan against the same nodes
        op by op on PyTorch on the region's example inputs: a plan that fails or disagrees is
        the region's refusal (never measured, so no verdict of it is kept), as the floor
        against ONNX Runtime hands back a unit that disagrees. Tried once per region content
        (a model's repeated layers build the same plan), and not where a stored verdict says
        the plan won: it passed this trial before it was measured."""

        def checked(region: Region) -> ExecutionPlan:
            plan = self._tuned(region) if not preferred and self.tune_s > 0 else None
            plan = plan or build(region)
            if self.precision.tf32 and "tf32=True" in str(plan.config):
                self._tf32_regions += 1
            if not self.chooser.floor or (region.key, preferred) in self._trial_passed:
                return plan
            stored = self.chooser.cached(region, preferred)
            if stored is not None and stored.fusegraph:
                return plan
            try:
                reference = self._eager(region.graph, tf32=False)
            except Exception:  # the incumbent cannot run it: nothing to compare with
                return plan
            pack = self._example(region)
            try:
                got = plan.execute(pack)
            except Exception as exc:
                raise UnsupportedError(f"failed its trial run: {type(exc).__name__}: {exc}") from exc
            want = reference.execute(pack)
            err = max((_rel_err(got[k], v) for k, v in want.items()), default=0.0)
            agree = self.precision.agree if region.key in self._reduced or self.precision.tf32 else None
            if not err <= (agree or AGREE):
                raise UnsupportedError(f"disagrees with the same nodes op by op on PyTorch (relative error {err:.1e})")
            self._trial_passed.add((region.key, preferred))
            return plan

        return checked

    def _tuned(self, region: Region) -> ExecutionPlan | None:
        """With ``autotune``: the region's fastest (engine, config) found by the selection
        layer's autotuner on its example inputs within ``tune_s`` (kept in the tuning
        database, so later sessions rebuild it without timing); None where tuning failed."""
        try:
            with engine_cache(self.cache_dir):
                result = region.graph.autotune(
                    self._example(region), self.handle, budget_s=self.tune_s, progress=False,
                    engines=[self.chooser.engine] if self.chooser.engine else None)
        except Exception as exc:  # tuning is an optimization: the default build applies
            log.info("autotuning region %d (%s) failed: %s", region.index, region.pattern, exc)
            return None
        tuned: ExecutionPlan = result.plan
        return tuned

    def _chosen(self, c: Choice, *, provisional: bool = False) -> Piece:
        r, v = c.region, c.verdict
        if c.claimed:
            assert c.plan is not None
            return Piece(r.nodes, r.graph, r.inputs, r.outputs, c.plan, f"fusegraph:{v.engine}", r.pattern,
                         v.describe(), v.source, v.fusegraph_ms, v.incumbent_ms)
        try:
            plan = self._eager(r.graph, provisional=provisional, key=r.key)
            where = self.chooser.incumbent.name
        except Exception as exc:  # the incumbent cannot run it: fusegraph's plan must
            built = self.chooser.build(r)
            if not isinstance(built, ExecutionPlan):
                orig = self._fp32.get(r.nodes)
                if orig is not None:  # neither side runs it in the reduced type: float32 op by op
                    self.kept_fp32[r.nodes] = f"runs neither on fusegraph nor op by op in the reduced type ({exc})"
                    return Piece(r.nodes, orig, r.inputs, r.outputs, self._eager(orig, provisional=provisional),
                                 self.chooser.incumbent.name,
                                 r.pattern, v.describe(), v.source, v.fusegraph_ms, v.incumbent_ms)
                raise UnsupportedError(f"region {r.index} ({r.pattern}) runs neither on fusegraph ({built.why}) "
                                       f"nor op by op on PyTorch ({exc})") from exc
            plan, where = built, f"fusegraph:{built.config}"
        return Piece(r.nodes, r.graph, r.inputs, r.outputs, plan, where, r.pattern, v.describe(), v.source,
                     v.fusegraph_ms, v.incumbent_ms)

    def _eager(self, graph: Graph, *, tf32: bool | None = None, provisional: bool = False,
               key: str | None = None) -> ExecutionPlan:
        """The incumbent's way of running ``graph``: the torch engine, eager, uncaptured, at
        the session's precision (the torch engine pins its own TF32 flags when it runs: the
        incumbent the floor measured at tf32 must run at tf32 too -- ViT-B/16 at tf32 ran its
        float32 GEMMs strict, 10.1 ms against eager's 5.1, H100). ``provisional``: without
        timing cuDNN's algorithms (a piece run until the upgrade rebuilds it). ``key``: the
        graph's content key (a region's), where known: a model's repeated layers then ask the
        engine for their configuration once (``engine.build`` still checks each graph)."""
        from fusegraph.engines.registry import REGISTRY

        engine = REGISTRY.get("torch")
        tf32 = self.precision.tf32 if tf32 is None else tf32  # the float32 reference passes False
        memo = (key, tf32, provisional) if key is not None else None
        config = self._eager_configs.get(memo) if memo is not None else None
        if config is None:
            config = op_by_op_config(graph, self.handle, tf32=tf32, benchmark=not provisional)
            sup = engine.supports(graph, self.handle)
            if not sup:
                raise UnsupportedError(f"engine 'torch': {sup.reason}")
            if memo is not None:
                self._eager_configs[memo] = config
        plan: ExecutionPlan = engine.build(graph, self.handle, config)
        return plan

    def _example(self, region: Region) -> dict[str, Any]:
        """A region's inputs for measuring it: the unit's weights as bound, fresh random
        activations in their declared layout."""
        return self._pack(region.graph, region.inputs)

    def _pack(self, graph: Graph, inputs: Sequence[str]) -> dict[str, Any]:
        import torch

        gen = torch.Generator(device=self._device).manual_seed(0)
        out: dict[str, Any] = {}
        for i, parent in enumerate(inputs):
            key = f"in{i}"
            t = graph.tensor_by_name(key)
            out[key] = (self._weight(parent, t.dtype) if parent in self._weights_dev
                        else random_laid_out(t, self._device, gen))
        return out

    def _step(self, name: str, piece: Piece) -> Step:
        """The piece as a step reading activations only: the weights it reads are bound to its
        plan once (passed on every call where the plan does not keep them)."""
        consts = {f"in{i}": self._weight(p, piece.graph.tensor_by_name(f"in{i}").dtype)
                  for i, p in enumerate(piece.inputs) if p in self._weights_dev}
        acts = [(f"in{i}", p) for i, p in enumerate(piece.inputs) if p not in self._weights_dev]
        kept = bool(piece.plan.bind_constants(consts)) if consts else False
        extra = {} if kept else consts
        keys = [k for k, _ in acts]
        outs = [f"out{j}" for j in range(len(piece.outputs))]
        execute: Callable[[dict[str, Any]], Any] = piece.plan.execute
        if piece.plan.engine != "torch":  # the torch engine takes any strides (and a matmul a transposed view)
            execute = _laid_out(execute, [piece.graph.tensor_by_name(k) for k in keys], keys)
        if self.precision.reduced is not None:  # activations cast where they cross into another type
            from fusegraph.engines.torch.convert import torch_dtype

            types = [torch_dtype(piece.graph.tensor_by_name(k).dtype) for k in keys]

            def cast_run(values: Sequence[Any]) -> Sequence[Any]:
                pack = dict(extra)
                for k, v, dt in zip(keys, values, types, strict=True):
                    pack[k] = v if v.dtype == dt else v.to(dt)
                res = execute(pack)
                return [res[o] for o in outs]

            return Step(name, tuple(p for _, p in acts), piece.outputs, cast_run, piece.where)

        def run(values: Sequence[Any]) -> Sequence[Any]:
            pack = dict(extra)
            pack.update(zip(keys, values, strict=True))
            res = execute(pack)
            return [res[o] for o in outs]

        return Step(name, tuple(p for _, p in acts), piece.outputs, run, piece.where)

    def _row(self, k: int, piece: Piece) -> RegionEntry:
        onodes = [self.by_name[o] for o in dict.fromkeys(self.origin.get(n, "") for n in piece.nodes) if o in self.by_name]
        origin = [so for o in onodes for so in o.origin()]
        onnx_nodes = tuple(dict.fromkeys(name for name, _ in origin))
        ops = tuple(dict.fromkeys(op for _, op in origin))
        why = piece.why
        if self.precision.reduced is not None:
            kept = self.kept_fp32.get(piece.nodes)
            why += f" [kept float32: {kept}]" if kept is not None else f" [{self.precision.name}]"
        return RegionEntry(k, piece.pattern, onnx_nodes, ops, piece.where, why, piece.source,
                           piece.fusegraph_ms, piece.incumbent_ms, compute=not piece.movement)

    # ---- running -------------------------------------------------------------------------------
    def run(self, values: Mapping[str, Any]) -> dict[str, Any]:
        if self.plan is None:
            self.build()
        import torch

        feed = {t.name: _to_device(values[onnx_name], t, self._device) for onnx_name, t in self._in.items()}
        up = self.upgrade
        if up is not None and not up.done:  # regions are being measured: take turns with them
            from fusegraph.engines.cuda_capture import postponed

            # nothing captured while the thread works (see region_rebuild.choose_later), on this
            # side either: its device-wide synchronizes (timing) would fail during a capture here
            with self.gate.run(), torch.inference_mode(), postponed():
                if not self._swapped:  # the incumbent plan (replayed, captured at the first run)
                    return self._outputs(self.plan.execute(feed))
            # swapped in (and captured) while this run waited: it replays below
        plan: RegionPlan = self.plan
        with torch.inference_mode(), tf32_allowed(self.precision.tf32):
            res = plan.execute(feed)
            if not self._ran:
                self._ran = True
                # a deferred unit that only builds its stored winners is upgraded within seconds:
                # its incumbent plan is not worth a capture (~0.5 s for Swin-T's)
                if self.handle.device.is_gpu and (self._later is None or self._measuring):
                    # after one run step by step on the caller's stream: the steps' own CUDA graphs
                    # (a torch plan's, captured at its first call) exist before this capture, which
                    # runs them eagerly (they replay only on the stream they were captured on)
                    self.capture_note = self._capture(plan, feed)
        self._start_upgrade()  # a deferred unit: its regions chosen from now on, beside the replays
        return self._outputs(res)

    def _outputs(self, res: Mapping[str, Any]) -> dict[str, Any]:
        if self.precision.reduced is not None:  # in the model's declared types
            return {o: _declared(res[tname], self.graph.tensor_by_name(tname)) for o, tname in self._out.items()}
        return {o: res[tname] for o, tname in self._out.items()}


__all__ = ["AGREE", "RegionUnit", "region_unit"]
