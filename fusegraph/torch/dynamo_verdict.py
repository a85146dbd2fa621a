"""Where a Dynamo graph's verdict is stored: which way the whole graph runs (Inductor's own
compile, eager, or fusegraph's trace), so that a later compile of the same graph builds
only the side that won. compile_backend.py takes the verdict; this module keys, reads and
writes it, and writes the report rows of a graph that ran without an ATen trace."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from fusegraph.regions.report import Row
from fusegraph.torch.partition import Options

log = logging.getLogger("fusegraph.torch")

_COUNTER = itertools.count()  # "graph<n>" names, unique across a report (ATen graphs are "fw<n>"/"bw<n>")

STORED_OWN = "Inductor's own compile: a stored verdict chose it for this Dynamo graph"
STORED_EAGER = "eager: a stored verdict chose it for this Dynamo graph (run as it is, nothing compiled)"
STORED_GRAPHED = "Inductor's own compile in CUDA graphs: a stored verdict chose it for this Dynamo graph"
NO_REGION_EAGER = "no region kept in this graph: it runs eagerly, the Dynamo graph as it is"


@dataclasses.dataclass(frozen=True)
class DynamoVerdict:
    """Where a Dynamo graph's verdict against Inductor's own compile is stored (the region
    verdicts' table, so clearing the cache clears it): "no region kept" (concluded from the
    regions' verdicts) or the step timed against it (step_floor.py: either side may win).
    Its key (graph_floor.inductors_own_key): the graph's content, the options that change
    what is claimed, the mode, the device and every library version, so a new fusegraph or
    engine tries the graph again."""

    key: str
    store: Any  # regions.verdicts.VerdictStore

    @staticmethod
    def of(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: Options, mode: str | None,
           checked: bool) -> DynamoVerdict:
        from fusegraph.engines.registry import REGISTRY
        from fusegraph.regions.verdicts import VerdictStore
        from fusegraph.select.device_id import device_id
        from fusegraph.select.tuning_db import engine_versions
        from fusegraph.torch import graph_floor
        from fusegraph.torch.plans import PLANS
        from fusegraph.torch.step_floor import ORDER, device_of

        device = device_of(example_inputs)
        # warmup_s bounds a timing's warm-up and budget what is measured at once (what a
        # compile leaves unmeasured decides when its verdict is stored): neither decides one
        options = {k: v for k, v in dataclasses.asdict(opts).items() if k not in ("warmup_s", "budget")}
        settings: dict[str, Any] = {"options": options, "mode": mode, "engine": PLANS.engine}
        if checked:  # the step check's candidates: a verdict stored before eager was one is not read
            settings["candidates"] = list(ORDER)
            if device.type == "cuda":
                # a GPU's step timed whole includes the host's launches (CUDA graphs win where
                # the host is slow, eager where Inductor's Python wrapper is): two H200 hosts ran
                # Inductor's ViT-B/16 step in 19.7 and 13.8 ms, so the host is part of the key
                from fusegraph.select.device_id import cpu_model

                settings["host"] = cpu_model()
        key = graph_floor.inductors_own_key(gm, example_inputs, settings, device_id(PLANS.handle(device)),
                                            engine_versions(REGISTRY.available_engines()))
        return DynamoVerdict(key, VerdictStore())

    def lookup(self) -> Any:
        try:
            found = self.store.lookup(self.key)
        except Exception as exc:  # the usual path runs
            log.info("the stored Dynamo graph verdict could not be read (%s: %s)", type(exc).__name__, exc)
            return None
        return found

    def record_step(self, verdict: Any) -> None:
        """The step's verdict (step_floor.py); the store keeps measured ones only."""
        try:
            self.store.record(self.key, verdict)
            self.store.flush()
        except Exception as exc:  # the next compile times the step again
            log.info("the Dynamo graph verdict was not stored (%s: %s)", type(exc).__name__, exc)

    def record(self, rows: list[Row]) -> None:
        from fusegraph.regions.verdicts import Verdict
        from fusegraph.torch import graph_floor

        graphs = len({r.node.split(":", 1)[0] for r in rows})
        regions = len({(r.node.split(":", 1)[0], r.region) for r in rows if r.region is not None})
        why = (f"fusegraph's trace kept no region in {graphs} ATen graph{'s' * (graphs != 1)} "
               f"({regions} region{'s' * (regions != 1)} chosen among)")
        try:
            self.store.record(self.key, Verdict(False, "concluded", why, incumbent=graph_floor.INDUCTORS_OWN))
            self.store.flush()
        except Exception as exc:  # the next compile traces the graph again
            log.info("the Dynamo graph verdict was not stored (%s: %s)", type(exc).__name__, exc)

    @property
    def _explored_key(self) -> str:
        return f"{self.key}:explored"

    def explored_before(self) -> bool:
        """Whether an earlier compile of this graph left regions unmeasured (the floor's
        budget) where a measured region won: this compile's verdict is then stored whatever
        it leaves, so measuring is spread over two compiles at most (where none won, the
        first compile's verdict is stored: compile_backend._Compile.lasting). Until a verdict is stored every compile traces
        the graph again and spends the budget (a GPT-2 on an H200: 11-14 s over Inductor's
        own compile, still unstored after three compiles); once stored, a compile is
        Inductor's own. Regions never measured run the incumbent until a new fusegraph,
        engine or torch version changes the key."""
        try:
            return self.store.lookup(self._explored_key) is not None
        except Exception as exc:  # read as not explored: this compile explores again
            log.info("the Dynamo graph's exploration mark could not be read (%s: %s)", type(exc).__name__, exc)
            return False

    def record_explored(self, unmeasured: int) -> None:
        """Marks a compile that stored no verdict because ``unmeasured`` regions were left to
        a later compile: that later compile's verdict is stored whatever it leaves."""
        from fusegraph.regions.verdicts import Verdict
        from fusegraph.torch import graph_floor

        why = f"a compile of this graph left {unmeasured} region{'s' * (unmeasured != 1)} unmeasured (the floor's budget)"
        try:
            self.store.record(self._explored_key, Verdict(False, "concluded", why, incumbent=graph_floor.INDUCTORS_OWN))
            self.store.flush()
        except Exception as exc:  # the next compile explores as this one did
            log.info("the Dynamo graph's exploration mark was not stored (%s: %s)", type(exc).__name__, exc)

    def store_or_mark(self, record: Callable[[], None], *, lasting: bool, unmeasured: int) -> None:
        """Records a compile's verdict (``record``) where it lasts; where ``unmeasured``
        regions were left to a later compile instead, marks the graph explored, so that
        compile's verdict is stored whatever it leaves; otherwise (a graph check failed)
        stores nothing, and a later compile checks the graph again."""
        if lasting:
            record()
        elif unmeasured:
            self.record_explored(unmeasured)
            log.info("the graph's verdict is not stored: this compile left %d region%s unmeasured (the floor's "
                     "budget); the next compile measures more and its verdict is stored", unmeasured,
                     "s" * (unmeasured != 1))
        else:
            log.info("the graph's verdict is not stored: a graph check failed or could not time its graph, so a "
                     "later compile checks the graph again")

    def why(self, verdict: Any, prefix: str = STORED_OWN) -> str:
        return f"{prefix} ({verdict.describe()}; stored in {self.store.path}, key {self.key[:16]})"


def dynamo_rows(gm: torch.fx.GraphModule, where: str, why: str) -> list[Row]:
    """One row per call in the Dynamo graph (no ATen graph was traced), each saying why."""
    graph = f"graph{next(_COUNTER)}"
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    if not calls:
        return [Row(graph, "graph", where, why=why, compute=False)]
    return [Row(f"{graph}:{n.name}", _op(n), where, why=why,
                compute=not (n.op == "call_function" and n.target is operator.getitem)) for n in calls]


def _op(n: torch.fx.Node) -> str:
    if n.op != "call_function":
        return str(n.target)
    module = getattr(n.target, "__module__", None) or ""
    name = getattr(n.target, "__name__", None) or str(n.target)
    return f"{module}.{name}" if module else name
