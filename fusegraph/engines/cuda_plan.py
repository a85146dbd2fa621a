"""Execution plans whose kernels take torch CUDA tensors (the cuDNN and Triton engines):
the variant-pack contract they share, kept in one place so both check and convert a pack
the same way.

``execute`` takes torch CUDA tensors (the fast path), DLPack objects, fusegraph Buffers or
NumPy arrays; it runs on the caller's current CUDA stream, allocates nothing but the
outputs the caller did not pass, and never synchronizes. Results come back as the kind
of the inputs: NumPy if every input was NumPy, Buffers if any was a Buffer, else tensors.
A subclass supplies ``_run(inputs, results)``: the launch on checked device tensors.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

import numpy as np

from fusegraph.dtypes import DataType
from fusegraph.engines.base import EngineConfig, ExecutionPlan
from fusegraph.engines.expanded_copy import copy_strided
from fusegraph.errors import ExecutionError, FusegraphError, VariantPackError
from fusegraph.graph import layout
from fusegraph.graph.graph import Graph
from fusegraph.graph.tensor import TensorAttr
from fusegraph.runtime.handle import Handle

_DL_CUDA = 2

# Plans run without recording gradients (the torch engine under torch.inference_mode): a
# tensor that wants them would come back detached and fail later in backward() with
# PyTorch's generic error, so it is refused here, pointing to what can differentiate.
GRAD_REFUSAL = (
    "{what} has requires_grad=True, but a fusegraph plan does not record gradients (its result "
    "would come back detached): train through fusegraph.torch (its autograd functions, or "
    "torch.compile(model, backend=\"fusegraph\")), or pass tensor.detach() / run under torch.no_grad()"
)


def torch_dtype(torch: Any, dt: DataType) -> Any:
    return {
        DataType.HALF: torch.float16, DataType.BFLOAT16: torch.bfloat16, DataType.FLOAT: torch.float32,
        DataType.DOUBLE: torch.float64, DataType.INT8: torch.int8, DataType.UINT8: torch.uint8,
        DataType.INT32: torch.int32, DataType.INT64: torch.int64, DataType.BOOLEAN: torch.bool,
        DataType.FP8_E4M3: torch.float8_e4m3fn, DataType.FP8_E5M2: torch.float8_e5m2,
    }[dt]


def _is_buffer(value: Any) -> bool:
    cls = type(value)
    return cls.__name__ == "Buffer" and cls.__module__ == "fusegraph.runtime.buffer"


class CudaTensorPlan(ExecutionPlan):
    """See the module docstring."""

    def __init__(self, graph: Graph, handle: Handle, config: EngineConfig, *, torch: Any) -> None:
        super().__init__(graph, handle, config)
        self._torch = torch
        self.device = torch.device("cuda", handle.device.index)
        self._index = handle.device.index
        self._inputs = graph.inputs()
        self._outputs = graph.outputs()
        self._in = {t.name: t for t in self._inputs}
        self._out = {t.name: t for t in self._outputs}
        self._tdt = {t.name: torch_dtype(torch, t.dtype) for t in [*self._inputs, *self._outputs]}
        self._in_spec = [(n, t.shape, tuple(t.strides), self._tdt[n]) for n, t in self._in.items()]
        self._out_spec = [(n, t.shape, tuple(t.strides), self._tdt[n]) for n, t in self._out.items()]
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    @abc.abstractmethod
    def _run(self, inputs: Mapping[str, Any], results: Mapping[str, Any]) -> None:
        """Launches on checked device tensors, on the current stream."""

    def current_stream(self) -> int:
        """The raw handle of the caller's current CUDA stream on the plan's GPU."""
        if self._raw_stream is not None:
            return int(self._raw_stream(self._index))
        return int(self._torch.cuda.current_stream(self._index).cuda_stream)

    # ---- binding a pack -------------------------------------------------------------------------
    def _check(self, t: TensorAttr, value: Any, what: str) -> Any:
        torch = self._torch
        if isinstance(value, torch.Tensor):
            if tuple(value.shape) != t.shape:
                raise VariantPackError(f"{what} has shape {list(value.shape)}, expected dims {t.dim}", tensor=t.name)
            if value.dtype != self._tdt[t.name]:
                raise VariantPackError(f"{what} has dtype {value.dtype}, expected {t.dtype.name}", tensor=t.name)
            if value.device != self.device:
                raise VariantPackError(f"{what} is on {value.device}, the plan runs on {self.device}", tensor=t.name)
            if value.requires_grad and torch.is_grad_enabled():
                raise VariantPackError(GRAD_REFUSAL.format(what=what), tensor=t.name)
            if value.stride() != t.strides and not layout.same_strides(t.shape, tuple(value.stride()), t.strides):
                raise VariantPackError(
                    f"{what} has strides {list(value.stride())}, the tensor declares {t.stride} (the plan reads "
                    "the declared layout): pass a tensor in that layout, e.g. .contiguous(memory_format=torch.channels_last)",
                    tensor=t.name,
                )
            return value
        if _is_buffer(value):
            return self._check(t, self._from_buffer(value, t), what)
        if isinstance(value, np.ndarray):
            return self._from_numpy(value, t)
        if hasattr(value, "__dlpack__"):
            try:
                imported = torch.from_dlpack(value)
            except Exception as exc:
                raise VariantPackError(f"{what}: DLPack import into torch failed: {exc}", tensor=t.name) from exc
            return self._check(t, imported, what)
        if hasattr(value, "__array__"):
            return self._from_numpy(np.asarray(value), t)
        raise VariantPackError(f"{what} must be a torch CUDA tensor, DLPack object, Buffer or NumPy array, got {type(value).__name__}", tensor=t.name)

    def _from_numpy(self, arr: np.ndarray, t: TensorAttr) -> Any:
        torch = self._torch
        if tuple(arr.shape) != t.shape or arr.dtype != t.dtype.numpy:
            raise VariantPackError(f"array has shape {list(arr.shape)} {arr.dtype}, expected {t.dim} {t.dtype.numpy}", tensor=t.name)
        if t.dtype == DataType.BFLOAT16:
            host = torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
        else:
            host = torch.from_numpy(np.ascontiguousarray(arr))
        return copy_strided(torch.empty_strided(t.shape, t.strides, dtype=self._tdt[t.name], device=self.device), host)

    def _from_buffer(self, buf: Any, t: TensorAttr) -> Any:
        from fusegraph.runtime.iree_hal import runtime_for

        if buf.handle.device != self.handle.device:
            raise VariantPackError(f"Buffer lives on {buf.handle.device}, the plan runs on {self.handle.device}", tensor=t.name)
        capsule = runtime_for(buf.handle).hal_device.create_dlpack_capsule(buf.view, _DL_CUDA, buf.handle.device.index)
        phys = self._torch.from_dlpack(capsule)  # dense, in memory order
        order = layout.physical_order(buf.shape, buf.strides)
        return phys.permute(tuple(order.index(a) for a in range(len(order))))

    def _to_buffer(self, value: Any, t: TensorAttr) -> Any:
        from fusegraph.runtime.buffer import Buffer
        from fusegraph.runtime.iree_hal import runtime_for

        dense = value.permute(layout.physical_order(t.shape, t.strides)).contiguous()
        rt = runtime_for(self.handle)
        return Buffer(rt.import_dlpack(dense), self.handle, rt, tuple(t.shape), tuple(t.strides), t.dtype, alias=True, keep=dense)

    def stage(self, variant_pack: Mapping[Any, Any]) -> dict[str, Any]:
        """The pack's inputs as CUDA tensors in the declared layouts (timing without copies)."""
        out = {}
        for key, value in variant_pack.items():
            name = key.name if isinstance(key, TensorAttr) else str(key)
            t = self._in.get(name)
            if t is not None:
                out[name] = self._check(t, value, "input")
        return out

    def synchronize(self) -> None:
        self._torch.cuda.synchronize(self.device)

    def execute(self, variant_pack: Mapping[Any, Any]) -> dict[str, Any]:
        try:
            fast = self._execute_fast(variant_pack) if type(variant_pack) is dict else None
            if fast is not None:
                return fast
            return self._execute_general(variant_pack)
        except FusegraphError:
            raise
        except Exception as exc:  # whatever torch or the library raised: typed, naming graph and engine
            raise ExecutionError(f"{self.config.engine} plan for graph '{self.graph.name}' failed: "
                                 f"{type(exc).__name__}: {exc}") from exc

    def _execute_fast(self, pack: dict[Any, Any]) -> dict[str, Any] | None:
        """Torch CUDA tensors keyed by name, in the declared layouts, outputs not given:
        checked with one comparison each, launched through the pointer array. None sends
        anything else to the general path (which raises the precise error)."""
        n_in = len(self._in_spec)
        if len(pack) != n_in and len(pack) != n_in + len(self._out_spec):
            return None
        torch = self._torch
        tensor = torch.Tensor
        index = self._index
        inputs = {}
        for name, shape, strides, dt in self._in_spec:
            v: Any = pack.get(name)
            if type(v) is not tensor or v.dtype is not dt or v.shape != shape or v.stride() != strides or not v.is_cuda or v.get_device() != index:
                return None
            if v.requires_grad:  # the general path refuses it where gradients are recorded
                return None
            inputs[name] = v
        if len(pack) == n_in:
            results = {name: torch.empty_strided(shape, strides, dtype=dt, device=self.device) for name, shape, strides, dt in self._out_spec}
            self._run(inputs, results)
            return results
        given = {}
        for name, shape, strides, dt in self._out_spec:  # every output given: written in place
            v = pack.get(name)
            if type(v) is not tensor or v.dtype is not dt or v.shape != shape or v.stride() != strides or not v.is_cuda or v.get_device() != index:
                return None
            given[name] = v
        self._run(inputs, given)
        return {}

    def _execute_general(self, variant_pack: Mapping[Any, Any]) -> dict[str, Any]:
        if not isinstance(variant_pack, Mapping):
            raise VariantPackError(f"the variant pack must be a mapping, got {type(variant_pack).__name__}")
        torch = self._torch
        inputs: dict[str, Any] = {}
        given: dict[str, Any] = {}
        host = True
        buffers = False
        for key, value in variant_pack.items():
            if type(key) is str:
                name = key
            elif isinstance(key, TensorAttr):
                if not key.belongs_to(self.graph):
                    raise VariantPackError("tensor belongs to another graph", tensor=key.name)
                name = key.name
            else:
                raise VariantPackError(f"variant pack keys must be TensorAttr or names, got {type(key).__name__}")
            t = self._in.get(name)
            if t is not None:
                host = host and isinstance(value, np.ndarray)
                buffers = buffers or _is_buffer(value)
                inputs[name] = self._check(t, value, "input")
                continue
            t = self._out.get(name)
            if t is None:
                raise VariantPackError("not an input or output of the graph (virtual tensors have no buffer)", tensor=name)
            given[name] = value
        if len(inputs) != len(self._in):
            missing = [n for n in self._in if n not in inputs]
            raise VariantPackError(f"missing input(s) {missing}", tensor=missing[0])
        results: dict[str, Any] = {}
        writeback: list[tuple[Any, Any, TensorAttr]] = []
        for name, t in self._out.items():
            value = given.get(name)
            if value is not None and isinstance(value, torch.Tensor):
                results[name] = self._check(t, value, "output")
                continue
            dev = torch.empty_strided(t.shape, t.strides, dtype=self._tdt[name], device=self.device)
            results[name] = dev
            if value is not None:
                writeback.append((value, dev, t))
        self._run(inputs, results)
        for value, dev, t in writeback:
            if isinstance(value, np.ndarray):
                _into_numpy(torch, dev, value, t)
            elif _is_buffer(value):
                self._from_buffer(value, t).copy_(dev)
            else:
                raise VariantPackError(f"output must be a torch CUDA tensor, Buffer or NumPy array, got {type(value).__name__}", tensor=t.name)
        out: dict[str, Any] = {}
        for name, t in self._out.items():
            if name in given:
                continue
            dev = results[name]
            if host:
                arr = layout.empty_strided(t.shape, t.strides, t.dtype.numpy)
                _into_numpy(torch, dev, arr, t)
                out[name] = arr
            elif buffers:
                out[name] = self._to_buffer(dev, t)
            else:
                out[name] = dev
        return out


def _into_numpy(torch: Any, dev: Any, arr: np.ndarray, t: TensorAttr) -> None:
    src = dev.detach().cpu()
    if t.dtype == DataType.BFLOAT16:
        arr[...] = src.view(torch.int16).numpy().view(arr.dtype)
    else:
        arr[...] = src.numpy()
