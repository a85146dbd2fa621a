"""The partition report: what runs where, and why the rest does not run on fusegraph."""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class RegionEntry:
    """One region of a claimed unit run region by region (plan_regions.py): its ONNX nodes,
    the pattern it matched, what runs it (``fusegraph:<engine config>`` or the incumbent's
    name) and why -- the verdict with both medians, the refusal, or why no region took it."""

    index: int  # its step's position in the unit (r0, r1, ... in run order)
    pattern: str  # the region layer's pattern name; "" for nodes no region took
    nodes: tuple[str, ...]  # the model's ONNX nodes it runs (as SubgraphEntry.nodes names them)
    op_types: tuple[str, ...]
    where: str
    why: str
    source: str = ""  # the verdict's: measured, cached, claimed, refused; "" for nodes no region took
    fusegraph_ms: float | None = None
    incumbent_ms: float | None = None
    compute: bool = True  # False for reshapes / transposes alone: they do not count against coverage

    @property
    def fusegraph(self) -> bool:
        return self.where.startswith("fusegraph:")


@dataclass(frozen=True)
class SubgraphEntry:
    name: str
    kind: str  # "fusegraph", "onnxruntime", "iree-onnx" (torch-mlir tier) or a whole-model runner ("openvino", ...)
    engine: str
    nodes: tuple[str, ...]  # original ONNX node names it runs (folded BatchNorms included)
    op_types: dict[str, int]
    fusions: dict[str, int] = field(default_factory=dict)
    note: str = ""  # e.g. why a claimed subgraph fell back
    compile_s: float = 0.0
    floor: str = ""  # the floor's verdict on a claimed subgraph (times of both sides)
    fusegraph_ms: float | None = None  # the floor's timing of the subgraph on fusegraph
    ort_ms: float | None = None  # ... and of the same sub-model on ONNX Runtime
    regions: tuple[RegionEntry, ...] = ()  # where the unit runs region by region: each region's row


@dataclass(frozen=True)
class Boundaries:
    """Values crossing unit boundaries in one run, and how many of them are copied there
    (a channels-last fusegraph output made contiguous for ONNX Runtime or the caller, a
    contiguous array laid out channels-last for a fusegraph unit, a device buffer read back)."""

    values: int = 0
    copies: int = 0
    copy_bytes: int = 0


@dataclass(frozen=True)
class UnclaimedEntry:
    node: str
    op_type: str
    reason: str
    runs_on: str  # "onnxruntime" or "iree-onnx"


@dataclass(frozen=True)
class PartitionReport:
    model: str
    total_nodes: int  # nodes of the model as given
    folded_nodes: int  # constant computations folded at session creation
    subgraphs: tuple[SubgraphEntry, ...]
    unclaimed: tuple[UnclaimedEntry, ...]
    rewrites: dict[str, int] = field(default_factory=dict)
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    setup_s: float = 0.0
    floor: str = ""  # the whole-model verdict (plan vs ONNX Runtime alone), or why none
    boundaries: Boundaries = field(default_factory=Boundaries)
    runners: tuple[str, ...] = ()  # the whole-model runners the floor timed (one line each), if any
    patterns_refused: tuple[str, ...] = ()  # "pattern at 'node': why" where a pattern's anchor matched but not the rest

    @property
    def running_nodes(self) -> int:
        """Non-constant nodes: every node some unit runs."""
        return sum(len(s.nodes) for s in self.subgraphs)

    @property
    def fusegraph_nodes(self) -> int:
        """Nodes fusegraph's engines run: a unit run region by region counts without the
        compute nodes of its regions the incumbent runs (data movement alone, which no engine
        fuses, stays counted with its unit)."""
        total = 0
        for s in self.subgraphs:
            if s.kind == "fusegraph":
                elsewhere = {n for r in s.regions if not r.fusegraph and r.compute for n in r.nodes}
                total += sum(n not in elsewhere for n in s.nodes)
        return total

    @property
    def tier_nodes(self) -> int:
        return sum(len(s.nodes) for s in self.subgraphs if s.kind == "iree-onnx")

    @property
    def coverage(self) -> float:
        """Fraction of non-constant nodes on fusegraph graph engines."""
        return self.fusegraph_nodes / self.running_nodes if self.running_nodes else 1.0

    def summary(self) -> str:
        kinds = collections.Counter(s.kind for s in self.subgraphs)
        parts = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        tier = f", {self.tier_nodes} via torch-mlir tier" if self.tier_nodes else ""
        engines = collections.Counter(s.engine for s in self.subgraphs if s.kind == "fusegraph" and not s.regions)
        engines.update(r.where for s in self.subgraphs for r in s.regions)  # a unit run region by region
        ran = ", ".join(f"{k} x{v}" for k, v in sorted(engines.items()))
        runner = [s.engine for s in self.subgraphs if s.kind not in ("fusegraph", "onnxruntime", "iree-onnx")]
        whole = f"; the whole model on {runner[0]} (the floor's pick)" if runner else ""
        return (
            f"{self.fusegraph_nodes}/{self.running_nodes} non-constant nodes on fusegraph "
            f"({100 * self.coverage:.1f}%){tier}; {self.folded_nodes} folded at setup; "
            f"subgraphs: {parts or 'none'}; engines that ran: {ran or 'none'}{whole}"
        )

    def __str__(self) -> str:
        lines = [f"partition report: {self.model}", "  " + self.summary()]
        b = self.boundaries
        lines.append(
            f"  boundaries: {b.values} values cross units, {b.copies} copied ({b.copy_bytes / 2**20:.2f} MiB per run)"
        )
        if self.floor:
            lines.append(f"  {self.floor}")
        if self.runners:
            lines.append("  whole-model runners (each timed against the incumbent):")
            lines += [f"    {r}" for r in self.runners]
        if self.rewrites:
            lines.append("  rewrites: " + ", ".join(f"{k} x{v}" for k, v in sorted(self.rewrites.items()) if v))
        if self.patterns_refused:
            lines.append("  patterns not applied:")
            lines += [f"    {r}" for r in self.patterns_refused]
        for s in self.subgraphs:
            ops = ", ".join(f"{k}x{v}" for k, v in sorted(s.op_types.items()))
            extra = f"  [compile {s.compile_s:.2f}s]" if s.compile_s else ""
            lines.append(f"  {s.name}: {s.kind} ({s.engine}), {len(s.nodes)} nodes: {ops}{extra}")
            if s.fusions:
                lines.append("      fused: " + ", ".join(f"{k} x{v}" for k, v in sorted(s.fusions.items())))
            if s.floor:
                lines.append(f"      {s.floor}")
            for r in s.regions:
                ops = ",".join(r.op_types)
                names = ", ".join(r.nodes[:3]) + (", ..." if len(r.nodes) > 3 else "")
                lines.append(f"      r{r.index} {r.pattern or '(no region)'} [{ops}] ({names}) -> {r.where}: {r.why}")
            if s.note:
                lines.append(f"      note: {s.note}")
        if self.unclaimed:
            # One line per distinct reason (a missing device repeats one reason per node).
            lines.append("  not on fusegraph:")
            groups: dict[tuple[str, str], list[UnclaimedEntry]] = {}
            for u in self.unclaimed:
                groups.setdefault((u.reason, u.runs_on), []).append(u)
            for (reason, runs_on), us in groups.items():
                ops = ", ".join(f"{k}x{v}" for k, v in sorted(collections.Counter(u.op_type for u in us).items()))
                first = ", ".join(u.node for u in us[:3]) + (", ..." if len(us) > 3 else "")
                lines.append(f"    {len(us)} node{'s' if len(us) != 1 else ''} ({ops}; {first}) -> {runs_on}: {reason}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["summary"] = self.summary()
        d["coverage"] = self.coverage
        return d
