"""The vendor-library engine: runs a graph on PyTorch (cuDNN / cuBLAS on NVIDIA, oneDNN /
MKL on CPU), eagerly op by op or through ``torch.compile``.

Why it exists: on NVIDIA, vendor libraries beat generated code by 6-9x on compute-bound
ops (DESIGN.md), so a plan built from them is what makes the engine *selection* faster
than any single compiler. torch is optional (``fusegraph[torch]``): without it this module
still imports and the engine says it is unavailable, and why.

Numerics: each node computes in its compute type (the node's, else the graph's, else f32
for narrower floats), its result is rounded to the node's output type. On a GPU,
f16/bf16 convolutions, matmuls and attention run on the native low-precision kernels,
which accumulate in f32 (fp16 reduced-precision reductions and TF32 are switched off
while a plan runs); on the CPU they are computed in f32.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import json
import logging
import math
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fusegraph.dtypes import DataType
from fusegraph.engines import torch_fusion, torch_onednn_graph
from fusegraph.engines.base import EngineConfig, ExecutionPlan, Knob, Support
from fusegraph.errors import CompileError, ExecutionError, VariantPackError
from fusegraph.graph import layout
from fusegraph.graph.graph import Graph
from fusegraph.graph.infer import conv_groups
from fusegraph.graph.node import Node
from fusegraph.graph.ops import (
    CONVOLUTIONS,
    ConcatAttrs,
    ConvAttrs,
    OpKind,
    PointwiseAttrs,
    PointwiseMode,
    PoolingAttrs,
    PoolingMode,
    ReductionAttrs,
    ReductionMode,
    SdpaAttrs,
    SliceAttrs,
    SoftmaxAttrs,
    TransposeAttrs,
)
from fusegraph.graph.tensor import TensorAttr
from fusegraph.runtime.handle import Handle
from fusegraph.runtime.variant_pack import ResolvedPack, check_array, resolve_pack

log = logging.getLogger("fusegraph.engines.torch")

Tensor = Any  # torch.Tensor, kept untyped so that this module imports without torch
M = PointwiseMode

_LOW = {DataType.HALF, DataType.BFLOAT16}
_FP8 = {DataType.FP8_E4M3, DataType.FP8_E5M2}
# Ops whose narrow-float kernels accumulate in f32 on NVIDIA (cuDNN / cuBLAS / flash attention).
_TENSOR_CORE_OPS = CONVOLUTIONS | {OpKind.MATMUL, OpKind.SDPA}


def _torch() -> Any:
    import torch

    return torch


@functools.cache
def torch_build_info() -> dict[str, str | None]:
    """``__version__``, ``cuda`` and ``hip`` of torch/version.py, read as text: importing
    torch costs 1-2 s, and a build on another engine must not pay it (issue 10)."""
    out: dict[str, str | None] = {"__version__": None, "cuda": None, "hip": None}
    try:
        spec = importlib.util.find_spec("torch")
        where = spec.submodule_search_locations if spec is not None else None
        if not where:
            return out
        tree = ast.parse((Path(next(iter(where))) / "version.py").read_text(encoding="utf-8"))
    except (ImportError, ValueError, OSError, SyntaxError):
        return out
    for stmt in tree.body:
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target if isinstance(stmt, ast.AnnAssign) else None
        value = stmt.value if isinstance(stmt, ast.Assign | ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id in out and value is not None:
            with contextlib.suppress(ValueError):
                v = ast.literal_eval(value)
                out[target.id] = str(v) if v is not None else None
    return out


def torch_installed() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["torch"] = None
        return False


_DTYPES: dict[DataType, Any] = {}  # filled on first use (torch imports lazily)


def torch_dtype(dt: DataType) -> Any:
    if not _DTYPES:
        _DTYPES.update(_dtype_table())
    return _DTYPES[dt]


def _dtype_table() -> dict[DataType, Any]:
    torch = _torch()
    table = {
        DataType.HALF: torch.float16,
        DataType.BFLOAT16: torch.bfloat16,
        DataType.FLOAT: torch.float32,
        DataType.DOUBLE: torch.float64,
        DataType.INT8: torch.int8,
        DataType.UINT8: torch.uint8,
        DataType.INT16: torch.int16,
        DataType.INT32: torch.int32,
        DataType.INT64: torch.int64,
        DataType.BOOLEAN: torch.bool,
        DataType.FP8_E4M3: torch.float8_e4m3fn,
        DataType.FP8_E5M2: torch.float8_e5m2,
    }
    return table


# numpy has no bf16/fp8 of its own (ml_dtypes has): they cross as same-size unsigned ints.
_VIEW_AS = {DataType.BFLOAT16: np.uint16, DataType.FP8_E4M3: np.uint8, DataType.FP8_E5M2: np.uint8}


def from_numpy(arr: np.ndarray, dt: DataType) -> Tensor:
    """A torch view of a numpy array (no copy), strides kept."""
    torch = _torch()
    base = arr.view(_VIEW_AS[dt]) if dt in _VIEW_AS else arr
    if not base.flags.writeable:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(base)
    else:
        t = torch.from_numpy(base)
    return t.view(torch_dtype(dt)) if dt in _VIEW_AS else t


def to_numpy_into(src: Tensor, dst: np.ndarray, dt: DataType) -> None:
    """Copies a torch tensor (any device) into a numpy array of the tensor's logical shape."""
    from_numpy(dst, dt).copy_(src)


# ---- fusegraph Buffers (IREE device memory) through DLPack, without copies -----------------------
_DLPACK_DEVICE = {"cpu": 1, "cuda": 2, "hip": 10}


_NO_FLAGS = contextlib.nullcontext()


def _host_result(value: Tensor, t: TensorAttr, taken: list[int] | None) -> np.ndarray:
    """A result as a NumPy array laid out as ``t`` declares: lent as a view when the caller
    may take it (``taken`` not None: a tensor allocated afresh by this call), is a CPU
    tensor in that layout of a NumPy type, and no other result of the call was lent over
    its memory (``taken`` collects those); else copied."""
    if (
        taken is not None
        and value.device.type == "cpu"
        and t.dtype not in _VIEW_AS
        and layout.same_strides(t.shape, value.stride(), t.strides)
        and value.untyped_storage().data_ptr() not in taken
    ):
        taken.append(value.untyped_storage().data_ptr())
        lent: np.ndarray = value.numpy()
        return lent
    arr = layout.empty_strided(t.shape, t.strides, t.dtype.numpy)
    to_numpy_into(value, arr, t.dtype)
    return arr


def _is_buffer(value: Any) -> bool:
    cls = type(value)
    return cls.__name__ == "Buffer" and cls.__module__ == "fusegraph.runtime.buffer"


def buffer_to_torch(buf: Any, t: TensorAttr) -> Tensor:
    """A torch view (logical dims, declared strides) of a Buffer's device memory."""
    torch = _torch()
    from fusegraph.engines.iree.runtime import runtime_for

    dev = buf.handle.device
    capsule = runtime_for(buf.handle).hal_device.create_dlpack_capsule(buf.view, _DLPACK_DEVICE[dev.kind], dev.index)
    phys = torch.from_dlpack(capsule)  # dense, in memory order
    order = layout.physical_order(buf.shape, buf.strides)
    logical = phys.permute(tuple(order.index(a) for a in range(len(order))))
    return logical.expand(t.shape) if tuple(logical.shape) != t.shape else logical


def torch_to_buffer(value: Tensor, t: TensorAttr, handle: Handle) -> Any:
    """A Buffer aliasing a (dense, memory-order) copy of a result tensor on its device."""
    from fusegraph.engines.iree.runtime import runtime_for
    from fusegraph.runtime.buffer import Buffer

    order = layout.physical_order(t.shape, t.strides)
    dense = value.permute(order).contiguous()
    rt = runtime_for(handle)
    view = rt.import_dlpack(dense)
    return Buffer(view, handle, rt, tuple(t.shape), tuple(t.strides), t.dtype, alias=True, keep=dense)


# ---- the engine ------------------------------------------------------------------------------
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


def _torch_device(handle: Handle) -> Any:
    torch = _torch()
    if handle.device.kind == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", handle.device.index)  # ROCm builds of torch call HIP "cuda"


ONEDNN_GRAPH_DEFAULT = True  # see docs/engines.md for the measurements behind it


class TorchEngine:
    """Runs graphs on PyTorch; see the module docstring for its numerics."""

    name = "torch"

    def __init__(self) -> None:
        self._compile_ok: Support | None = None

    @property
    def version(self) -> str:
        if not torch_installed():
            return "-"
        info = torch_build_info()
        return info["__version__"] or str(_torch().__version__)

    def library_versions(self) -> dict[str, str]:
        """What the plans' speed depends on besides torch itself (for the tuning DB)."""
        if not torch_installed():
            return {}
        info = torch_build_info()
        if info["__version__"] and not info["cuda"] and not info["hip"]:
            return {"torch": info["__version__"]}  # a CPU build: no cuDNN, CUDA or HIP to ask
        torch = _torch()
        out = {"torch": str(torch.__version__)}
        with contextlib.suppress(Exception):
            if torch.backends.cudnn.is_available():
                out["cudnn"] = str(torch.backends.cudnn.version())
        if torch.version.cuda:
            out["cuda"] = str(torch.version.cuda)
        if torch.version.hip:
            out["hip"] = str(torch.version.hip)
        return out

    def available(self) -> Support:
        """Cheap on purpose (the registry asks every engine): torch is found, not imported;
        a torch that fails to import is reported by supports() and build()."""
        if not torch_installed():
            return Support.no("PyTorch is not installed (pip install 'fusegraph[torch]')")
        return Support.yes()

    def _device_support(self, handle: Handle) -> Support:
        torch = _torch()
        kind = handle.device.kind
        if kind == "cpu":
            return Support.yes()
        if kind == "cuda" and torch.version.hip:
            return Support.no("this PyTorch is a ROCm build; it drives AMD GPUs (use a 'hip' handle)")
        if kind == "hip" and not torch.version.hip:
            return Support.no("this PyTorch is not a ROCm build; it cannot drive AMD GPUs")
        if not torch.cuda.is_available():
            build = "a CPU-only build" if not (torch.version.cuda or torch.version.hip) else "no GPU visible"
            return Support.no(f"PyTorch {torch.__version__} sees no GPU ({build})")
        if handle.device.index >= torch.cuda.device_count():
            return Support.no(f"GPU {handle.device.index} does not exist ({torch.cuda.device_count()} visible)")
        return Support.yes()

    def supports(self, graph: Graph, handle: Handle) -> Support:
        avail = self.available()
        if not avail:
            return avail
        try:
            _torch()
        except Exception as exc:
            return Support.no(f"PyTorch fails to import: {exc}")
        dev = self._device_support(handle)
        if not dev:
            return dev
        graph.ensure_valid()
        for node in graph.nodes:
            why = _node_unsupported(node, graph, handle)
            if why:
                return Support.no(f"node '{node.name}' ({node.kind.value}): {why}")
        return Support.yes()

    def compile_support(self, handle: Handle) -> Support:
        """Whether torch.compile (Inductor) can work here: Triton on GPUs, a C++ compiler on CPU."""
        if self._compile_ok is None:
            import shutil

            if not torch_installed():
                self._compile_ok = Support.no("PyTorch is not installed")
            elif handle.device.is_gpu and importlib.util.find_spec("triton") is None:
                self._compile_ok = Support.no("Triton is not installed (Inductor needs it on GPUs)")
            elif not handle.device.is_gpu and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
                self._compile_ok = Support.no("no C++ compiler on PATH (Inductor needs one on CPU)")
            else:
                self._compile_ok = Support.yes()
        return self._compile_ok

    def knobs(self, graph: Graph, handle: Handle) -> Sequence[Knob]:
        kinds = {n.kind for n in graph.nodes}
        out: list[Knob] = []
        if self.compile_support(handle):
            out.append(
                Knob(
                    "compile",
                    False,
                    (False, True),
                    description="torch.compile the whole graph (Inductor fuses pointwise/reduction "
                    "chains; first build costs seconds)",
                )
            )
        if handle.device.is_gpu and kinds & CONVOLUTIONS:
            out.append(
                Knob(
                    "cudnn_benchmark",
                    True,
                    (True, False),
                    description="let cuDNN time its algorithms on first use of each shape",
                )
            )
        if handle.device.is_gpu:
            out.append(
                Knob(
                    "cuda_graph",
                    True,
                    (True, False),
                    description="capture the whole eager plan once as a CUDA graph and replay it "
                    "(one launch instead of one per op; inputs copied into static buffers; eager only)",
                )
            )
        if not handle.device.is_gpu:
            out.append(
                Knob(
                    "threads",
                    0,
                    (0, 1),
                    description="intra-op CPU threads while the plan runs (0: torch's default, all "
                    "cores); 1 avoids OpenMP barrier stalls on a busy or shared machine",
                )
            )
        if not handle.device.is_gpu and torch_fusion.has_onednn_steps(graph) and torch_fusion.available():
            out.append(
                Knob(
                    "onednn",
                    True,
                    (True, False),
                    description="run each f32 2-D convolution (with its bias / activation / residual "
                    "add) and each f32 2-D matmul (with bias / activation) as one oneDNN call, conv "
                    "filters bound as constants pre-reordered (eager only)",
                )
            )
        if not handle.device.is_gpu and torch_fusion.plan_fusions(graph) and torch_onednn_graph.available():
            out.append(
                Knob(
                    "onednn_graph",
                    ONEDNN_GRAPH_DEFAULT,
                    (True, False),
                    description="once weights are bound (bind_constants), trace the plan into TorchScript "
                    "with them frozen in and let oneDNN Graph fuse and compile it (probed in a child process, "
                    "checked against the eager plan on the first call; eager on any failure)",
                )
            )
        has_4d_conv = any(n.kind in CONVOLUTIONS and len(_conv_image(n).shape) in (4, 5) for n in graph.nodes)
        if has_4d_conv:
            out.append(
                Knob(
                    "memory_format",
                    "auto",
                    ("auto", "channels_last", "contiguous"),
                    description="convolution memory format: follow the tensors' strides (auto) or "
                    "convert to channels-last / NCHW-contiguous before the call",
                )
            )
        return out

    def build(self, graph: Graph, handle: Handle, config: EngineConfig | None = None) -> ExecutionPlan:
        graph.ensure_valid()
        config = config or EngineConfig(self.name)
        known = {k.name: k for k in self.knobs(graph, handle)}
        for name, value in config.knobs:
            if name not in known:
                raise ValueError(f"torch engine: no knob '{name}' for this graph/handle (knobs: {sorted(known)})")
            known[name].check(value)
        sup = self.supports(graph, handle)
        if not sup:
            from fusegraph.errors import UnsupportedError

            raise UnsupportedError(f"torch engine cannot run graph '{graph.name}': {sup.reason}")
        return TorchPlan(graph, handle, config)

    def load_plan(self, data: bytes, handle: Handle) -> ExecutionPlan:
        """Rebuilds a plan from ``TorchPlan.serialize()`` (graph JSON + knobs)."""
        d = json.loads(data.decode())
        g = Graph.from_json(d["graph"]).validate()
        cfg = EngineConfig(self.name, tuple((k, v) for k, v in d["knobs"]))
        return self.build(g, handle, cfg)


def _conv_image(node: Node) -> TensorAttr:
    return node.outputs["dx"] if node.kind == OpKind.CONV_DGRAD else node.inputs.get("x") or node.inputs["dy"]


def _node_unsupported(node: Node, graph: Graph, handle: Handle) -> str:
    """Why torch cannot run this node ('' when it can)."""
    kind = node.kind
    types = [t.dtype for t in (*node.inputs.values(), *node.outputs.values())]
    gpu = handle.device.is_gpu
    if any(dt in _FP8 for dt in types) and kind in (OpKind.POOLING, OpKind.CONCATENATE):
        return "torch has no fp8 kernels for this op (fp8 is only cast to wider types)"
    if kind in CONVOLUTIONS:
        x = _conv_image(node)
        if not x.dtype.is_float:
            return f"torch has no {x.dtype.name} convolution"
        if not 3 <= len(x.shape) <= 5:
            return f"torch convolves 1-3 spatial dims, got rank {len(x.shape)}"
    if kind == OpKind.MATMUL and gpu and node.inputs["a"].dtype.is_integer:
        return "cuBLAS has no integer matmul through torch"
    if kind == OpKind.POOLING:
        x = node.inputs["x"]
        attrs = node.attrs
        assert isinstance(attrs, PoolingAttrs)
        if not x.dtype.is_float and attrs.mode != PoolingMode.MAX:
            return f"torch has no {x.dtype.name} average pooling"
        if not x.dtype.is_float and any(attrs.pre_padding) + any(attrs.post_padding):
            return "padded max pooling of integers needs -inf padding, which integers lack"
    if kind == OpKind.REDUCTION and gpu and node.inputs["x"].dtype.is_integer:
        assert isinstance(node.attrs, ReductionAttrs)
        if node.attrs.mode == ReductionMode.MUL:
            return "integer product reduction is not implemented on CUDA in torch"
    cd = getattr(node.attrs, "compute_data_type", None) or graph.compute_data_type
    if cd is not None and cd in _FP8:
        return f"compute type {cd.name}: torch computes nothing in fp8"
    if cd is not None and cd.is_integer and kind not in (OpKind.POINTWISE, OpKind.REDUCTION, OpKind.MATMUL):
        return f"compute type {cd.name} is not available for {kind.value} in torch"
    return ""


# ---- lowering: one function per op kind -----------------------------------------------------
class _Ctx:
    """What the lowerings need to know about the plan: device, knobs, types."""

    def __init__(self, graph: Graph, handle: Handle, config: EngineConfig) -> None:
        self.graph = graph
        self.gpu = handle.device.is_gpu
        self.memory_format: str = config.get("memory_format", "auto")
        self.compiled = bool(config.get("compile", False))
        self.functional = False  # lower without in-place writes (for tracing)
        self.onednn = (
            not self.gpu
            and not config.get("compile", False)
            and bool(config.get("onednn", True))
            and torch_fusion.available()
        )

    def compute(self, node: Node) -> DataType:
        return _compute_type(node, self.graph, _main_input_type(node))

    def cast_in(self, node: Node, value: Tensor) -> Tensor:
        """An operand in the node's compute type (float operands only)."""
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


def _lower_conv_fprop(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    attrs = node.attrs
    assert isinstance(attrs, ConvAttrs)
    x, w = _operands(ctx, node, ins, ("x", "w"))
    x, w = _memory_format(ctx, x), _memory_format(ctx, w)
    x, pad = _conv_padding(x, attrs)
    conv = getattr(_F(), f"conv{x.dim() - 2}d")
    y = conv(x, w, None, list(attrs.stride), pad, list(attrs.dilation), conv_groups(node))
    return {"y": y}


def _lower_conv_dgrad(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    torch = _torch()
    attrs = node.attrs
    assert isinstance(attrs, ConvAttrs)
    dy, w = _operands(ctx, node, ins, ("dy", "w"))
    dy, w = _memory_format(ctx, dy), _memory_format(ctx, w)
    dx_shape = node.outputs["dx"].shape
    nsp = len(dx_shape) - 2
    grad_input = getattr(torch.nn.grad, f"conv{nsp}d_input")
    groups = conv_groups(node)
    if attrs.pre_padding == attrs.post_padding:
        dx = grad_input(dx_shape, w, dy, list(attrs.stride), list(attrs.pre_padding), list(attrs.dilation), groups)
        return {"dx": dx}
    padded = (*dx_shape[:2], *(d + a + b for d, a, b in zip(dx_shape[2:], attrs.pre_padding, attrs.post_padding, strict=True)))
    dxp = grad_input(padded, w, dy, list(attrs.stride), [0] * nsp, list(attrs.dilation), groups)
    crop = tuple(slice(p, p + d) for p, d in zip(attrs.pre_padding, dx_shape[2:], strict=True))
    return {"dx": dxp[(slice(None), slice(None), *crop)]}


def _lower_conv_wgrad(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    torch = _torch()
    attrs = node.attrs
    assert isinstance(attrs, ConvAttrs)
    x, dy = _operands(ctx, node, ins, ("x", "dy"))
    x, dy = _memory_format(ctx, x), _memory_format(ctx, dy)
    dw_shape = node.outputs["dw"].shape
    grad_weight = getattr(torch.nn.grad, f"conv{len(dw_shape) - 2}d_weight")
    x, pad = _conv_padding(x, attrs)
    dw = grad_weight(x, dw_shape, dy, list(attrs.stride), pad, list(attrs.dilation), conv_groups(node))
    return {"dw": dw}


def _lower_matmul(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    a, b = _operands(ctx, node, ins, ("a", "b"))
    return {"c": _torch().matmul(a, b)}


def _relu(x: Tensor, p: PointwiseAttrs) -> Tensor:
    torch = _torch()
    lower, upper = p.param("relu_lower_clip"), p.param("relu_upper_clip")
    slope = p.param("relu_lower_clip_slope")
    if lower == 0.0 and slope == 0.0 and math.isinf(upper):
        return torch.relu(x)
    below = lower + slope * (x - lower)
    return torch.where(x <= lower, below, x if math.isinf(upper) else torch.clamp(x, max=upper))


def _pointwise_table() -> dict[PointwiseMode, Callable[[Tensor, Tensor, Tensor, PointwiseAttrs], Tensor]]:
    torch = _torch()
    F = _F()
    return {
        M.ADD: lambda a, b, c, p: a + b,
        M.SUB: lambda a, b, c, p: a - b,
        M.MUL: lambda a, b, c, p: a * b,
        M.DIV: lambda a, b, c, p: torch.div(a, b, rounding_mode="trunc")
        if not a.dtype.is_floating_point and not b.dtype.is_floating_point
        else a / b,
        M.MAX: lambda a, b, c, p: torch.maximum(a, b),
        M.MIN: lambda a, b, c, p: torch.minimum(a, b),
        M.POW: lambda a, b, c, p: torch.pow(a, b),
        M.ABS: lambda a, b, c, p: torch.abs(a),
        M.NEG: lambda a, b, c, p: torch.neg(a),
        M.EXP: lambda a, b, c, p: torch.exp(a),
        M.LOG: lambda a, b, c, p: torch.log(a),
        M.SQRT: lambda a, b, c, p: torch.sqrt(a),
        M.RSQRT: lambda a, b, c, p: torch.rsqrt(a),
        M.RECIPROCAL: lambda a, b, c, p: torch.reciprocal(a),
        M.SIN: lambda a, b, c, p: torch.sin(a),
        M.COS: lambda a, b, c, p: torch.cos(a),
        M.ERF: lambda a, b, c, p: torch.erf(a),
        M.FLOOR: lambda a, b, c, p: torch.floor(a),
        M.CEIL: lambda a, b, c, p: torch.ceil(a),
        M.IDENTITY: lambda a, b, c, p: a,
        M.RELU_FWD: lambda a, b, c, p: _relu(a, p),
        M.TANH_FWD: lambda a, b, c, p: torch.tanh(a),
        M.SIGMOID_FWD: lambda a, b, c, p: torch.sigmoid(a),
        M.GELU_FWD: lambda a, b, c, p: F.gelu(a),
        M.GELU_APPROX_TANH_FWD: lambda a, b, c, p: F.gelu(a, approximate="tanh"),
        M.ELU_FWD: lambda a, b, c, p: F.elu(a, alpha=p.param("elu_alpha")),
        M.SWISH_FWD: lambda a, b, c, p: F.silu(a)
        if p.param("swish_beta") == 1.0
        else a * torch.sigmoid(p.param("swish_beta") * a),
        M.SOFTPLUS_FWD: lambda a, b, c, p: F.softplus(a, beta=p.param("softplus_beta"), threshold=1e30),
        M.CMP_EQ: lambda a, b, c, p: a == b,
        M.CMP_NEQ: lambda a, b, c, p: a != b,
        M.CMP_GT: lambda a, b, c, p: a > b,
        M.CMP_GE: lambda a, b, c, p: a >= b,
        M.CMP_LT: lambda a, b, c, p: a < b,
        M.CMP_LE: lambda a, b, c, p: a <= b,
        M.LOGICAL_AND: lambda a, b, c, p: torch.logical_and(a, b),
        M.LOGICAL_OR: lambda a, b, c, p: torch.logical_or(a, b),
        M.LOGICAL_NOT: lambda a, b, c, p: torch.logical_not(a),
        M.BINARY_SELECT: lambda a, b, c, p: torch.where(c, a, b),
        M.RELU_BWD: lambda dy, x, c, p: dy * (x > p.param("relu_lower_clip")).to(dy.dtype),
        M.GELU_BWD: lambda dy, x, c, p: torch.ops.aten.gelu_backward(*torch.broadcast_tensors(dy, x)),
        M.TANH_BWD: lambda dy, x, c, p: dy * (1.0 - torch.tanh(x) ** 2),
        M.SIGMOID_BWD: lambda dy, x, c, p: dy * torch.sigmoid(x) * (1.0 - torch.sigmoid(x)),
    }


_PW_CACHE: dict[str, Any] = {}


def _pw_fns() -> dict[PointwiseMode, Callable[[Tensor, Tensor, Tensor, PointwiseAttrs], Tensor]]:
    if "table" not in _PW_CACHE:
        _PW_CACHE["table"] = _pointwise_table()
    return _PW_CACHE["table"]  # type: ignore[no-any-return]


def _lower_pointwise(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    attrs = node.attrs
    assert isinstance(attrs, PointwiseAttrs)
    a = ins["a"]
    b, c = ins.get("b"), ins.get("c")
    a = ctx.cast_in(node, a)
    if b is not None:
        b = ctx.cast_in(node, b)
    if attrs.mode == M.BINARY_SELECT and b is not None:
        # Both branches in one type (a boolean select of mixed types would promote).
        common = _torch().promote_types(a.dtype, b.dtype)
        a, b = a.to(common), b.to(common)
    return {"y": _pw_fns()[attrs.mode](a, b, c, attrs)}


def _lower_reduction(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    torch = _torch()
    attrs = node.attrs
    assert isinstance(attrs, ReductionAttrs)
    x = ctx.cast_in(node, ins["x"])
    out_shape = node.outputs["y"].shape
    axes = [i for i, (a, b) in enumerate(zip(node.inputs["x"].shape, out_shape, strict=True)) if a != b]
    if not axes:
        y = torch.abs(x) if attrs.mode in (ReductionMode.AMAX, ReductionMode.NORM1, ReductionMode.NORM2) else x
        return {"y": y}
    mode = attrs.mode
    if not x.dtype.is_floating_point and mode in (ReductionMode.AVG, ReductionMode.NORM2):
        x = x.to(torch.float64)  # the reference averages exactly, then truncates
    if mode == ReductionMode.SUM:
        y = torch.sum(x, dim=axes, keepdim=True)
    elif mode == ReductionMode.MIN:
        y = torch.amin(x, dim=axes, keepdim=True)
    elif mode == ReductionMode.MAX:
        y = torch.amax(x, dim=axes, keepdim=True)
    elif mode == ReductionMode.AMAX:
        y = torch.amax(torch.abs(x), dim=axes, keepdim=True)
    elif mode == ReductionMode.AVG:
        y = torch.mean(x, dim=axes, keepdim=True)
    elif mode == ReductionMode.MUL:
        y = x
        for ax in sorted(axes, reverse=True):
            y = torch.prod(y, dim=ax, keepdim=True)
    elif mode == ReductionMode.NORM1:
        y = torch.sum(torch.abs(x), dim=axes, keepdim=True)
    else:
        y = torch.sqrt(torch.sum(x * x, dim=axes, keepdim=True))
    if not node.outputs["y"].dtype.is_float and y.dtype.is_floating_point:
        y = torch.trunc(y)
    return {"y": y}


def _channel_vec(t: Tensor) -> Tensor:
    return t.reshape(-1)


def _eps_value(node: Node, ins: dict[str, Tensor]) -> float:
    e = node.inputs["epsilon"]
    if e.is_scalar:
        return float(e.value)  # type: ignore[arg-type]
    return float(ins["epsilon"].reshape(-1)[0].item())  # a runtime tensor (a graph break if compiled)


def _lower_bn_inference(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    x = ctx.cast_in(node, ins["x"])
    p = {k: _channel_vec(ctx.cast_in(node, ins[k])).to(x.dtype) for k in ("scale", "bias", "mean", "var")}
    y = _F().batch_norm(x, p["mean"], p["var"], p["scale"], p["bias"], False, 0.0, _eps_value(node, ins))
    return {"y": y}


def _lower_bn_training(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    torch = _torch()
    x = ctx.cast_in(node, ins["x"])
    scale = _channel_vec(ctx.cast_in(node, ins["scale"])).to(x.dtype)
    bias = _channel_vec(ctx.cast_in(node, ins["bias"])).to(x.dtype)
    y, mean, inv = torch.native_batch_norm(x, scale, bias, None, None, True, 0.0, _eps_value(node, ins))
    stats = node.outputs["mean"].shape
    return {"y": y, "mean": mean.reshape(stats), "inv_var": inv.reshape(stats)}


def _feature(t: Tensor, x: Tensor) -> Tensor:
    """A per-feature parameter, broadcast to x's non-batch dims (what F.layer_norm takes)."""
    target = x.shape[1:]
    while t.dim() > len(target) and t.shape[0] == 1:
        t = t.squeeze(0)
    return t.expand(target)


def _lower_layernorm(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    torch = _torch()
    x = ctx.cast_in(node, ins["x"])
    scale = _feature(ctx.cast_in(node, ins["scale"]).to(x.dtype), x)
    bias = _feature(ctx.cast_in(node, ins["bias"]).to(x.dtype), x)
    eps = _eps_value(node, ins)
    if "mean" not in node.outputs:
        return {"y": _F().layer_norm(x, tuple(x.shape[1:]), scale.contiguous(), bias.contiguous(), eps)}
    y, mean, rstd = torch.native_layer_norm(x, list(x.shape[1:]), scale.contiguous(), bias.contiguous(), eps)
    stats = node.outputs["mean"].shape
    return {"y": y, "mean": mean.reshape(stats), "inv_var": rstd.reshape(stats)}


def _lower_rmsnorm(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    torch = _torch()
    x = ctx.cast_in(node, ins["x"])
    scale = ctx.cast_in(node, ins["scale"]).to(x.dtype)
    eps = _eps_value(node, ins)
    axes = list(range(1, x.dim()))
    out: dict[str, Tensor] = {}
    if "inv_rms" in node.outputs:
        inv = torch.rsqrt(torch.mean(x * x, dim=axes, keepdim=True) + eps)
        y = x * inv * scale
        out["inv_rms"] = inv
    else:
        y = _F().rms_norm(x, tuple(x.shape[1:]), _feature(scale, x).contiguous(), eps)
    if "bias" in ins:
        y = y + ctx.cast_in(node, ins["bias"]).to(x.dtype)
    out["y"] = y
    return out


def _native_padding(attrs: PoolingAttrs, size: tuple[int, ...], want: Sequence[int]) -> bool | None:
    """The ceil_mode with which torch's own pooling padding (``pre`` on both sides, extra
    windows only where they overlap the input) yields exactly the graph's windows -- each
    starts at ``i * stride - pre`` either way, and padding never wins a max nor counts in an
    exclude-pad average -- or None when neither does (then the input is padded first, a copy)."""
    if any(2 * p > k for p, k in zip(attrs.pre_padding, attrs.window, strict=True)):
        return None
    if any(a > b for a, b in zip(attrs.pre_padding, attrs.post_padding, strict=True)):
        return None
    for ceil in (False, True):
        dims = []
        for n, k, s, p in zip(size, attrs.window, attrs.stride, attrs.pre_padding, strict=True):
            span = n + 2 * p - k
            out = (-(-span // s) if ceil else span // s) + 1
            if ceil and (out - 1) * s >= n + p:
                out -= 1  # torch drops a last window that starts in the right padding
            dims.append(out)
        if dims == list(want):
            return ceil
    return None


def _lower_pooling(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    torch = _torch()
    F = _F()
    attrs = node.attrs
    assert isinstance(attrs, PoolingAttrs)
    x = ctx.cast_in(node, ins["x"])
    nsp = x.dim() - 2
    win, stride = list(attrs.window), list(attrs.stride)
    padded = any(attrs.pre_padding) or any(attrs.post_padding)
    pads = _pad_list(attrs.pre_padding, attrs.post_padding)
    if attrs.mode == PoolingMode.MAX:
        pool = getattr(F, f"max_pool{nsp}d")
        if padded:
            native = _native_padding(attrs, tuple(x.shape[2:]), node.outputs["y"].shape[2:])
            if native is not None:
                return {"y": pool(x, win, stride, padding=list(attrs.pre_padding), ceil_mode=native)}
            x = F.pad(x, pads, value=-math.inf)
        return {"y": pool(x, win, stride)}
    avg = getattr(F, f"avg_pool{nsp}d")
    if not padded:
        return {"y": avg(x, win, stride)}
    if attrs.mode != PoolingMode.AVG_INCLUDE_PAD:  # divisor = real elements: as for max
        native = _native_padding(attrs, tuple(x.shape[2:]), node.outputs["y"].shape[2:])
        if native is not None:
            return {"y": avg(x, win, stride, padding=list(attrs.pre_padding), ceil_mode=native, count_include_pad=False)}
    xp = F.pad(x, pads)
    if attrs.mode == PoolingMode.AVG_INCLUDE_PAD:
        return {"y": avg(xp, win, stride)}
    ones = torch.ones((1, 1, *x.shape[2:]), dtype=x.dtype, device=x.device)
    count = avg(F.pad(ones, pads), win, stride)  # fraction of real elements per window
    return {"y": avg(xp, win, stride) / count}


def _lower_sdpa(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    torch = _torch()
    attrs = node.attrs
    assert isinstance(attrs, SdpaAttrs)
    q, k, v = _operands(ctx, node, ins, ("q", "k", "v"))
    mask = ins.get("mask")
    sq, skv = q.shape[-2], k.shape[-2]
    causal = attrs.causal
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    if causal and mask is not None:
        keep = torch.ones((sq, skv), dtype=torch.bool, device=q.device).tril()
        mask = mask & keep if mask.dtype == torch.bool else mask.masked_fill(~keep, -math.inf)
        causal = False
    gqa = q.shape[1] != k.shape[1]
    o = _F().scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=attrs.attn_scale, enable_gqa=gqa
    )
    return {"o": o}


def _lower_softmax(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    attrs = node.attrs
    assert isinstance(attrs, SoftmaxAttrs)
    x = ctx.cast_in(node, ins["x"])
    fn = _F().log_softmax if attrs.log else _F().softmax
    return {"y": fn(x, dim=attrs.axis)}


def _lower_reshape(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    """A view when ``x``'s layout allows one; otherwise one copy straight into the declared
    layout of ``y`` (torch's own reshape would copy to row-major, and a channels-last
    partition would then run on NCHW from a channel shuffle onwards)."""
    x, y = ins["x"], node.outputs["y"]
    if ctx.functional:  # traced for oneDNN Graph: no in-place copies into views
        return {"y": torch_fusion.as_declared(x.reshape(y.shape), y)}
    try:
        return {"y": x.view(y.shape)}
    except RuntimeError:
        pass
    out = _torch().empty_strided(y.shape, y.strides, dtype=x.dtype, device=x.device)
    try:
        out.view(x.shape).copy_(x)
    except RuntimeError:  # the declared layout does not split into x's dims either
        return {"y": x.reshape(y.shape)}
    return {"y": out}


def _lower_transpose(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    assert isinstance(node.attrs, TransposeAttrs)
    return {"y": ins["x"].permute(node.attrs.permutation)}


def _lower_concat(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    torch = _torch()
    assert isinstance(node.attrs, ConcatAttrs)
    parts = [ins[p] for p in node.inputs if p.startswith("x")]
    target = torch_dtype(node.outputs["y"].dtype)
    # .to only where a type changes: a traced no-op aten::to splits oneDNN Graph partitions
    return {"y": torch.cat([p if p.dtype == target else p.to(target) for p in parts], dim=node.attrs.axis)}


def _lower_slice(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    a = node.attrs
    assert isinstance(a, SliceAttrs)
    idx = tuple(slice(s, e, k) for s, e, k in zip(a.starts, a.ends, a.steps, strict=True))
    return {"y": ins["x"][idx]}


LOWER: dict[OpKind, Lowering] = {
    OpKind.CONV_FPROP: _lower_conv_fprop,
    OpKind.CONV_DGRAD: _lower_conv_dgrad,
    OpKind.CONV_WGRAD: _lower_conv_wgrad,
    OpKind.MATMUL: _lower_matmul,
    OpKind.POINTWISE: _lower_pointwise,
    OpKind.REDUCTION: _lower_reduction,
    OpKind.BATCHNORM_INFERENCE: _lower_bn_inference,
    OpKind.BATCHNORM: _lower_bn_training,
    OpKind.LAYERNORM: _lower_layernorm,
    OpKind.RMSNORM: _lower_rmsnorm,
    OpKind.POOLING: _lower_pooling,
    OpKind.SDPA: _lower_sdpa,
    OpKind.SOFTMAX: _lower_softmax,
    OpKind.RESHAPE: _lower_reshape,
    OpKind.TRANSPOSE: _lower_transpose,
    OpKind.CONCATENATE: _lower_concat,
    OpKind.SLICE: _lower_slice,
}


# ---- the plan --------------------------------------------------------------------------------
def _node_thunk(ctx: _Ctx, node: Node) -> Callable[[dict[str, Tensor]], None]:
    """One node as a closure over its lowering, port names and output casts."""
    lower = LOWER[node.kind]
    ports = [(p, t.name) for p, t in node.inputs.items()]
    outs = [(port, t.name, torch_dtype(t.dtype)) for port, t in node.outputs.items()]

    def step(env: dict[str, Tensor]) -> None:
        res = lower(ctx, node, {p: env[n] for p, n in ports})
        for port, name, target in outs:
            value = res[port]
            env[name] = value if value.dtype == target else value.to(target)

    return step


def _graph_function(
    graph: Graph, ctx: _Ctx, device: Any, fused: Mapping[str, torch_fusion.Step]
) -> Callable[[dict[str, Tensor]], dict[str, Tensor]]:
    """One Python function running the graph's nodes in order (what torch.compile traces);
    the nodes of each multi-node step run as one where the last of them stood."""
    torch = _torch()
    swallowed = {id(n) for fc in fused.values() for n in fc.nodes[:-1]}
    order: list[Node | torch_fusion.Step] = [
        fused.get(n.name, n) for n in graph.topological_order() if id(n) not in swallowed
    ]
    outputs = graph.outputs()
    constants = {
        t.name: torch.full((1,), t.value, dtype=torch_dtype(t.dtype), device=device)
        for t in graph.tensors
        if t.is_scalar
    }

    out_names = [t.name for t in outputs]
    if not ctx.compiled:
        # Eager: each step a closure with everything that does not change between calls
        # settled now (names, casts, conv arguments); Python is the per-op cost left.
        thunks = [_node_thunk(ctx, n) if isinstance(n, Node) else n.thunk(ctx.memory_format) for n in order]

        def run_eager(inputs: dict[str, Tensor]) -> dict[str, Tensor]:
            env: dict[str, Tensor] = {**constants, **inputs}
            for step in thunks:
                step(env)
            return {n: env[n] for n in out_names}

        return run_eager

    # Compiled: the plain nodes (Inductor does its own fusion), in code dynamo traces well.
    assert not fused, "multi-node steps are for eager plans"
    nodes = graph.topological_order()

    def run(inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        env: dict[str, Tensor] = {**constants, **inputs}
        for node in nodes:
            ins = {p: env[t.name] for p, t in node.inputs.items()}
            outs = LOWER[node.kind](ctx, node, ins)
            for port, value in outs.items():
                t = node.outputs[port]
                target = torch_dtype(t.dtype)
                env[t.name] = value if value.dtype == target else value.to(target)
        return {t.name: env[t.name] for t in outputs}

    # A code object of its own per graph: torch.compile caches (and caps recompiles) per
    # code object, so plans sharing ``run``'s would evict each other and fall back to eager.
    tag = "fusegraph_" + "".join(ch if ch.isalnum() else "_" for ch in graph.name)[:40] + f"_{id(ctx):x}"
    code = run.__code__.replace(co_name=tag, co_qualname=tag)
    return types.FunctionType(code, run.__globals__, tag, run.__defaults__, run.__closure__)  # type: ignore[no-any-return]


class TorchPlan(ExecutionPlan):
    """A graph as one PyTorch function (eager, or compiled once per plan)."""

    relayouts_host_inputs = True  # torch's threaded copy (NCHW -> NHWC: ~5x NumPy's)

    def __init__(self, graph: Graph, handle: Handle, config: EngineConfig) -> None:
        super().__init__(graph, handle, config)
        torch = _torch()
        self._torch = torch
        self.device = _torch_device(handle)
        self._ctx = _Ctx(graph, handle, config)
        self._compiled = self._ctx.compiled
        self._benchmark = bool(config.get("cudnn_benchmark", True))
        self._threads = int(config.get("threads", 0))
        self._has_flags = handle.device.is_gpu or bool(self._threads)  # else _flags() sets nothing
        self._cuda_graph = handle.device.is_gpu and not self._compiled and bool(config.get("cuda_graph", True))
        self._llga_on = (
            not handle.device.is_gpu
            and not self._compiled
            and bool(config.get("onednn_graph", ONEDNN_GRAPH_DEFAULT))
            and torch_onednn_graph.available()
            and bool(torch_fusion.plan_fusions(graph))
        )
        self._llga: Any = None  # the frozen, fused function, once built
        self._llga_bound: Any = None  # the bindings it was traced with
        self._llga_fresh: frozenset[str] = frozenset()  # its outputs allocated anew on every call
        self._hot_in: list[tuple[Any, ...]] | None = None  # see _run_hot
        self._hot_out: list[tuple[str, TensorAttr, bool]] = []
        self._dense: dict[str, Tensor] = {}  # bound inputs before any oneDNN reordering
        self._graph: tuple[Any, dict[str, Tensor], dict[str, Tensor]] | None = None
        self._graph_bound: Any = None  # the bindings the graph was captured with
        self.fusions: dict[str, torch_fusion.Step] = (
            {} if self._compiled else torch_fusion.plan_steps(graph, onednn=self._ctx.onednn)
        )
        self._bound: dict[str, tuple[Any, Tensor]] = {}  # bound input -> (its value, torch form)
        self._bound_src: dict[str, Any] = {}  # bound input -> its value as bound
        fn = _graph_function(graph, self._ctx, self.device, self.fusions)
        if self._compiled:
            fn = torch.compile(fn, dynamic=False)
        self._fn = fn
        self._inputs = graph.inputs()
        self._outputs = graph.outputs()
        self._in_by_name = {t.name: t for t in self._inputs}
        self._acts = list(self._inputs)  # the inputs not bound (all, until bind_constants)
        self._act_names = [t.name for t in self._acts]
        self._bound_buffers, self._bound_host = False, True
        self._out_names = [t.name for t in self._outputs]
        self._out_by_name = {t.name: t for t in self._outputs}
        if self._compiled:
            self._warm_compile()

    # -- numerics flags, set only while the plan runs ---------------------------------------
    @contextlib.contextmanager
    def _flags(self) -> Iterator[None]:
        torch = self._torch
        if not self.handle.device.is_gpu:
            if not self._threads:
                yield
                return
            before = torch.get_num_threads()
            torch.set_num_threads(self._threads)  # process-wide in torch: restored right after
            try:
                yield
            finally:
                torch.set_num_threads(before)
            return
        saved = (
            torch.backends.cudnn.benchmark,
            torch.backends.cudnn.allow_tf32,
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        )
        torch.backends.cudnn.benchmark = self._benchmark
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        try:
            with torch.cuda.device(self.device):
                yield
        finally:
            (
                torch.backends.cudnn.benchmark,
                torch.backends.cudnn.allow_tf32,
                torch.backends.cuda.matmul.allow_tf32,
                torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
            ) = saved

    def _warm_compile(self) -> None:
        """Compiles now (build time), on tensors laid out as the graph declares them."""
        torch = self._torch
        dummy = {}
        for t in self._inputs:
            x = torch.empty_strided(t.shape, t.strides, dtype=torch_dtype(t.dtype), device=self.device)
            x.copy_(torch.ones(t.shape, dtype=x.dtype) if t.dtype != DataType.BOOLEAN else torch.ones(t.shape, dtype=torch.bool))
            dummy[t.name] = x
        try:
            with self._torch.inference_mode(), self._flags():
                self._fn(dummy)  # under the same global state as execute(), or dynamo recompiles
        except Exception as exc:
            raise CompileError(f"torch.compile failed for graph '{self.graph.name}': {type(exc).__name__}", diagnostic=str(exc)) from exc

    # -- variant packs ----------------------------------------------------------------------
    def _check(self, t: TensorAttr, value: Any, *, what: str) -> Any:
        torch = self._torch
        if isinstance(value, torch.Tensor):
            if tuple(value.shape) != t.shape:
                raise VariantPackError(f"{what} has shape {list(value.shape)}, expected dims {t.dim}", tensor=t.name)
            if value.dtype != torch_dtype(t.dtype):
                raise VariantPackError(f"{what} has dtype {value.dtype}, expected {t.dtype.name}", tensor=t.name)
            if value.device != self.device:
                raise VariantPackError(f"{what} is on {value.device}, the plan runs on {self.device}", tensor=t.name)
            return value
        if _is_buffer(value):
            why = value.layout_mismatch(t.shape, t.strides, t.dtype)
            if why:
                raise VariantPackError(f"{what}: {why}", tensor=t.name)
            if value.handle.device != self.handle.device:
                raise VariantPackError(f"{what} Buffer lives on {value.device}, the plan runs on {self.handle.device}", tensor=t.name)
            return value
        if not isinstance(value, np.ndarray) and hasattr(value, "__dlpack__"):
            try:
                imported = torch.from_dlpack(value)
            except Exception as exc:
                raise VariantPackError(f"{what}: DLPack import into torch failed: {exc}", tensor=t.name) from exc
            return self._check(t, imported, what=what)
        return check_array(t, value, what=what, strides=what == "output")

    def _to_device(self, t: TensorAttr, value: Any) -> Tensor:
        if isinstance(value, np.ndarray):
            x = from_numpy(value, t.dtype)
            if not layout.same_strides(t.shape, x.stride(), t.strides):  # laid out by torch (threaded), not by NumPy
                return self._torch.empty_strided(t.shape, t.strides, dtype=x.dtype, device=self.device).copy_(x)
            return x.to(self.device, non_blocking=False) if self.device.type != "cpu" else x
        if _is_buffer(value):
            return buffer_to_torch(value, t)
        return value

    def bind_constants(self, values: Mapping[Any, Any]) -> bool:
        """Keeps a torch view of each bound input, so later calls may omit it and skip checking
        and wrapping it, and -- unless the oneDNN Graph path will take the plan over -- reorders the
        filter of each fused convolution (read by it alone) into oneDNN's blocked layout
        once. See ExecutionPlan.bind_constants."""
        named = {(k.name if isinstance(k, TensorAttr) else str(k)): v for k, v in values.items()}
        for name in named:
            if name not in self._in_by_name:
                raise VariantPackError("bound constant is not an input of the graph (nothing would read it)", tensor=name)
        bound: dict[str, tuple[Any, Tensor]] = {}
        with self._torch.inference_mode():
            for t in self._inputs:
                if t.name in named:
                    src = self._check(t, named[t.name], what="bound constant")
                    bound[t.name] = (src, self._to_device(t, src))
        self._dense = {name: value for name, (_, value) in bound.items()}
        self._bound = bound
        self._hot_in = None  # the traced function holds the old values: rebuilt at the next call
        self._bound_src = {name: src for name, (src, _) in bound.items()}
        self._acts = [t for t in self._inputs if t.name not in bound]
        self._act_names = [t.name for t in self._acts]
        self._bound_buffers = any(_is_buffer(src) for src in self._bound_src.values())
        self._bound_host = all(isinstance(src, np.ndarray) for src in self._bound_src.values())
        if not self._llga_on:
            self._prepack()
        return True

    def _prepack(self) -> None:
        """Bound conv filters in oneDNN's blocked layout, for the eager fused path."""
        packable = {
            fc.conv.inputs["w"].name: fc.conv for fc in self.fusions.values() if isinstance(fc, torch_fusion.FusedConv)
        }
        readers: dict[str, int] = {}
        for n in self.graph.nodes:
            for t in n.inputs.values():
                readers[t.name] = readers.get(t.name, 0) + 1
        bound = dict(self._bound)
        with self._torch.inference_mode():
            for name, (src, value) in self._bound.items():
                conv = packable.get(name)
                if conv is not None and readers.get(name) == 1 and value.device.type == "cpu":
                    bound[name] = (src, torch_fusion.pack_filter(conv, self._dense[name]))
        self._bound = bound

    def _resolve(self, variant_pack: Mapping[Any, Any]) -> Any:
        """resolve_pack without its per-call scans (and without re-checking a bound constant
        passed as the very object bound); any irregular pack goes to resolve_pack, which
        raises the precise error."""
        if not isinstance(variant_pack, Mapping):
            return self._resolve_slowly(variant_pack)
        inputs: dict[str, Any] = {}
        outputs: dict[str, Any] = {}
        overridden = False
        ins, outs, bound = self._in_by_name, self._out_by_name, self._bound
        for key, value in variant_pack.items():
            if type(key) is str:
                name = key
            elif isinstance(key, TensorAttr) and key.graph is self.graph:
                name = key.name
            else:
                return self._resolve_slowly(variant_pack)
            t = ins.get(name)
            if t is not None:
                b = bound.get(name)
                if b is not None and value is b[0]:
                    inputs[name] = value
                else:
                    inputs[name] = self._check(t, value, what="input")
                    overridden = overridden or b is not None
                continue
            t = outs.get(name)
            if t is None or name in outputs:
                return self._resolve_slowly(variant_pack)
            arr = self._check(t, value, what="output")
            if isinstance(arr, np.ndarray) and not arr.flags.writeable:
                raise VariantPackError("output array is read-only", tensor=t.name)
            outputs[name] = arr
        if len(inputs) != len(ins):
            inputs = {**self._bound_src, **inputs}  # bound inputs the caller left out
            if len(inputs) != len(ins):
                return self._resolve_slowly(variant_pack)
        return ResolvedPack(inputs, outputs, overridden)

    def _resolve_slowly(self, variant_pack: Any) -> ResolvedPack:
        """resolve_pack, with bound inputs filled in where left out: it raises the precise error."""
        if isinstance(variant_pack, Mapping) and self._bound_src:
            named = {k.name if isinstance(k, TensorAttr) else k for k in variant_pack}
            variant_pack = {**{n: v for n, v in self._bound_src.items() if n not in named}, **variant_pack}
        pack = resolve_pack(self.graph, variant_pack, check=self._check)
        pack.overridden = any(pack.inputs[n] is not src for n, src in self._bound_src.items())
        return pack

    def _inputs_of(self, pack: Any) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        bound = self._bound
        for t in self._inputs:
            value = pack.inputs[t.name]
            b = bound.get(t.name)
            out[t.name] = b[1] if b is not None and value is b[0] else self._to_device(t, value)
        return out

    def stage(self, variant_pack: Mapping[Any, Any]) -> dict[str, Tensor]:
        """The pack's inputs as device tensors, for timing without host transfers."""
        return self._inputs_of(self._resolve(variant_pack))

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            self._torch.cuda.synchronize(self.device)

    def execute(self, variant_pack: Mapping[Any, Any]) -> dict[str, Any]:
        """Runs the graph. Values may be NumPy arrays, torch tensors on the plan's device, or
        fusegraph Buffers (shared through DLPack, no copy). Outputs not given come back as
        Buffers if any input was one, as NumPy arrays if every input was, else as tensors."""
        if self._hot_in is not None:
            hot = self._run_hot(variant_pack)
            if hot is not None:
                return hot
        torch = self._torch
        pack = self._resolve(variant_pack)
        if pack.overridden:
            values: Any = pack.inputs.values()
            as_buffers = any(_is_buffer(v) for v in values)
            host_io = not as_buffers and all(isinstance(v, np.ndarray) for v in values)
        else:  # the bound inputs' kinds are known since bind_constants
            acts = [pack.inputs[n] for n in self._act_names]
            as_buffers = self._bound_buffers or any(_is_buffer(v) for v in acts)
            host_io = not as_buffers and self._bound_host and all(isinstance(v, np.ndarray) for v in acts)
        try:
            with torch.inference_mode(), (self._flags() if self._has_flags else _NO_FLAGS):
                results = self._replay(pack) if self._cuda_graph else None
                replayed = results is not None
                if results is None and self._llga_on and self._bound:  # worth compiling once weights are fixed
                    results = self._run_llga(pack)
                fused = results is not None and not replayed
                if results is None:
                    results = self._fn(self._inputs_of(pack))
        except Exception as exc:
            raise ExecutionError(f"torch plan for graph '{self.graph.name}' failed: {type(exc).__name__}: {exc}") from exc
        if replayed and not host_io:  # the graph's static outputs are overwritten by the next replay
            results = {k: v.clone() for k, v in results.items()}
        out: dict[str, Any] = {}
        # Host results of the oneDNN Graph function may be lent as NumPy views of the tensors
        # it computed (not copied): those it allocates afresh on every call (_llga_fresh: so
        # never an input's or a constant's memory), unless two results share memory.
        taken: list[int] | None = [] if fused and host_io else None
        for t in self._outputs:
            value = results[t.name]
            given = pack.outputs.get(t.name)
            if given is not None:
                if isinstance(given, np.ndarray):
                    to_numpy_into(value, given, t.dtype)
                elif _is_buffer(given):
                    buffer_to_torch(given, t).copy_(value)
                else:
                    given.copy_(value)
            elif as_buffers:
                out[t.name] = torch_to_buffer(value, t, self.handle)
            elif host_io:
                out[t.name] = _host_result(value, t, taken if t.name in self._llga_fresh else None)
            else:
                out[t.name] = value
        return out

    # -- the hot path ------------------------------------------------------------------------
    def _hot_spec(self) -> tuple[list[tuple[Any, ...]] | None, list[tuple[str, TensorAttr, bool]]]:
        """What _run_hot checks each activation against, once the oneDNN Graph function is
        built (None where the call always takes the general path)."""
        outs = [(t.name, t, t.name in self._llga_fresh) for t in self._outputs]
        if self.device.type != "cpu" or self._has_flags or any(t.dtype in _VIEW_AS for t in self._acts):
            return None, outs
        spec = [
            (t.name, t.shape, np.dtype(t.dtype.numpy), tuple(st * np.dtype(t.dtype.numpy).itemsize for st in t.strides),
             t.strides, torch_dtype(t.dtype))
            for t in self._acts
        ]
        return spec, outs

    def _run_hot(self, variant_pack: Any) -> dict[str, Any] | None:
        """The common call kept lean -- every Python step after a run pays cold caches (the
        weights just streamed through them), ~0.3 ms a call on ResNet-50 through the general
        path: a dict of NumPy activations by name, the bound weights left out, the oneDNN
        Graph function built. None sends the call down the general path, which also raises
        the precise errors."""
        spec = self._hot_in
        if spec is None or type(variant_pack) is not dict or len(variant_pack) != len(spec):
            return None
        torch = self._torch
        xs = []
        for name, shape, dtype, byte_strides, strides, tdtype in spec:
            v = variant_pack.get(name)
            if type(v) is not np.ndarray or v.shape != shape or v.dtype != dtype or not v.flags.writeable:
                return None
            if min(v.strides, default=0) < 0:
                return None
            x = torch.from_numpy(v)
            if v.strides != byte_strides:  # laid out by torch (threaded), not by NumPy
                x = torch.empty_strided(shape, strides, dtype=tdtype).copy_(x)
            xs.append(x)
        try:
            with torch.inference_mode():
                results = self._llga(*xs)
        except Exception as exc:
            raise ExecutionError(f"torch plan for graph '{self.graph.name}' failed: {type(exc).__name__}: {exc}") from exc
        out: dict[str, Any] = {}
        taken: list[int] = []
        for (name, t, fresh), value in zip(self._hot_out, results, strict=True):
            out[name] = _host_result(value, t, taken if fresh else None)
        return out

    # -- oneDNN Graph (CPU) -----------------------------------------------------------------
    def _run_llga(self, pack: Any) -> dict[str, Tensor] | None:
        """The plan through its oneDNN Graph function (built on first use); None when this
        call must run eagerly (a bound input passed as another object) or building failed."""
        if pack.overridden:  # a captured or traced plan holds the bound values: run eagerly
            return None
        acts = self._acts
        values = [self._to_device(t, pack.inputs[t.name]) for t in acts]
        stale = self._llga is None or self._llga_bound is not self._bound
        if stale and not self._build_llga(pack, acts, values):
            return None
        return dict(zip(self._out_names, self._llga(*values), strict=True))

    def _build_llga(self, pack: Any, acts: list[TensorAttr], values: list[Tensor]) -> bool:
        why = self.onednn_graph_verdict(pack, acts=acts, values=values)
        if why:
            log.warning("graph '%s': oneDNN Graph disabled, running eagerly (%s)", self.graph.name, why)
            self._llga_on = False
            self._llga = None
            self._prepack()  # the eager path's filters, skipped while the traced one was expected
            return False
        return True

    def onednn_graph_verdict(
        self, pack: Any, *, probe: bool = True, acts: list[TensorAttr] | None = None, values: list[Tensor] | None = None
    ) -> str:
        """Builds the oneDNN Graph function for this plan (first in a child process, when
        ``probe``); '' on success, else why it cannot be used."""
        torch = self._torch
        if not isinstance(pack, ResolvedPack):
            pack = self._resolve(pack)
        if acts is None or values is None:
            acts = self._acts
            values = [self._to_device(t, pack.inputs[t.name]) for t in acts]
        if probe:
            why = torch_onednn_graph.probe(self.graph, sorted(self._bound), self.config.knobs)
            if why:
                return f"probe: {why}"
        ctx = _Ctx(self.graph, self.handle, self.config)
        ctx.onednn = False
        ctx.functional = True
        scalars = {
            t.name: torch.full((1,), t.value, dtype=torch_dtype(t.dtype)) for t in self.graph.tensors if t.is_scalar
        }
        try:
            with torch.inference_mode(), self._flags():
                fn = torch_onednn_graph.trace(
                    self.graph,
                    lambda n: _node_thunk(ctx, n),
                    torch_fusion.plan_traced_steps(self.graph),
                    self._dense,
                    scalars,
                    values,
                    acts,
                )
                got = fn(*values)
                again = fn(*values)  # with ``got`` alive: a result at the same address is not fresh
                fresh = {
                    name for name, a, b in zip(self._out_names, got, again, strict=True)
                    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
                }
                eager = self._fn(self._inputs_of(pack))
            why = torch_onednn_graph.agrees(got, [eager[n] for n in self._out_names])
        except Exception as exc:  # the bridge's gaps: an op it cannot take, a failed fused run
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if not why:
            self._llga, self._llga_bound, self._llga_fresh = fn, self._bound, frozenset(fresh)
            self._hot_in, self._hot_out = self._hot_spec()
        return why

    # -- CUDA graphs ------------------------------------------------------------------------
    def _replay(self, pack: Any) -> dict[str, Tensor] | None:
        """The plan as one replayed CUDA graph; None when this call must run eagerly (a bound
        constant passed as another object) or capture failed (then never again)."""
        if pack.overridden:  # a captured or traced plan holds the bound values: run eagerly
            return None
        stale = self._graph is None or self._graph_bound is not self._bound
        if stale and not self._capture(pack):
            return None
        assert self._graph is not None
        graph, static_in, static_out = self._graph
        for t in self._inputs:
            if t.name in self._bound:
                continue
            value = pack.inputs[t.name]
            dst = static_in[t.name]
            if isinstance(value, np.ndarray):
                dst.copy_(from_numpy(value, t.dtype), non_blocking=False)
            elif _is_buffer(value):
                dst.copy_(buffer_to_torch(value, t))
            else:
                dst.copy_(value)
        graph.replay()
        return static_out

    def _capture(self, pack: Any) -> bool:
        torch = self._torch
        static_in: dict[str, Tensor] = {}
        for t in self._inputs:
            b = self._bound.get(t.name)
            if b is not None:
                static_in[t.name] = b[1]
                continue
            buf = torch.empty_strided(t.shape, t.strides, dtype=torch_dtype(t.dtype), device=self.device)
            buf.copy_(self._to_device(t, pack.inputs[t.name]))
            static_in[t.name] = buf
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # cuDNN picks its algorithms and workspaces outside the capture
                    self._fn(static_in)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = self._fn(static_in)
        except Exception as exc:  # an op that syncs with the host, or one CUDA graphs cannot hold
            log.info("graph '%s': CUDA graph capture failed (%s); running eagerly", self.graph.name, str(exc).splitlines()[0])
            self._cuda_graph = False
            self._graph = None
            return False
        self._graph = (graph, static_in, static_out)
        self._graph_bound = self._bound
        return True

    def serialize(self) -> bytes:
        """The graph and knobs: a torch plan is rebuilt from them (TorchEngine.load_plan)."""
        return json.dumps(
            {"engine": "torch", "graph": self.graph.to_json(), "knobs": [list(k) for k in self.config.knobs]}
        ).encode()

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["device"] = str(self.device)
        d["compiled"] = self._compiled
        if self.handle.device.is_gpu:
            d["cuda_graph"] = self._graph is not None
        else:
            d["onednn_graph"] = self._llga is not None
        if self.fusions:
            d["fused_steps"] = [fc.describe() for fc in self.fusions.values()]
            d["prepacked_filters"] = len(self._bound)
        return d


__all__ = ["LOWER", "TorchEngine", "TorchPlan", "torch_dtype"]
