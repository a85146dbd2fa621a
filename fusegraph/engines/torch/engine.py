"""The vendor-library engine: runs a graph on PyTorch (cuDNN / cuBLAS on NVIDIA, oneDNN /
MKL on CPU), eagerly op by op or through ``torch.compile``.

Why it exists: on NVIDIA, vendor libraries beat generated code by 6-9x on compute-bound
ops (DESIGN.md), so a plan built from them is what makes the engine *selection* faster
than any single compiler. torch is optional (``fusegraph[torch]``): without it this module
still imports and the engine says it is unavailable, and why.

This module holds what the selection layer asks of the engine -- availability, support,
knobs -- and hands the graph to ``plan.TorchPlan``; the numerics are described in
``fusegraph/engines/torch/__init__.py``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from collections.abc import Sequence
from typing import Any

from fusegraph.dtypes import DataType
from fusegraph.engines.base import EngineConfig, ExecutionPlan, Knob, Support, knob_values
from fusegraph.engines.torch.convert import (
    _FP8,
    _torch,
    gpu_exists,
    torch_build_info,
    torch_installed,
    visible_gpus,
)
from fusegraph.graph.graph import Graph
from fusegraph.graph.infer import conv_groups
from fusegraph.graph.node import Node
from fusegraph.graph.ops import (
    CONVOLUTIONS,
    OpKind,
    PoolingAttrs,
    PoolingMode,
    ReductionAttrs,
    ReductionMode,
)
from fusegraph.graph.tensor import TensorAttr
from fusegraph.runtime.handle import Handle

# What graphs keep in Graph.derived, shared between them (knob tuples, a yes, the memo keys):
# a few dozen distinct values.
_INTERNED: dict[Any, Any] = {}


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
        if not visible_gpus(torch):
            build = "a CPU-only build" if not (torch.version.cuda or torch.version.hip) else "no GPU visible"
            return Support.no(f"PyTorch {torch.__version__} sees no GPU ({build})")
        return gpu_exists(torch, handle.device.index)

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
        # per validated graph and handle, as the knobs: a region build asks about each piece
        # three times or so (the engine choice, the selection, the build itself)
        key = ("torch", "supports", handle)
        known: Support | None = graph.derived.get(key)
        if known is None:
            known = _nodes_supported(graph, handle)
            if known:  # a refusal names its node: not one to share
                known = _INTERNED.setdefault(known, known)
            graph.derived[_INTERNED.setdefault(key, key)] = known
        return known

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
        """Worked out once per validated graph and handle: a region build asks again for a
        piece's (the build's own check, the region choice's tf32 and fp32_matmul questions, the
        op-by-op incumbent's config)."""
        default = ""
        if not handle.device.is_gpu:
            from fusegraph.engines.torch import frozen

            default = frozen.knob_default()  # an environment variable's: read on every ask
        key = ("torch", "knobs", handle, bool(self.compile_support(handle)), default)
        known = graph.derived.get(key) if graph.is_validated else None
        if known is None:
            known = tuple(self._knobs(graph, handle))
            if graph.is_validated:
                # one tuple of knobs (and key) for all the graphs that share them: what a
                # graph keeps must not add objects for the collector to walk (a session's
                # open keeps hundreds of piece graphs)
                known = _INTERNED.setdefault(known, known)
                graph.derived[_INTERNED.setdefault(key, key)] = known
        return list(known)

    def _knobs(self, graph: Graph, handle: Handle) -> list[Knob]:
        # The plan's modules load when a plan is asked about, not when the engine is listed
        # (every build lists every engine for the tuning database's key: issue 10's cold build).
        from fusegraph.engines.torch import fusion as torch_fusion
        from fusegraph.engines.torch import onednn_graph as torch_onednn_graph
        from fusegraph.engines.torch import steps as torch_steps
        from fusegraph.engines.torch.onednn_graph import ONEDNN_GRAPH_DEFAULT

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
        if handle.device.is_gpu and any(_depthwise(n) for n in graph.nodes):
            out.append(
                Knob(
                    "cudnn_depthwise",
                    True,
                    (True, False),
                    description="depthwise convolutions on cuDNN (off: PyTorch's own kernel, which builds "
                    "nothing at first use; cuDNN builds its depthwise kernels per shape, ~150 ms each on an H200)",
                )
            )
        if handle.device.is_gpu and _float32_tensor_core_op(graph):
            out.append(
                Knob(
                    "tf32",
                    False,
                    (False, True),
                    numerics=True,
                    description="float32 convolutions, matmuls and attention may round their operands to "
                    "TF32 (PyTorch's default for convolutions; off: float32 as declared)",
                )
            )
        if not _split_refusal(graph, handle):
            out.append(
                Knob(
                    "fp32_matmul",
                    "ieee",
                    ("ieee", "bf16x3"),
                    numerics=True,
                    description="float32 x float32 matmuls as declared (ieee) or as one bf16 tensor-core GEMM "
                    "of each operand's two bf16 halves over a 3K-long inner dimension, float32 out (bf16x3: "
                    "|error| <= ~4.6e-5 |A||B| plus float32 summation; split_products.py)",
                )
            )
        if handle.device.is_gpu:
            out.append(
                Knob(
                    "cuda_graph",
                    "auto",
                    ("auto", True, False),
                    description="capture the whole eager plan once as a CUDA graph and replay it "
                    "(one launch instead of one per op; inputs copied into static buffers; eager only); "
                    "auto: where the plan is launch-bound (cuda_graph.worth_capturing)",
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
        if not handle.device.is_gpu and torch_fusion.has_onednn_steps(graph) and torch_steps.available():
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
        if not handle.device.is_gpu and torch_fusion.has_fused_convs(graph) and torch_onednn_graph.available():
            out.append(
                Knob(
                    "onednn_graph",
                    ONEDNN_GRAPH_DEFAULT,
                    (True, False),
                    description="once weights are bound (bind_constants), trace the plan into TorchScript "
                    "with them frozen in and let oneDNN Graph fuse and compile it (probed in a child process, "
                    "checked against the eager plan on the first call; opt-in: torch.jit.trace is deprecated; "
                    "tried before cpu_compile's candidates, which follow on any failure)",
                )
            )
        if not handle.device.is_gpu and self.compile_support(handle):
            from fusegraph.engines.torch import frozen

            out.append(
                Knob(
                    "cpu_compile",
                    frozen.knob_default(),
                    frozen.CHOICES,
                    description="once weights are bound, compile the plan with them frozen in: auto tries "
                    "AOTInductor (package cached in the cache directory) then Inductor, each checked against "
                    "the eager plan; off runs eagerly (default: FUSEGRAPH_TORCH_CPU_COMPILE, else auto)",
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
        if config.get("fp32_matmul", "ieee") != "ieee":
            why = _split_refusal(graph, handle)
            if why:
                from fusegraph.errors import UnsupportedError

                raise UnsupportedError(f"torch engine, graph '{graph.name}': knob fp32_matmul="
                                       f"{config.get('fp32_matmul')!r} is not offered here: {why}")
        knob_values("torch engine", self.knobs(graph, handle), config)
        sup = self.supports(graph, handle)
        if not sup:
            from fusegraph.errors import UnsupportedError

            raise UnsupportedError(f"torch engine cannot run graph '{graph.name}': {sup.reason}")
        from fusegraph.engines.torch.plan import TorchPlan

        return TorchPlan(graph, handle, config)

    def load_plan(self, data: bytes, handle: Handle) -> ExecutionPlan:
        """Rebuilds a plan from ``TorchPlan.serialize()`` (graph JSON + knobs)."""
        d = json.loads(data.decode())
        g = Graph.from_json(d["graph"]).validate()
        cfg = EngineConfig(self.name, tuple((k, v) for k, v in d["knobs"]))
        return self.build(g, handle, cfg)


def _nodes_supported(graph: Graph, handle: Handle) -> Support:
    for node in graph.nodes:
        why = _node_unsupported(node, graph, handle)
        if why:
            return Support.no(f"node '{node.name}' ({node.kind.value}): {why}")
    return Support.yes()


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


def _depthwise(node: Node) -> bool:
    """A forward convolution with one filter channel per group and several groups."""
    if node.kind != OpKind.CONV_FPROP:
        return False
    return node.inputs["w"].shape[1] == 1 and conv_groups(node) > 1


def _float32_tensor_core_op(graph: Graph) -> bool:
    """A convolution, matmul or attention reading float32: where TF32 changes anything."""
    from fusegraph.engines.torch.context import _TENSOR_CORE_OPS

    return any(n.kind in _TENSOR_CORE_OPS and any(t.dtype == DataType.FLOAT for t in n.inputs.values())
               for n in graph.nodes)


def _float32_matmuls(graph: Graph) -> list[Node]:
    """The matmuls of float32 operands computed in float32: what ``fp32_matmul`` splits."""
    from fusegraph.engines.torch.context import _compute_type, _main_input_type

    return [n for n in graph.nodes if n.kind == OpKind.MATMUL
            and n.inputs["a"].dtype == DataType.FLOAT and n.inputs["b"].dtype == DataType.FLOAT
            and _compute_type(n, graph, _main_input_type(n)) == DataType.FLOAT]


def _split_refusal(graph: Graph, handle: Handle) -> str:
    """Why the ``fp32_matmul`` knob is not offered for this graph and device ('' where it is)."""
    if not handle.device.is_gpu:
        return ("the bf16x3 split is one bf16 GEMM with float32 output (aten::mm.dtype), which has CUDA "
                f"kernels only; {handle.device} runs float32 matmuls as declared")
    if not _float32_matmuls(graph):
        return "the graph has no float32 x float32 matmul to split"
    if handle.device.kind != "cuda":
        return f"the split's bf16 GEMM with float32 output is CUDA-only, not {handle.device.kind}"
    from fusegraph.engines.torch import split_products
    from fusegraph.engines.torch.convert import _torch_device

    try:
        device = str(_torch_device(handle))
    except Exception as exc:  # torch fails to import: supports() says so
        return f"PyTorch is unusable: {exc}"
    if not split_products.kernel_available(device, "mm"):
        return f"torch {_torch().__version__} has no mm(bf16, bf16, out_dtype=float32) on {device} (torch >= 2.8)"
    return ""
