"""What the engines fuse, as the region splitter sees it: which nodes start a region
(anchors), which may follow one as its epilogue, and the dotted name of the pattern a
finished region matches.

The names follow the fusion families the engines were written for (cuDNN frontend's
conv/matmul epilogues and attention, fusegraph's Triton row kernels for norms, softmax
and pointwise chains). A name says what the region is, not which engine will run it: the
engine is chosen per region by selection and, where measured, by the verdict.
"""

from __future__ import annotations

from collections.abc import Iterable

from fusegraph.graph.node import Node
from fusegraph.graph.ops import (
    DATA_MOVEMENT,
    NORMS,
    POINTWISE_BACKWARD,
    OpKind,
    PointwiseAttrs,
    PointwiseMode,
)

# Anchors: one per region, each with the family its name starts with.
ANCHOR_FAMILY: dict[OpKind, str] = {
    OpKind.CONV_FPROP: "cudnn.conv",
    OpKind.CONV_DGRAD: "cudnn.conv.dgrad",
    OpKind.CONV_WGRAD: "cudnn.conv.wgrad",
    OpKind.MATMUL: "cudnn.matmul",
    OpKind.SDPA: "cudnn.sdpa",
    OpKind.LAYERNORM: "triton.norm.layernorm",
    OpKind.RMSNORM: "triton.norm.rmsnorm",
    OpKind.BATCHNORM: "triton.norm.batchnorm",
    OpKind.BATCHNORM_INFERENCE: "triton.norm.batchnorm_inference",
    OpKind.SOFTMAX: "triton.softmax",
    OpKind.POOLING: "cudnn.pooling",
    OpKind.GATHER: "gather",  # an embedding lookup: a region of its own, no epilogue
    OpKind.GATHER_BACKWARD: "gather.backward",
    OpKind.POOLING_BACKWARD: "pooling.backward",  # resample backward: a region of its own
}
# Backward operations other helpers add to the op table (norm and attention backward):
# anchors under their own family, found by name so this table needs no edit when they land.
_BACKWARD_FAMILIES = {
    "layernorm_backward": "triton.norm.layernorm_backward",
    "rmsnorm_backward": "triton.norm.rmsnorm_backward",
    "batchnorm_backward": "triton.norm.batchnorm_backward",
    "sdpa_backward": "cudnn.sdpa_backward",
}
for _kind in OpKind:
    if _kind.value in _BACKWARD_FAMILIES:
        ANCHOR_FAMILY[_kind] = _BACKWARD_FAMILIES[_kind.value]

CHAIN_FAMILY = "triton.pointwise"  # pointwise and reduction nodes no anchor took
MOVEMENT_ONLY = "movement"  # reshapes / transposes alone: never claimed

# Anchors whose outputs may carry an epilogue (a conv's bias + activation, a GEMM's, a
# norm's activation); backward anchors and attention end their region.
EPILOGUE_ANCHORS = frozenset(
    {OpKind.CONV_FPROP, OpKind.MATMUL, OpKind.LAYERNORM, OpKind.RMSNORM, OpKind.BATCHNORM,
     OpKind.BATCHNORM_INFERENCE, OpKind.CONV_DGRAD}
)

_ACTIVATIONS = frozenset(
    {PointwiseMode.RELU_FWD, PointwiseMode.TANH_FWD, PointwiseMode.SIGMOID_FWD, PointwiseMode.GELU_FWD,
     PointwiseMode.GELU_APPROX_TANH_FWD, PointwiseMode.ELU_FWD, PointwiseMode.SWISH_FWD,
     PointwiseMode.SOFTPLUS_FWD}
)


def is_anchor(node: Node) -> bool:
    return node.kind in ANCHOR_FAMILY


def is_movement(node: Node) -> bool:
    return node.kind in DATA_MOVEMENT


def joins_epilogue(node: Node) -> bool:
    """Pointwise nodes and the reshapes/transposes between them may follow an anchor."""
    return node.kind == OpKind.POINTWISE or node.kind in (OpKind.RESHAPE, OpKind.TRANSPOSE)


def joins_chain(node: Node) -> bool:
    return node.kind in (OpKind.POINTWISE, OpKind.REDUCTION) or node.kind in DATA_MOVEMENT


def pattern_name(nodes: Iterable[Node]) -> str:
    """The dotted name of a region: its anchor's family and what its epilogue does
    (``.bias`` for an add, ``.act`` for an activation, ``.bias_act`` for both, ``.dact``
    for an activation backward before a backward anchor)."""
    nodes = list(nodes)
    anchors = [n for n in nodes if is_anchor(n)]
    modes = [n.attrs.mode for n in nodes if isinstance(n.attrs, PointwiseAttrs)]
    if not anchors:
        if all(is_movement(n) for n in nodes):
            return MOVEMENT_ONLY
        if any(n.kind == OpKind.REDUCTION for n in nodes):
            return "triton.reduction"
        return CHAIN_FAMILY
    family = ANCHOR_FAMILY[anchors[0].kind]
    if {OpKind.CONV_DGRAD, OpKind.CONV_WGRAD} <= {a.kind for a in anchors}:
        family = "cudnn.conv.backward"  # dgrad, wgrad (and the bias gradient) of one dy
    if anchors[0].kind in NORMS or anchors[0].kind in (OpKind.SOFTMAX, OpKind.SDPA, OpKind.POOLING):
        return family + (".act" if any(m in _ACTIVATIONS for m in modes) else "")
    parts = []
    if any(m in POINTWISE_BACKWARD for m in modes):
        parts.append("dact")
    if any(m == PointwiseMode.ADD for m in modes):
        parts.append("bias")
    if any(m in _ACTIVATIONS for m in modes):
        parts.append("act")
    return family + ("." + "_".join(parts) if parts else "")
