"""The torch engine's execution plan: a graph as one PyTorch function (eager, or compiled
once per plan), its variant packs resolved and checked, its results handed back as NumPy
arrays, torch tensors or fusegraph Buffers, the common CPU call kept lean (the hot path),
and the oneDNN Graph (CPU) and CUDA graph (GPU) forms of the plan tried where they apply.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from fusegraph.dtypes import DataType
from fusegraph.engines.base import EngineConfig, ExecutionPlan
from fusegraph.engines.cuda_plan import GRAD_REFUSAL
from fusegraph.engines.expanded_copy import copy_strided
from fusegraph.engines.torch import frozen, steps
from fusegraph.engines.torch import fusion as torch_fusion
from fusegraph.engines.torch import onednn_graph as torch_onednn_graph
from fusegraph.engines.torch.compiled import as_declared, compile_graph, compiled_strides
from fusegraph.engines.torch.context import _TENSOR_CORE_OPS, _Ctx
from fusegraph.engines.torch.convert import (
    _VIEW_AS,
    Tensor,
    _host_result,
    _is_buffer,
    _torch,
    _torch_device,
    buffer_to_torch,
    from_numpy,
    to_numpy_into,
    torch_dtype,
    torch_to_buffer,
)
from fusegraph.engines.torch.cuda_graph import CudaGraphs, worth_capturing
from fusegraph.engines.torch.function import _graph_function, _node_thunk
from fusegraph.engines.torch.lean import LeanCall
from fusegraph.engines.torch.onednn_graph import ONEDNN_GRAPH_DEFAULT
from fusegraph.errors import ExecutionError, VariantPackError
from fusegraph.graph import layout
from fusegraph.graph.graph import Graph
from fusegraph.graph.tensor import TensorAttr
from fusegraph.runtime.handle import Handle
from fusegraph.runtime.variant_pack import ResolvedPack, check_array, check_no_alias, resolve_pack

log = logging.getLogger("fusegraph.engines.torch")

_NO_FLAGS = contextlib.nullcontext()


class TorchPlan(LeanCall, CudaGraphs, frozen.FrozenCpu, ExecutionPlan):
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
        self._tf32 = bool(config.get("tf32", False))
        self._threads = int(config.get("threads", 0))
        self._has_flags = handle.device.is_gpu or bool(self._threads)  # else _flags() sets nothing
        # On a GPU the numerics flags (TF32 and reduced-precision reductions off,
        # cudnn.benchmark) change only convolutions, matmuls and attention: other graphs skip
        # setting and restoring them (~10 us a call).
        self._numerics = handle.device.is_gpu and any(n.kind in _TENSOR_CORE_OPS for n in graph.nodes)
        self._capture_knob = config.get("cuda_graph", "auto")
        self._cuda_graph = False  # decided by _decide_capture once the activations are known
        # On the CPU, once weights are bound: the candidates tried on the first call (frozen.py:
        # AOTInductor, Inductor; the oneDNN Graph bridge first only where its knob asks).
        self._cpu_chain: tuple[str, ...] = () if handle.device.is_gpu or self._compiled else frozen.plan_chain(
            graph, config,
            bool(config.get("onednn_graph", ONEDNN_GRAPH_DEFAULT))
            and torch_onednn_graph.available()
            and torch_fusion.has_fused_convs(graph),
        )
        self._cpu_path = "eager"  # what runs the plan once the chain is settled
        self._cpu_attempts: list[frozen.Attempt] = []
        self._llga_on = bool(self._cpu_chain)
        self._llga: Any = None  # the frozen, fused function (compiled or oneDNN Graph's), once built
        self._llga_bound: Any = None  # the bindings it was traced with
        self._llga_fresh: frozenset[str] = frozenset()  # its outputs allocated anew on every call
        self._hot_in: list[tuple[Any, ...]] | None = None  # see _run_hot
        self._hot_out: list[tuple[str, TensorAttr, bool]] = []
        self._dense: dict[str, Tensor] = {}  # bound inputs before any oneDNN reordering
        self._graph: tuple[Any, dict[str, Tensor], dict[str, Tensor]] | None = None
        self._graph_bound: Any = None  # the bindings the graph was captured with
        self._graph_lock = threading.Lock()  # one replay (copy in, replay, copy out) at a time
        self._graph_stream: int | None = None  # the raw stream replays run on (the capturing call's)
        self.fusions: dict[str, steps.Step] = (
            {} if self._compiled else torch_fusion.plan_steps(graph, onednn=self._ctx.onednn)
        )
        self._bound: dict[str, tuple[Any, Tensor]] = {}  # bound input -> (its value, torch form)
        self._bound_src: dict[str, Any] = {}  # bound input -> its value as bound
        self._fn = _graph_function(graph, self._ctx, self.device, self.fusions)
        self._positional: Any = None  # the compiled function: positional tensors in, a list out
        self._strides: dict[str, tuple[int, ...]] = {}  # the strides it is specialized to
        self._lean_init()
        self._inputs = graph.inputs()
        self._outputs = graph.outputs()
        self._in_by_name = {t.name: t for t in self._inputs}
        self._in_names = [t.name for t in self._inputs]
        self._acts = list(self._inputs)  # the inputs not bound (all, until bind_constants)
        self._act_names = [t.name for t in self._acts]
        self._bound_buffers, self._bound_host = False, True
        self._out_names = [t.name for t in self._outputs]
        self._out_by_name = {t.name: t for t in self._outputs}
        if self._compiled:
            self._warm_compile()
        self._decide_capture()
        self._lean_spec()

    def _decide_capture(self) -> None:
        gpu = self.handle.device.is_gpu and not self._compiled
        knob = self._capture_knob
        self._cuda_graph = gpu and (worth_capturing(self.graph, self._acts) if knob == "auto" else bool(knob))

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
        if not self._numerics:
            with torch.cuda.device(self.device):
                yield
            return
        saved = (
            torch.backends.cudnn.benchmark,
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.allow_tf32,
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        )
        torch.backends.cudnn.benchmark = self._benchmark
        # Without benchmarking, cuDNN's deterministic choice: PyTorch caches the algorithm a
        # shape first ran with under a key that holds ``deterministic`` but not ``benchmark``, so
        # a heuristic pick made first would otherwise be what every benchmarking plan of that
        # shape runs for the rest of the process.
        torch.backends.cudnn.deterministic = saved[1] or not self._benchmark
        torch.backends.cudnn.allow_tf32 = self._tf32
        torch.backends.cuda.matmul.allow_tf32 = self._tf32
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        try:
            with torch.cuda.device(self.device):
                yield
        finally:
            (
                torch.backends.cudnn.benchmark,
                torch.backends.cudnn.deterministic,
                torch.backends.cudnn.allow_tf32,
                torch.backends.cuda.matmul.allow_tf32,
                torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
            ) = saved

    def _warm_compile(self) -> None:
        """Compiles now (build time): the graph function traced on tensors laid out as it will
        be called with, compiled by Inductor (compiled.py: no per-call guards)."""
        torch = self._torch
        self._strides = {t.name: compiled_strides(t) for t in self._inputs}
        example = []
        for t in self._inputs:
            x = torch.empty_strided(t.shape, self._strides[t.name], dtype=torch_dtype(t.dtype), device=self.device)
            x.copy_(torch.ones(t.shape, dtype=x.dtype) if t.dtype != DataType.BOOLEAN else torch.ones(t.shape, dtype=torch.bool))
            example.append(x)
        # On a GPU Inductor tunes its reduction and pointwise kernels' block sizes by
        # coordinate descent: 0.1-0.3 s more per build for 10-17% on 8192x4096 softmax and
        # pointwise chains (H100, against the untuned compile; max-autotune gave 1-4% more
        # for 2-4 s).
        options = {"coordinate_descent_tuning": True} if self.handle.device.is_gpu else None
        # what the lowering traces or Inductor compiles differently: a compile (and a cached
        # package) of its own
        variant = (("fp32_matmul", "bf16x3") if self._ctx.split_fp32 else ()) + (
            ("memory_format", self._ctx.memory_format) if self._ctx.memory_format != "auto" else ()
        ) + (("tf32", True) if self._tf32 else ())
        with self._flags():
            self._positional = compile_graph(
                self.graph, self._fn, [t.name for t in self._inputs], self._out_names, example, options, variant,
            )
        positional, strides, inputs, out_names = self._positional, self._strides, self._inputs, self._out_names

        def call(values: dict[str, Tensor]) -> dict[str, Tensor]:
            xs = [as_declared(t, values[t.name], strides[t.name]) for t in inputs]
            return dict(zip(out_names, positional(*xs), strict=True))

        self._fn = call

    # -- the lean call: torch tensors in, torch tensors out ---------------------------------
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
            if value.requires_grad and torch.is_grad_enabled():
                raise VariantPackError(GRAD_REFUSAL.format(what=what), tensor=t.name)
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
                return copy_strided(self._torch.empty_strided(t.shape, t.strides, dtype=x.dtype, device=self.device), x)
            return x.to(self.device, non_blocking=False) if self.device.type != "cpu" else x
        if _is_buffer(value):
            return buffer_to_torch(value, t)
        return value

    def persist(self) -> str:
        """A ``compile=True`` plan's compiled code packaged for later processes (compiled.persist)."""
        if self._positional is None:
            return ""
        from fusegraph.engines.torch.compiled import persist

        with self._flags():
            return persist(self._positional)

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
        self._decide_capture()
        self._lean_spec()
        return True

    def _prepack(self) -> None:
        """Bound conv filters in oneDNN's blocked layout, for the eager fused path."""
        packable = {
            fc.conv.inputs["w"].name: fc.conv for fc in self.fusions.values() if isinstance(fc, steps.FusedConv)
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
                    bound[name] = (src, steps.pack_filter(conv, self._dense[name]))
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
            elif isinstance(key, TensorAttr) and key.belongs_to(self.graph):
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
        if outputs:
            check_no_alias(outputs, inputs)  # as resolve_pack does: no output over an input
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
        if self._lean is not None:
            lean = self._run_lean(variant_pack)
            if lean is not None:
                return lean
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
        # a replay's captured buffers serve one call at a time, through its outputs' copies
        with self._graph_lock if self._cuda_graph else _NO_FLAGS:
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
                x = copy_strided(torch.empty_strided(shape, strides, dtype=tdtype), x)
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
        why = self._settle_cpu_path(pack, acts, values)
        if why:
            log.warning("graph '%s': every CPU path refused, running eagerly (%s)", self.graph.name, why)
            self._llga_on = False
            self._llga = None
            self._prepack()  # the eager path's filters, skipped while the traced one was expected
            self._lean_spec()
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
            d["onednn_graph"] = self._llga is not None and self._cpu_path == "onednn_graph"
            d["cpu_path"] = self._cpu_path
            d["cpu_path_attempts"] = [a.describe() for a in self._cpu_attempts]
        if self.fusions:
            d["fused_steps"] = [fc.describe() for fc in self.fusions.values()]
            d["prepacked_filters"] = len(self._bound)
        return d
