"""What each built-in engine declares it cannot run, with the reason: the other half of the
op table's coverage.

Every ``OpKind`` and every ``PointwiseMode`` of graph/ops.py is either implemented by an
engine (a row in its lowering table: ``reference.ops.REFERENCE`` / ``POINTWISE_FNS``,
``engines.iree.emit.LOWER`` / ``lower_pointwise.POINTWISE_LOWER``, the torch engine's
``LOWER`` and pointwise table) or listed here for that engine with the reason.
tests/test_layers.py names every (engine, op) that is neither. Selection refuses a graph
holding a declared op on that engine with the reason given here (select/api.py), before
the engine is asked, so an engine need not repeat the check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fusegraph.graph.ops import BACKWARD, INDEXING, OpKind, PointwiseAttrs, PointwiseMode

if TYPE_CHECKING:
    from fusegraph.graph.graph import Graph

Op = OpKind | PointwiseMode

_ROW_KERNEL_ONLY = (
    "the triton engine generates row kernels (pointwise ops and reshapes of the whole row frame around "
    "softmax, norms and trailing reductions; layer and RMS norm backward); other ops go to cudnn or torch"
)

_NEW_BACKWARD_MODES = (
    PointwiseMode.ELU_BWD,
    PointwiseMode.GELU_APPROX_TANH_BWD,
    PointwiseMode.SOFTPLUS_BWD,
    PointwiseMode.SWISH_BWD,
)
_NOT_EMITTED = "not emitted for IREE yet (the reference and torch engines run it)"
_NOT_WIRED = (
    "not wired to cuDNN's frontend yet in engines/cudnn/rules.py (the reference and torch engines run it)"
)
_NO_GATHER = "cuDNN's graph API has no gather (indexing) node; the torch engine runs it"
_DROPOUT_RNG = (
    "fusegraph's dropout mask is its own Philox stream (reference/dropout.py); cuDNN draws its "
    "own, so its masks would differ"
)

# engine -> op or pointwise mode -> why the engine does not run it. The reference and torch
# engines implement the whole table; the cudnn engine answers from cuDNN itself
# (engines/cudnn/lower.py) and lists here only the ops added since; triton is a row-kernel
# generator by design.
UNSUPPORTED: dict[str, dict[Op, str]] = {
    "reference": {},
    "iree": {
        **{k: _NOT_EMITTED for k in BACKWARD},
        **{m: _NOT_EMITTED for m in _NEW_BACKWARD_MODES},
        **{k: _NOT_EMITTED for k in INDEXING},
        OpKind.POOLING_BACKWARD: _NOT_EMITTED,
    },
    "torch": {},
    "triton": {
        **{
            k: _ROW_KERNEL_ONLY
            for k in OpKind
            if k not in (OpKind.POINTWISE, OpKind.SOFTMAX, OpKind.LAYERNORM, OpKind.RMSNORM, OpKind.REDUCTION,
                         OpKind.RESHAPE, OpKind.LAYERNORM_BACKWARD, OpKind.RMSNORM_BACKWARD)
        },
        **{m: "no Triton expression for this mode yet (engines/triton/codegen.py)" for m in _NEW_BACKWARD_MODES},
    },
    "cudnn": {
        # norm backward and sdpa backward are lowered (engines/cudnn/lower_backward.py)
        **{m: _NOT_WIRED for m in _NEW_BACKWARD_MODES},
        **{k: _NO_GATHER for k in INDEXING},
        OpKind.POOLING_BACKWARD: "the cuDNN frontend's Python graph (1.32) exposes no resample backward node",
    },
}

# engine -> (op, optional port) -> why the engine does not run that op with that port
# connected: features added to an op the engine runs (a node using one is refused the same
# way as a declared op; without this the engine would ignore the port).
UNSUPPORTED_PORTS: dict[str, dict[tuple[OpKind, str], str]] = {
    "iree": {
        (OpKind.SDPA, "stats"): _NOT_EMITTED,
        (OpKind.SDPA, "seed"): _NOT_EMITTED,
        (OpKind.BATCHNORM, "in_running_mean"): _NOT_EMITTED,
    },
    "cudnn": {
        (OpKind.SDPA, "seed"): _DROPOUT_RNG,
        (OpKind.SDPA_BACKWARD, "seed"): _DROPOUT_RNG,
        (OpKind.BATCHNORM, "in_running_mean"): _NOT_WIRED,
    },
}


def declared_unsupported(engine: str, graph: Graph) -> str | None:
    """The first node of ``graph`` that ``engine`` declares it cannot run, as a reason."""
    table = UNSUPPORTED.get(engine)
    ports = UNSUPPORTED_PORTS.get(engine)
    if not table and not ports:
        return None
    for node in graph.nodes:
        op: Op = node.attrs.mode if isinstance(node.attrs, PointwiseAttrs) else node.kind
        why = table.get(op) if table else None
        if why is not None:
            return f"node '{node.name}' ({op.value}): {why}"
        for port in (*node.inputs, *node.outputs):
            why = ports.get((node.kind, port)) if ports else None
            if why is not None:
                return f"node '{node.name}' ({op.value} with '{port}'): {why}"
    return None
