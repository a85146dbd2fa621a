"""The ONNX op table: ONNX op type -> the lowering that turns one node into fusegraph ops.

Every lowering is registered with :func:`lowers` in the module of its family (``conv``,
``gemm``, ``gqa``, ``elementwise``, ``norm``, ``shape``, ``rotary``), directly above its function, and checks
the node's attributes first: what it cannot express it rejects by raising
:class:`Unmappable` with the op type, the attribute and its value, which the partition
report shows as the reason the node stays on ONNX Runtime. The claim rule reads this table
alone (``Importer.lower``): an op type that is not in it is unclaimed with "no fusegraph
lowering", so adding an ONNX op is one registered function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from fusegraph.onnx.importer import Importer
    from fusegraph.onnx.model import ONode


class Unmappable(Exception):
    """This node cannot become fusegraph ops; ``reason`` says exactly why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


Lowering = Callable[["Importer", "ONode"], None]
F = TypeVar("F", bound=Lowering)


@dataclass(frozen=True)
class OpEntry:
    """One row of the table."""

    op_type: str
    lower: Lowering
    family: str  # the module that holds the lowering
    spatial: bool  # a partition holding this op keeps its activations channels-last


TABLE: dict[str, OpEntry] = {}


def register(op_type: str, fn: Lowering, *, spatial: bool = False) -> None:
    """Adds ``op_type`` to the table; an op type has exactly one lowering."""
    if op_type in TABLE:
        raise ValueError(f"ONNX op type {op_type} already lowered by {TABLE[op_type].family}")
    family = getattr(fn, "__module__", "").rsplit(".", 1)[-1]
    TABLE[op_type] = OpEntry(op_type, fn, family, spatial)


def lowers(*op_types: str, spatial: bool = False) -> Callable[[F], F]:
    """Decorator: the function lowers nodes of these ONNX op types (default domain)."""

    def add(fn: F) -> F:
        for op in op_types:
            register(op, fn, spatial=spatial)
        return fn

    return add


def lowering_for(op_type: str) -> Lowering | None:
    entry = TABLE.get(op_type)
    return entry.lower if entry is not None else None


#: Domains besides the default whose ops the table may lower: ONNX Runtime's contrib ops,
#: and the fused nodes of ``fusegraph.onnx.patterns`` (one op type per match, ``<Kind>_<k>``,
#: each backed by a model-local function of the same name holding the nodes it replaced).
CONTRIB_DOMAIN = "com.microsoft"
FUSED_DOMAIN = "ai.fusegraph.patterns"


def fused_kind(op_type: str) -> str:
    """``Attention_3`` -> ``Attention``: the lowering of a fused node is chosen by its kind."""
    return op_type.rsplit("_", 1)[0]


def fused(kind: str) -> str:
    """The table key of a pattern's fused node of ``kind``."""
    return f"{FUSED_DOMAIN}:{kind}"


def contrib(op_type: str) -> str:
    """The table key of an ONNX Runtime contrib op (domain com.microsoft)."""
    return f"{CONTRIB_DOMAIN}:{op_type}"


def table_key(op_type: str, domain: str) -> str:
    """Default-domain ops by op type, others as ``domain:op_type``; a fused node by its kind."""
    if domain in ("", "ai.onnx"):
        return op_type
    if domain == FUSED_DOMAIN:
        return f"{domain}:{fused_kind(op_type)}"
    return f"{domain}:{op_type}"
