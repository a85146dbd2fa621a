"""What every torch lowering shares: the plan's context (device, knobs, compute types) and
the small helpers for operands, memory formats and padding."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from fusegraph.dtypes import DataType
from fusegraph.engines.base import EngineConfig
from fusegraph.engines.torch import steps as torch_fusion
from fusegraph.engines.torch.convert import _FP8, _LOW, Tensor, _torch, torch_dtype
from fusegraph.graph.graph import Graph
from fusegraph.graph.node import Node
from fusegraph.graph.ops import CONVOLUTIONS, ConvAttrs, OpKind, PointwiseAttrs, PointwiseMode
from fusegraph.runtime.handle import Handle

log = logging.getLogger("fusegraph.engines.torch")

# Ops whose narrow-float kernels accumulate in f32 on NVIDIA (cuDNN / cuBLAS / flash attention).
_TENSOR_CORE_OPS = CONVOLUTIONS | {OpKind.MATMUL, OpKind.SDPA}


def _compute_type(node: Node, graph: Graph, default: DataType) -> DataType:
    cd = getattr(node.attrs, "compute_data_type", None) or graph.compute_data_type
    if cd is not None:
        return cd
    if default in _LOW or default in _FP8:
        return DataType.FLOAT
    return default


def _main_input_type(node: Node) -> DataType:
    for t in node.inputs.values():
        if not t.is_scalar:
            return t.dtype
    return next(iter(node.inputs.values())).dtype


M = PointwiseMode
# Pointwise modes whose torch lowering is one CUDA kernel that, on f16/bf16 operands,
# computes in f32 and rounds once (PyTorch's opmath): run natively, the result has the
# bits of casting to f32, computing and rounding back -- without materializing the f32
# copies (three kernels and 3x the memory traffic for a relu). Modes lowered as several
# kernels (tanh/sigmoid backward, clipped relu, swish with beta != 1) round in between, so
# they stay in f32.
_SINGLE_KERNEL = frozenset({
    M.ADD, M.SUB, M.MUL, M.DIV, M.MAX, M.MIN, M.POW, M.ABS, M.NEG, M.EXP, M.LOG, M.SQRT,
    M.RSQRT, M.RECIPROCAL, M.SIN, M.COS, M.ERF, M.FLOOR, M.CEIL, M.IDENTITY, M.TANH_FWD,
    M.SIGMOID_FWD, M.GELU_FWD, M.GELU_APPROX_TANH_FWD, M.ELU_FWD, M.SOFTPLUS_FWD,
    M.CMP_EQ, M.CMP_NEQ, M.CMP_GT, M.CMP_GE, M.CMP_LT, M.CMP_LE,
})


def _native_pointwise(node: Node, graph: Graph) -> bool:
    """Whether a pointwise node on a GPU may run on its f16/bf16 operands as they are: one
    low type for every float operand and the result, f32 compute, a single-kernel mode."""
    attrs = node.attrs
    if node.kind != OpKind.POINTWISE or not isinstance(attrs, PointwiseAttrs):
        return False
    mode = attrs.mode
    if mode == M.RELU_FWD:
        plain = attrs.param("relu_lower_clip") == 0.0 and attrs.param("relu_lower_clip_slope") == 0.0
        if not (plain and attrs.param("relu_upper_clip") == float("inf")):
            return False
    elif mode == M.SWISH_FWD:
        if attrs.param("swish_beta") != 1.0:
            return False
    elif mode not in _SINGLE_KERNEL:
        return False
    types = {t.dtype for t in node.inputs.values() if not t.is_scalar and t.dtype.is_float}
    types |= {t.dtype for t in node.outputs.values() if t.dtype.is_float}  # comparisons: bool
    if len(types) != 1 or not types <= _LOW:
        return False
    return _compute_type(node, graph, _main_input_type(node)) in (DataType.FLOAT, *types)


class _Ctx:
    """What the lowerings need to know about the plan: device, knobs, types."""

    def __init__(self, graph: Graph, handle: Handle, config: EngineConfig) -> None:
        self.graph = graph
        self.gpu = handle.device.is_gpu
        self.memory_format: str = config.get("memory_format", "auto")
        self.compiled = bool(config.get("compile", False))
        # depthwise convolutions on PyTorch's own kernel (knob ``cudnn_depthwise``; eager only)
        self.native_depthwise = self.gpu and not self.compiled and not config.get("cudnn_depthwise", True)
        # lower without in-place writes, for tracing: oneDNN Graph's, and Inductor's, whose
        # functionalization of a copy into a view re-views the copy's layout -- which failed
        # ("Cannot view a tensor ... as ...") for a reshape of a transposed tensor
        self.functional = self.compiled
        self.onednn = (
            not self.gpu
            and not config.get("compile", False)
            and bool(config.get("onednn", True))
            and torch_fusion.available()
        )
        # each node's compute type, on every operand's path (cast_in) at every call: settled here
        self._compute = {id(n): _compute_type(n, graph, _main_input_type(n)) for n in graph.nodes}
        self.native = frozenset(
            id(n) for n in graph.nodes if self.gpu and not self.compiled and _native_pointwise(n, graph)
        )
        # fp32_matmul=bf16x3 (split_products.py): float32 x float32 matmuls as one bf16 GEMM of
        # the split operands; ``split_batched``: torch.bmm(out_dtype=float32) runs here too
        # (probed now: never while a plan is traced or captured)
        self.split_fp32 = self.gpu and config.get("fp32_matmul", "ieee") == "bf16x3"
        self.split_batched = False
        if self.split_fp32:
            from fusegraph.engines.torch import split_products
            from fusegraph.engines.torch.convert import _torch_device

            device = _torch_device(handle)
            self.split_batched = split_products.kernel_available(str(device), "bmm")
            if not self.split_batched:
                for n in graph.nodes:
                    if n.kind == OpKind.MATMUL and split_products.batched(n.inputs["a"].shape, n.inputs["b"].shape):
                        log.info(split_products.describe_fallback(n.name, device))

    def compute(self, node: Node) -> DataType:
        cd = self._compute.get(id(node))
        return cd if cd is not None else _compute_type(node, self.graph, _main_input_type(node))

    def cast_in(self, node: Node, value: Tensor) -> Tensor:
        """An operand in the node's compute type (float operands only), unless the node runs
        natively on its narrow operands (_native_pointwise)."""
        if id(node) in self.native:
            return value
        cd = self.compute(node)
        if value.dtype.is_floating_point and cd.is_float:
            target = torch_dtype(cd)
            if value.dtype != target:
                return value.to(target)
        return value

    def narrow_native(self, node: Node) -> bool:
        """f16/bf16 operands of a tensor-core op on a GPU: run the native kernel (f32 accumulate)."""
        if not self.gpu or node.kind not in _TENSOR_CORE_OPS:
            return False
        types = {t.dtype for p, t in node.inputs.items() if p != "mask"}
        return len(types) == 1 and types <= _LOW and self.compute(node) in (DataType.FLOAT, *types)


Lowering = Callable[[_Ctx, Node, dict[str, Tensor]], dict[str, Tensor]]


def _F() -> Any:
    import torch.nn.functional as F

    return F


def _memory_format(ctx: _Ctx, x: Tensor) -> Tensor:
    torch = _torch()
    if ctx.memory_format == "auto" or x.dim() not in (4, 5):
        return x
    if ctx.memory_format == "contiguous":
        return x.contiguous()
    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    return x.contiguous(memory_format=fmt)


def _pad_list(pre: Sequence[int], post: Sequence[int]) -> list[int]:
    """F.pad's order: last spatial axis first, (before, after) pairs."""
    out: list[int] = []
    for a, b in zip(reversed(pre), reversed(post), strict=True):
        out += [a, b]
    return out


def _conv_padding(x: Tensor, attrs: ConvAttrs) -> tuple[Tensor, list[int]]:
    """Symmetric padding goes to the conv call; asymmetric padding is applied with F.pad."""
    if attrs.pre_padding == attrs.post_padding:
        return x, list(attrs.pre_padding)
    return _F().pad(x, _pad_list(attrs.pre_padding, attrs.post_padding)), [0] * len(attrs.pre_padding)


def _operands(ctx: _Ctx, node: Node, ins: dict[str, Tensor], ports: Sequence[str]) -> list[Tensor]:
    if ctx.narrow_native(node):
        return [ins[p] for p in ports]
    return [ctx.cast_in(node, ins[p]) for p in ports]

