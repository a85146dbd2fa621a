"""Which nodes ran where and why: one row per compute node of a front door's graph (an
ONNX node, an ATen node, a fusegraph node), naming the region and pattern it fell in,
what runs it (a fusegraph engine, or the incumbent) and the reason (the verdict's
measurements, the refusal, or why no region took it). ``coverage`` is the fraction of
compute nodes fusegraph's engines run: the one number to watch when a model is slow."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fusegraph.regions.choose import Choice
from fusegraph.regions.split import Split


@dataclass(frozen=True)
class Row:
    node: str
    op: str
    where: str  # "fusegraph:<engine config>" or the incumbent's name
    region: int | None = None
    pattern: str = ""
    why: str = ""
    compute: bool = True  # data movement and bookkeeping do not count toward coverage

    @property
    def fusegraph(self) -> bool:
        return self.where.startswith("fusegraph:")


@dataclass(frozen=True)
class Report:
    rows: tuple[Row, ...]

    @property
    def coverage(self) -> float:
        compute = [r for r in self.rows if r.compute]
        return sum(r.fusegraph for r in compute) / len(compute) if compute else 0.0

    def where(self) -> Counter[str]:
        return Counter(r.where for r in self.rows if r.compute)

    def patterns(self) -> Counter[str]:
        """Claimed regions' patterns, counted once per region."""
        seen = {(r.region, r.pattern) for r in self.rows if r.fusegraph and r.region is not None}
        return Counter(p for _, p in seen)

    def summary(self) -> str:
        compute = sum(r.compute for r in self.rows)
        lines = [f"coverage {self.coverage:.1%} of {compute} compute nodes"]
        lines += [f"  {where}: {n}" for where, n in sorted(self.where().items())]
        if self.patterns():
            lines.append("  fused patterns: " + ", ".join(f"{p} x{n}" for p, n in sorted(self.patterns().items())))
        return "\n".join(lines)

    def table(self) -> str:
        out = []
        for r in self.rows:
            region = f"r{r.region}" if r.region is not None else "-"
            out.append(f"{r.node:<28} {r.op:<36} {region:<5} {r.where:<28} {r.pattern:<28} {r.why}")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.summary()


def rows_for(split: Split, choices: Sequence[Choice], ops: dict[str, str], incumbent: str,
             compute: Iterable[str] | None = None) -> list[Row]:
    """Rows for the fusegraph nodes a split saw: ``ops`` names each node's op as the
    front door knows it (node name -> op), ``compute`` the nodes that count (default all)."""
    counted = set(compute) if compute is not None else set(ops)
    rows: list[Row] = []
    for choice in choices:
        r, v = choice.region, choice.verdict
        where = f"fusegraph:{v.engine}" if choice.claimed else incumbent
        for n in r.nodes:
            rows.append(Row(n, ops.get(n, "?"), where, r.index, r.pattern, v.describe(), n in counted))
    for rej in split.rejected:
        for n in rej.nodes:
            rows.append(Row(n, ops.get(n, "?"), incumbent, None, "", rej.reason, n in counted))
    return rows
