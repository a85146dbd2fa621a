"""Graph -> torch-dialect MLIR: one function per graph, compiled by IREE (input_type="torch").

Boundary convention: each argument and result is the tensor's dense memory-order buffer,
``layout.physical_shape(dim, stride)`` in its own data type, so an NHWC tensor crosses as
[N, H, W, C] with no copy. Scalars are inlined. Inside, values remember the order of
their axes (see ``lower_base.Val``) so that layouts are changed only where an op needs it;
convolutions run channels-last (see ``lower_conv``). See docs/iree_emitter.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusegraph.engines.base import Knob
from fusegraph.errors import FusegraphError, UnsupportedError
from fusegraph.graph import layout
from fusegraph.graph.graph import Graph
from fusegraph.graph.node import Node
from fusegraph.graph.ops import OpKind

if TYPE_CHECKING:
    from fusegraph.engines.iree.lower_base import Lowering

# The lowering modules are imported by the first emission (``lower_table()``), not here: a
# build whose module is in the disk cache reads EMITTER_VERSION and EmitOptions from this
# module and never emits, so it need not load every lowering (issue 10's cold build).


def _source_digest() -> str:
    """Hash of this module and every lowering module: the engine keys its cache on it."""
    here = Path(__file__)
    h = hashlib.sha256()
    for path in [*sorted(here.parent.glob("lower_*.py")), here]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


EMITTER_VERSION = _source_digest()

CONV_LAYOUTS = ("nhwc", "nchw")
FILTER_FENCES = ("compute_barrier", "optimization_barrier", "none")
ATTENTION = ("fused", "decomposed")
NORM_VARIANCE = ("two_pass", "one_pass")


@dataclass(frozen=True)
class EmitOptions:
    """Emission knobs (engine knobs, part of the autotuning space and of the cache key).

    conv_layout: "nhwc" runs forward convolutions channels-last as linalg named ops
        (fast on CPU); "nchw" emits torch.aten.convolution on the logical layout.
    filter_fence: how a transposed filter is kept in its own dispatch, so that IREE does
        not fold the transpose into the convolution (which makes it a slow generic op):
        "compute_barrier" (IREE's dispatch-region marker, free at run time),
        "optimization_barrier" (one more submission per call) or "none".
    attention: "fused" emits torch's scaled_dot_product_attention (IREE's attention
        op); "decomposed" writes matmul, mask, softmax, matmul.
    norm_variance: "two_pass" E[(x - mean)^2] (exact) or "one_pass" E[x^2] - mean^2
        (batch/layer norm statistics in one fused reduction; less precise).
    round_intermediates: round virtual tensors to their declared (narrower) float type,
        as the graph says; off, values stay in the compute type between fused ops
        (closer to the float64 reference, and no convert pairs in the kernels).
    """

    conv_layout: str = "nhwc"
    filter_fence: str = "compute_barrier"
    attention: str = "fused"
    norm_variance: str = "two_pass"
    round_intermediates: bool = True

    def __post_init__(self) -> None:
        if self.conv_layout not in CONV_LAYOUTS:
            raise ValueError(f"conv_layout must be one of {CONV_LAYOUTS}, got {self.conv_layout!r}")
        if self.filter_fence not in FILTER_FENCES:
            raise ValueError(f"filter_fence must be one of {FILTER_FENCES}, got {self.filter_fence!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")
        if self.norm_variance not in NORM_VARIANCE:
            raise ValueError(f"norm_variance must be one of {NORM_VARIANCE}, got {self.norm_variance!r}")


# EmitOptions as engine knobs (the autotuner's emitter search space).
EMIT_KNOBS: tuple[Knob, ...] = (
    Knob("conv_layout", "nhwc", CONV_LAYOUTS, description="layout forward convolutions run in"),
    Knob("filter_fence", "compute_barrier", FILTER_FENCES, description="keep a transposed conv filter out of the conv dispatch"),
    Knob("attention", "fused", ATTENTION, description="sdpa as IREE's attention op or decomposed"),
    Knob("norm_variance", "two_pass", NORM_VARIANCE, description="norm statistics: exact two-pass or fused one-pass"),
    Knob("round_intermediates", True, (True, False), description="round virtual tensors to their declared float type"),
)


@dataclass(frozen=True)
class EmittedModule:
    text: str  # torch-dialect MLIR module text
    func_name: str
    inputs: tuple[str, ...]  # tensor names in argument order == graph.inputs()
    outputs: tuple[str, ...]  # tensor names in result order == graph.outputs()
    input_shapes: tuple[tuple[int, ...], ...]  # physical (memory-order) shapes
    output_shapes: tuple[tuple[int, ...], ...]


NodeLowering = Callable[["Lowering", Node], None]

_LOWER: dict[OpKind, NodeLowering] = {}


def lower_table() -> dict[OpKind, NodeLowering]:
    """OpKind -> its lowering (``LOWER``), the lowering modules imported on the first call."""
    if not _LOWER:
        from fusegraph.engines.iree.lower_attention import lower_sdpa
        from fusegraph.engines.iree.lower_conv import (
            lower_conv_dgrad,
            lower_conv_fprop,
            lower_conv_wgrad,
        )
        from fusegraph.engines.iree.lower_data import (
            lower_concatenate,
            lower_reshape,
            lower_slice,
            lower_transpose,
        )
        from fusegraph.engines.iree.lower_matmul import lower_matmul
        from fusegraph.engines.iree.lower_norm import (
            lower_batchnorm,
            lower_batchnorm_inference,
            lower_layernorm,
            lower_rmsnorm,
        )
        from fusegraph.engines.iree.lower_pointwise import lower_pointwise
        from fusegraph.engines.iree.lower_pool import lower_pooling
        from fusegraph.engines.iree.lower_reduce import lower_reduction, lower_softmax

        _LOWER.update({
            OpKind.CONV_FPROP: lower_conv_fprop,
            OpKind.CONV_DGRAD: lower_conv_dgrad,
            OpKind.CONV_WGRAD: lower_conv_wgrad,
            OpKind.MATMUL: lower_matmul,
            OpKind.POINTWISE: lower_pointwise,
            OpKind.REDUCTION: lower_reduction,
            OpKind.BATCHNORM_INFERENCE: lower_batchnorm_inference,
            OpKind.BATCHNORM: lower_batchnorm,
            OpKind.LAYERNORM: lower_layernorm,
            OpKind.RMSNORM: lower_rmsnorm,
            OpKind.POOLING: lower_pooling,
            OpKind.SDPA: lower_sdpa,
            OpKind.SOFTMAX: lower_softmax,
            OpKind.RESHAPE: lower_reshape,
            OpKind.TRANSPOSE: lower_transpose,
            OpKind.CONCATENATE: lower_concatenate,
            OpKind.SLICE: lower_slice,
        })
    return _LOWER


def __getattr__(name: str) -> Any:
    """``emit.LOWER``: the lowering table, loaded on first use (PEP 562)."""
    if name == "LOWER":
        return lower_table()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def emit_mlir(graph: Graph, func_name: str = "main", options: EmitOptions | None = None) -> EmittedModule:
    """The torch-dialect module of a graph; raises UnsupportedError naming the node."""
    from fusegraph.engines.iree.lower_base import Lowering, Val, vtensor

    graph.ensure_valid()
    table = lower_table()
    ctx = Lowering(graph, options or EmitOptions())
    ins = graph.inputs()
    args: list[str] = []
    in_shapes: list[tuple[int, ...]] = []
    for i, t in enumerate(ins):
        shape = layout.physical_shape(t.shape, t.strides)
        order = layout.physical_order(t.shape, t.strides)
        ctx.bind(t, Val(f"%arg{i}", shape, t.dtype, order))
        args.append(f"%arg{i}: {vtensor(shape, t.dtype)}")
        in_shapes.append(shape)
    for node in graph.topological_order():
        ctx.node = node
        lower = table.get(node.kind)
        if lower is None:
            raise UnsupportedError(f"the IREE emitter has no lowering for {node.kind.value}", node=node.name)
        try:
            lower(ctx, node)
        except FusegraphError:
            raise
        except (ValueError, KeyError, AssertionError) as exc:  # a lowering bug: say where
            raise UnsupportedError(f"cannot lower {node.kind.value}: {exc}", node=node.name) from exc
    ctx.node = None
    results: list[Val] = []
    for t in graph.outputs():
        results.append(ctx.get(t, layout.physical_order(t.shape, t.strides), full=True))
    types = [r.type for r in results]
    body = "\n".join("    " + line for line in ctx.b.lines)
    ret = f"    return {', '.join(r.name for r in results)} : {', '.join(types)}"
    text = (
        "module {\n"
        f"  func.func @{func_name}({', '.join(args)}) -> ({', '.join(types)}) {{\n"
        f"{body}\n{ret}\n"
        "  }\n"
        "}\n"
    )
    return EmittedModule(
        text=text,
        func_name=func_name,
        inputs=tuple(t.name for t in ins),
        outputs=tuple(t.name for t in graph.outputs()),
        input_shapes=tuple(in_shapes),
        output_shapes=tuple(r.shape for r in results),
    )


def unsupported_reason(graph: Graph, options: EmitOptions | None = None) -> str | None:
    """Why the emitter cannot lower this graph, or None when it can."""
    try:
        emit_mlir(graph, options=options)
    except UnsupportedError as exc:
        return str(exc)
    return None
