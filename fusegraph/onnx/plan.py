"""A session's plan for one set of input shapes: specialize, rewrite, partition, build, run.

Built once per input-shape signature (at session creation when the model's input shapes
are static). Claimed subgraphs are lowered to fusegraph Graphs and built through the
engine layer (at creation, or at first run with ``lazy_compile``); the rest runs in ONNX
Runtime sub-sessions (or, where it wins, through the torch-mlir tier). A claimed
subgraph that fails to build falls back to ONNX Runtime with a warning, or raises
CompileError under ``strict``.

Here: the plan's state, claiming, the units and running them. How a claimed group is
lowered and built is in ``plan_build``, the floor against ONNX Runtime (units and the whole
model) in ``plan_floor``, the partition report in ``plan_report``, the engine choice and the
engines' warnings in ``engine_choice``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from fusegraph.errors import CompileError, ExecutionError, FusegraphError
from fusegraph.onnx import (
    floor,
    plan_build,
    plan_floor,
    plan_regions,
    plan_release,
    plan_report,
    region_choice,
    torch_mlir_tier,
)
from fusegraph.onnx.engine_choice import EngineChoice, engine_warnings
from fusegraph.onnx.engine_choice import one_line as _one_line
from fusegraph.onnx.importer import SPATIAL_OPS, Importer, Unmappable
from fusegraph.onnx.memory import LiveBytes
from fusegraph.onnx.model import ONode, specialize
from fusegraph.onnx.node_key import node_key
from fusegraph.onnx.options import PROVIDER, ProviderOptions
from fusegraph.onnx.partition import Group, PNode, partition
from fusegraph.onnx.patterns import apply_rewrites
from fusegraph.onnx.report import Boundaries, PartitionReport
from fusegraph.onnx.unit_io import read_outside
from fusegraph.onnx.units import FusegraphUnit, OrtUnit, Unit, _ort_value, to_host
from fusegraph.runtime.handle import Handle

log = logging.getLogger("fusegraph.onnx")

Dump = Callable[[str, bytes | str], None]
_UNSET: Any = object()  # sub-session options not made yet


def make_dumper(dump_dir: str | None) -> Dump | None:
    if not dump_dir:
        return None
    root = Path(dump_dir)
    root.mkdir(parents=True, exist_ok=True)

    def dump(name: str, data: bytes | str) -> None:
        path = root / name
        if isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data)

    return dump


class SessionPlan:
    """Everything that depends on the input shapes; ``run`` executes one call."""

    def __init__(
        self,
        model: onnx.ModelProto,
        shapes: Mapping[str, Sequence[int]],
        opts: ProviderOptions,
        *,
        enabled: bool,
        handle: Handle,
        engine: EngineChoice | None,
        sess_options: Any,
        ort_providers: list[Any],
        model_name: str,
        model_path: str | None = None,
        direct: tuple[Any, floor.Verdict] | None = None,
        initializers: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """``model_path``: the file ``model`` was read from, where ONNX Runtime may read it
        again; ``direct``: an ONNX Runtime session already running the whole model and the
        verdict that put it there (the plan then only explains it: nothing is built);
        ``initializers``: the model's initializers already read (``specialize``)."""
        t0 = time.perf_counter()
        self.model_path = model_path
        self._direct = direct
        self.opts = opts
        self.handle = handle
        self.engine = engine
        self.sess_options = sess_options
        self.ort_providers = ort_providers
        self.dump = make_dumper(opts.dump_dir)
        self.model = model  # as given: the whole model on ONNX Runtime, where the floor decides so
        self.og = og = specialize(model, shapes, initializers, cache_dir=opts.cache_dir)
        self.pattern_refusals: dict[str, str] = {}  # anchor node -> why its pattern did not apply
        self.rewrites = apply_rewrites(og, opts.op_types_to_exclude, self.pattern_refusals) if enabled else {}
        self._read_values: set[str] | None = None
        self._claimable: set[tuple[Any, ...]] = set()  # what ``_verdict`` found claimable (_verdict_key)
        if enabled:
            verdicts = {n.name: self._verdict(n) for n in og.nodes}
        else:
            verdicts = {n.name: f"{PROVIDER} is not among the session's providers" for n in og.nodes}
        self.pnodes = [PNode(n.name, n.op_type, n.all_inputs(), n.outputs) for n in og.nodes]
        self.node_verdicts: dict[str, str | None] = verdicts
        self.partitioning = partition(self.pnodes, verdicts, min_size=opts.min_subgraph_size)
        self.notes: dict[str, str] = {}
        self.compile_s: dict[str, float] = {}
        self.by_name = {n.name: n for n in og.nodes}
        self._sub_options: Any = _UNSET  # made at first need (sub_session_options)
        self.floor_budget = opts.floor_budget(pinned=engine is not None and engine.name is not None) if enabled else 0.0
        # claimed units run region by region (plan_regions.py): the region floor, against the
        # same nodes op by op on PyTorch, replaces the floor against ONNX Runtime
        self.regions = enabled and engine is not None and region_choice.wanted(opts, handle)
        self.floor_whole: floor.Verdict | None = None
        self._released: dict[str, str] = {}  # node -> note of the ORT unit it went to
        self._floor: dict[frozenset[str], floor.Verdict] = {}  # claimed group -> verdict
        self._whole_ort: OrtUnit | None = None  # set when the whole model runs as one ORT session
        self._proven: set[int] = set()
        self.units: list[Unit] = []
        known = plan_floor.cached_whole(self) if self._ort_floor and not opts.lazy_compile else None
        if known is None and direct is not None:  # unit verdicts gone from the cache: the model's stands
            known = direct[1]
        if known is not None:  # a cached verdict: the whole model on ONNX Runtime, nothing built
            plan_floor.go_whole_ort(self, known, None)
        else:
            built = self._settle_claimed()
            self._sub_options = _UNSET  # decided again: spinning where all went to ORT
            self.reasons = dict(self.partitioning.reasons)
            for k, group in enumerate(self.partitioning.groups):
                self.units.append(self._final_unit(k, group, built))
            del built
            self._plan_frees()
            if len(self.units) == 1 and isinstance(self.units[0], OrtUnit):
                self._whole_ort = self.units[0]
            if self._ort_floor and not opts.lazy_compile and any(isinstance(u, FusegraphUnit) for u in self.units):
                plan_floor.whole_model_floor(self)
        self.setup_s = time.perf_counter() - t0
        self.last_peak_live = 0
        self.model_name = model_name
        self.input_shapes = {k: tuple(int(d) for d in v) for k, v in shapes.items()}
        if self.dump is not None:
            self.dump("partition_report.txt", str(self.report()))
            self.dump("partition_report.json", json.dumps(self.report().to_dict(), indent=1, default=str))

    # ---- claiming ---------------------------------------------------------------------------
    def _channels_last(self, nodes: Sequence[ONode]) -> bool:
        """``auto``: NHWC where convolutions or pooling are, except float32 on a GPU. cuDNN's
        float32 convolutions without TF32 are NCHW kernels: given NHWC it transposes in and
        out of every call (H200, batch 8, fusegraph over eager with NHWC / NCHW: UNet block
        0.90x / 1.29x, ResNet-50 1.03x / 1.31x, ConvNeXt-T 1.28x / 1.24x)."""
        if self.opts.channels_last != "auto":
            return self.opts.channels_last == "on"
        if self.handle.device.is_gpu and self.opts.precision == "fp32":
            return False
        return any(n.op_type in SPATIAL_OPS for n in nodes)

    def _verdict(self, node: ONode) -> str | None:
        if node.op_type in self.opts.op_types_to_exclude:
            return f"op type {node.op_type} is in op_types_to_exclude"
        channels_last = self._channels_last([node])
        key = self._verdict_key(node, channels_last)
        if key is not None and key in self._claimable:
            return None  # a node like one found claimable before (a model's repeated layers)
        # pack=False: the verdict needs the graph only, not the weights laid out for an engine
        imp = Importer(self.og, node.name, channels_last=channels_last, pack=False)
        try:
            imp.lower(node)
            outs = [o for o in node.outputs if o and o in imp.values and self._is_read(o)]
            imp.finish(outs or [o for o in node.outputs[:1] if o in imp.values] or list(node.outputs[:1]))
        except Unmappable as exc:
            return exc.reason
        assert self.engine is not None
        if self._gather_stays_with_ort(imp.g):
            return ("a run-time gather (an embedding lookup) on the CPU would move its whole unit off IREE, "
                    "which has no gather, onto the torch engine; it stays on ONNX Runtime "
                    "(engine='torch' or regions='on' claim it)")
        why = self.engine.why_not(imp.g)
        if why is None and key is not None:
            self._claimable.add(key)
        return why

    def _verdict_key(self, node: ONode, channels_last: bool) -> tuple[Any, ...] | None:
        """See node_key.node_key (what a node's lowering and verdict read)."""
        return node_key(self.og, node, channels_last, self._is_read)

    def _gather_stays_with_ort(self, g: Any) -> bool:
        """Units run on one engine: on the CPU, where IREE compiles the claimed units by
        default, a gather would hand a transformer's every unit to the torch engine."""
        from fusegraph.graph.ops import OpKind

        assert self.engine is not None
        return (self.engine.name is None and not self.handle.device.is_gpu
                and not region_choice.wanted(self.opts, self.handle)
                and any(e.name == "iree" for e in self.engine.candidates)
                and any(n.kind == OpKind.GATHER for n in g.nodes))

    def _is_read(self, value: str) -> bool:
        if self._read_values is None:  # once: per node, it made claiming quadratic in the node count
            self._read_values = {i for n in self.og.nodes for i in n.all_inputs()} | set(self.og.outputs)
        return value in self._read_values

    # ---- units -----------------------------------------------------------------------------
    def _settle_claimed(self) -> dict[frozenset[str], FusegraphUnit]:
        """Builds the claimed groups and, with the floor on, keeps those faster than ONNX
        Runtime. A group that fails to build, or that the floor hands back, is released
        (its nodes unclaimed, with the reason) and the model re-partitioned, so it joins its
        ONNX Runtime neighbours in one sub-model; rounds repeat until nothing is released
        (a release can let two other claimed groups merge: that new group is built and
        measured in the next round)."""
        built: dict[frozenset[str], FusegraphUnit] = {}
        cache = self._verdict_cache() if self._ort_floor else None
        spent = 0.0
        while True:
            released = False
            todo = [g for g in self.partitioning.groups if g.claimed and frozenset(g.nodes) not in built]
            for k, group in enumerate(self.partitioning.groups):
                if not group.claimed or frozenset(group.nodes) in built:
                    continue
                nodes = [self.by_name[n] for n in group.nodes]
                ins, outs = read_outside(self.og, nodes)
                content = floor.group_key(self.og, nodes, ins, outs) if cache is not None else ""
                verdict = cache.lookup(content) if cache is not None else None
                if verdict is not None and not verdict.keep:  # known to lose: not even built
                    self._release(group.nodes, verdict.describe())
                    released = True
                    continue
                with engine_warnings() as said:
                    unit = self._try_build(f"fusegraph_{k}", nodes, ins, outs)
                    if unit is None:
                        released = True
                        continue
                    if cache is not None and verdict is None and not self.opts.lazy_compile:
                        left = len([g for g in todo if frozenset(g.nodes) not in built])
                        share = min(floor.UNIT_S, max(self.floor_budget * floor.UNITS_SHARE - spent, 0.0) / max(left, 1))
                        unit, verdict, took = plan_floor.judge(self, unit, nodes, ins, outs, share)
                        spent += took
                        cache.record(content, verdict)
                unit.engine_notes.extend(said)
                if verdict is not None:
                    self._floor[frozenset(group.nodes)] = verdict
                    if not verdict.keep:
                        notes = unit.engine_notes  # its warnings, and which CPU path ran (units.py)
                        ran = f" | the engine said: {' | '.join(notes)}" if notes else ""
                        self._release(group.nodes, verdict.describe() + ran)
                        released = True
                        continue
                built[frozenset(group.nodes)] = unit
            if not released:
                break
            self.partitioning = partition(self.pnodes, self.node_verdicts, min_size=self.opts.min_subgraph_size)
        if cache is not None:
            cache.flush()
        return built

    @property
    def _ort_floor(self) -> bool:
        """Claimed units are timed against ONNX Runtime on the CPU only: where they run region
        by region each region is timed against its own incumbent, and on a GPU ONNX Runtime's
        CPU provider is no incumbent (issue 24 item 3)."""
        return self.floor_budget > 0 and not self.regions and not self.handle.device.is_gpu

    def _release(self, names: Sequence[str], note: str) -> None:
        for n in names:
            self.node_verdicts[n] = note
            self._released[n] = note

    def _verdict_cache(self) -> floor.VerdictCache:
        return plan_floor.verdict_cache(self)

    def _whole_key(self) -> str:
        return plan_floor.whole_key(self)

    @property
    def whole_on_ort(self) -> bool:
        """The whole model runs as one ONNX Runtime session (nothing on fusegraph)."""
        return self._whole_ort is not None

    def _try_build(self, name: str, nodes: list[ONode], ins: list[str], outs: list[str]) -> FusegraphUnit | None:
        """The built unit, or None after a failure (released with the reason, or raised under strict)."""
        try:
            return self._fusegraph_unit(name, nodes, ins, outs)
        except (Unmappable, FusegraphError, Exception) as exc:
            why = exc.reason if isinstance(exc, Unmappable) else f"{type(exc).__name__}: {exc}"
            if self.opts.strict:
                if isinstance(exc, CompileError):
                    raise
                raise CompileError(
                    f"claimed subgraph {name} ({len(nodes)} nodes) failed to build and strict=1: {why}",
                    node=nodes[0].name,
                ) from exc
            if self.handle.device.is_gpu:  # the incumbent on a GPU: the same nodes op by op on PyTorch
                instead = plan_build.op_by_op_built_instead(self, name, nodes, ins, outs, _one_line(why))
                if instead is not None:
                    return instead
            log.warning("claimed subgraph %s (%d nodes) falls back to ONNX Runtime: %s", name, len(nodes), why)
            self._release(
                [n.name for n in nodes], f"claimed, but fell back to ONNX Runtime: {_one_line(why)}"
            )
            for n in nodes:
                self.node_verdicts[n.name] = f"its claimed subgraph failed to build: {_one_line(why)}"
            return None

    def _final_unit(self, k: int, group: Group, built: Mapping[frozenset[str], FusegraphUnit]) -> Unit:
        nodes = [self.by_name[n] for n in group.nodes]
        if group.claimed:
            unit = built[frozenset(group.nodes)]
            name = f"fusegraph_{k}"
            if unit.name != name:
                if unit.name in self.compile_s:
                    self.compile_s[name] = self.compile_s.pop(unit.name)
                unit.name = name
            return unit
        ins, outs = read_outside(self.og, nodes)
        unit_ = self._unclaimed_unit(k, nodes, ins, outs)
        notes = list(dict.fromkeys(self._released[n.name] for n in nodes if n.name in self._released))
        if notes:
            self.notes[unit_.name] = " | ".join(notes)
        return unit_

    def _fusegraph_unit(self, name: str, nodes: list[ONode], ins: list[str], outs: list[str]) -> FusegraphUnit:
        """Lowers, packs and builds a claimed group (``plan_build.fusegraph_unit``), or region by
        region (``plan_regions.region_unit``)."""
        if self.regions:
            return plan_regions.region_unit(self, name, nodes, ins, outs)
        return plan_build.fusegraph_unit(self, name, nodes, ins, outs)

    @property
    def sub_session_options(self) -> Any:
        """What ONNX Runtime sub-sessions are opened with, made at the first unit that needs it
        (``_sub_session_options`` for the partition as it is then): a plan with no ONNX Runtime
        unit makes no ``ort.SessionOptions``."""
        if self._sub_options is _UNSET:
            self._sub_options = self._sub_session_options()
        return self._sub_options

    def _sub_session_options(self) -> Any:
        """The caller's SessionOptions as given; without any, and with fusegraph units in the
        plan, ONNX Runtime's intra-op threads are told not to spin after a run: a spinning
        thread holds a core the next fusegraph unit needs (on 2 cores, a PyTorch ResNet-50
        right after an ORT run took 71 ms instead of 34)."""
        if self.sess_options is not None or not self.partitioning.claimed:
            return self.sess_options
        so = ort.SessionOptions()
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return so

    def _ort_unit(self, name: str, nodes: list[ONode], ins: list[str], outs: list[str]) -> OrtUnit:
        return OrtUnit(name, self.og, nodes, ins, outs, self.sub_session_options, self.ort_providers, self.dump)

    def _unclaimed_unit(self, k: int, nodes: list[ONode], ins: list[str], outs: list[str]) -> Unit:
        ort_unit = self._ort_unit(f"onnxruntime_{k}", nodes, ins, outs)
        if self.opts.torch_mlir_tier == "off":
            return ort_unit
        if self.opts.torch_mlir_tier == "auto" and any(n.name in self._released for n in nodes):
            # The tier is for regions the graph API lacks; this one holds nodes fusegraph could
            # run and handed back (ONNX Runtime was faster, or the build failed): compiling it
            # whole through IREE only to compare cost 12 s of MobileNetV3-Small's cold setup.
            return ort_unit
        t0 = time.perf_counter()
        tier = torch_mlir_tier.try_unit(
            f"iree_onnx_{k}", self.og, nodes, ins, outs, ort_unit,
            mode=self.opts.torch_mlir_tier, device=str(self.handle.device),
            cache_dir=self.opts.cache_dir, strict=self.opts.strict,
        )
        if tier is None:
            return ort_unit
        self.compile_s[tier.name] = time.perf_counter() - t0
        self.notes[tier.name] = tier.note
        return tier

    def _plan_frees(self) -> None:
        """After unit k runs, the values whose last reader it was are dropped."""
        last: dict[str, int] = {}
        for k, u in enumerate(self.units):
            for i in u.inputs:
                last[i] = k
            for o in u.outputs:
                last.setdefault(o, k)
        keep = set(self.og.outputs)
        self.free_after: list[list[str]] = [[] for _ in self.units]
        for v, k in last.items():
            if v not in keep:
                self.free_after[k].append(v)

    # ---- running ---------------------------------------------------------------------------
    def run(self, feed: Mapping[str, Any], wanted: Sequence[str], *, host: bool = True) -> list[Any]:
        """The ``wanted`` values as NumPy arrays, or with ``host=False`` as the units made
        them (torch CUDA tensors from a GPU session's region units: io_binding's device path)."""
        whole = self._whole_ort
        if whole is not None and whole.session is not None and all(w in whole.outputs for w in wanted):
            # the whole model on ONNX Runtime: nothing to route, nothing held between units
            return whole.session.run(list(wanted), {i: _ort_value(feed[i]) for i in whole.inputs})  # type: ignore[no-any-return]
        env: dict[str, Any] = dict(feed)
        live = LiveBytes()
        for k, unit in enumerate(self.units):
            try:
                if k in self._proven or not isinstance(unit, FusegraphUnit):
                    outs = unit.run({i: env[i] for i in unit.inputs})
                else:  # its first run: what the engine says (e.g. a path it refused) goes to the report
                    with engine_warnings() as said:
                        outs = unit.run({i: env[i] for i in unit.inputs})
                    unit.engine_notes.extend(m for m in said if m not in unit.engine_notes)
            except Exception as exc:
                outs = self._recover(k, unit, exc, env)
            else:
                if k not in self._proven and isinstance(unit, FusegraphUnit):
                    self._proven.add(k)
                    self._release_constants(k)
            for name, value in outs.items():
                env[name] = value
                live.add(name, value)
            for name in self.free_after[k]:
                env.pop(name, None)
                live.drop(name)
        self.last_peak_live = live.peak
        results = []
        for name in wanted:
            v = env[name] if name in env else self.og.constants.get(name)
            if v is None:
                raise ExecutionError(f"output '{name}' was not computed (a bug)", tensor=name)
            if not host:
                results.append(v)
                continue
            v = to_host(v)
            if isinstance(v, np.ndarray) and not v.flags.c_contiguous:
                v = np.ascontiguousarray(v)  # as ONNX Runtime returns them (never for 0-d: it adds a dim)
            results.append(v)
        return results

    def _release_constants(self, k: int) -> None:
        """Once a fusegraph unit has run, the ONNX-layout copies of the constants only it reads
        are dropped (it holds its own packed ones); they were kept until then so that a unit
        failing at its first run could still fall back to ONNX Runtime."""
        mine = {i for n in self.units[k].nodes for i in n.all_inputs() if i in self.og.constants}
        others = {
            i for j, u in enumerate(self.units) if j != k and not (j in self._proven and isinstance(u, FusegraphUnit))
            for n in u.nodes for i in n.all_inputs()
        }
        for name in mine - others - set(self.og.outputs):
            del self.og.constants[name]

    def _recover(self, k: int, unit: Unit, exc: Exception, env: Mapping[str, Any]) -> dict[str, Any]:
        """A fusegraph unit that fails at run time (lazy compile included) is replaced by
        ONNX Runtime, unless strict."""
        if not isinstance(unit, FusegraphUnit) or self.opts.strict:
            if isinstance(exc, FusegraphError):
                raise exc
            if isinstance(unit, FusegraphUnit):
                raise CompileError(f"claimed subgraph {unit.name} failed and strict=1: {exc}") from exc
            raise exc
        why = _one_line(f"{type(exc).__name__}: {exc}")
        if self.handle.device.is_gpu:  # the incumbent on a GPU: the same nodes op by op on PyTorch
            got = plan_build.op_by_op_instead(self, unit, why, env)
            if got is not None:
                self.units[k], outs = got
                return outs
        log.warning("claimed subgraph %s failed at run time, falls back to ONNX Runtime: %s", unit.name, why)
        name = unit.name.replace("fusegraph_", "onnxruntime_")
        repl = self._ort_unit(name, unit.nodes, unit.inputs, unit.outputs)
        self.units[k] = repl
        self.notes[name] = f"claimed, but fell back to ONNX Runtime at run time: {why}"
        for n in unit.nodes:
            self.reasons[n.name] = f"its claimed subgraph failed: {why}"
        return repl.run({i: env[i] for i in repl.inputs})

    # ---- end of life ------------------------------------------------------------------------
    def release(self) -> None:
        """Breaks the reference cycles inside the plan (below) and drops its units, so that
        their weights and engine plans are freed as soon as the last reference goes, not at
        the garbage collector's next full pass. For a plan no one runs again: the session
        calls it when it is itself freed."""
        units, self.units = self.units, []
        self._whole_ort = None
        busy = [u for u in units if isinstance(u, plan_regions.RegionUnit) and not u.stop_upgrade(0.2)]
        if busy:  # a region still building in the background: its thread holds the unit until it ends
            log.info("%s: left to the garbage collector (a region was still being built)", [u.name for u in busy])
        plan_release.break_cycles([u for u in units if u not in busy])

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the units' background region choices (region_upgrade.py) are done;
        True when nothing is pending any more."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for u in self.units:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if isinstance(u, plan_regions.RegionUnit) and not u.wait(left):
                return False
        return True

    # ---- report -----------------------------------------------------------------------------
    def report(self) -> PartitionReport:
        return plan_report.report(self)

    def boundaries(self) -> Boundaries:
        """Static count of the values crossing units and the copies made there (see Boundaries)."""
        return plan_report.boundaries(self)


__all__ = ["EngineChoice", "SessionPlan", "engine_warnings", "make_dumper"]
