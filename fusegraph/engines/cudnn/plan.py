"""A built cuDNN execution plan: one cuDNN graph, its workspace, and the per-call binding.

``execute`` takes torch CUDA tensors (the fast path), DLPack objects, fusegraph Buffers or
NumPy arrays; it runs on the caller's current CUDA stream, allocates nothing but the
outputs the caller did not pass, and never synchronizes. Results come back as the kind
of the inputs: NumPy if every input was NumPy, Buffers if any was a Buffer, else tensors.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from fusegraph.dtypes import DataType
from fusegraph.engines.base import EngineConfig, ExecutionPlan
from fusegraph.engines.cudnn.lower import Binding, Prep
from fusegraph.errors import ExecutionError, VariantPackError
from fusegraph.graph import layout
from fusegraph.graph.graph import Graph
from fusegraph.graph.tensor import TensorAttr
from fusegraph.runtime.handle import Handle

MAGIC = b"FGCUDNN1"
_DL_CUDA = 2


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


class CudnnPlan(ExecutionPlan):
    """One cuDNN graph with a built plan (see the module docstring)."""

    def __init__(
        self,
        graph: Graph,
        handle: Handle,
        config: EngineConfig,
        *,
        cudnn: Any,
        torch: Any,
        cudnn_handle: Any,
        cudnn_graph: Any,
        binding: Binding,
        plan_name: str = "",
        loaded: bool = False,
    ) -> None:
        super().__init__(graph, handle, config)
        self._cudnn, self._torch = cudnn, torch
        self._h = cudnn_handle
        self._g = cudnn_graph
        self.binding = binding
        self.plan_name = plan_name
        self.loaded = loaded  # rebuilt from serialized bytes (no heuristics, no compilation)
        self.device = torch.device("cuda", handle.device.index)
        ws = int(cudnn_graph.get_workspace_size())
        self._ws_size = ws
        self._ws = torch.empty(max(ws, 1), dtype=torch.uint8, device=self.device)  # once per plan
        self._inputs = graph.inputs()
        self._outputs = graph.outputs()
        self._in = {t.name: t for t in self._inputs}
        self._out = {t.name: t for t in self._outputs}
        self._tdt = {t.name: torch_dtype(torch, t.dtype) for t in [*self._inputs, *self._outputs]}
        # pass-by-value constants: host tensors cuDNN reads at launch
        self._scalars = {
            uid: torch.full([1] * binding.rank, value, dtype=torch_dtype(torch, dt)) for uid, (value, dt) in binding.scalars.items()
        }
        self._prep_bufs: dict[int, Any] = {}
        self._prep_key: dict[str, tuple[Any, ...]] = {}
        for p in binding.preps:
            for uid in (p.uid_a, p.uid_b):
                self._prep_bufs[uid] = torch.empty(p.dims, dtype=torch.float32, device=self.device)
        self._uid = binding.uids
        self._ordered: bool | None = None  # execute(..., tensor_uids=): decided on the first call

    @property
    def workspace_size(self) -> int:
        return self._ws_size

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
            if value.stride() != t.strides and not layout.same_strides(t.shape, tuple(value.stride()), t.strides):
                raise VariantPackError(
                    f"{what} has strides {list(value.stride())}, the tensor declares {t.stride} (cuDNN reads the "
                    "declared layout): pass a tensor in that layout, e.g. .contiguous(memory_format=torch.channels_last)",
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
        dev = torch.empty_strided(t.shape, t.strides, dtype=self._tdt[t.name], device=self.device)
        dev.copy_(host)
        return dev

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

    def _prep(self, inputs: Mapping[str, Any]) -> None:
        """Batchnorm inference's per-channel scale and shift, recomputed only when one of
        its four inputs is another tensor or was written since (torch's version counter)."""
        for p in self.binding.preps:
            vals = [inputs[n] for n in (p.scale, p.bias, p.mean, p.var)]
            key = tuple((id(v), v.data_ptr(), v._version) for v in vals)
            if self._prep_key.get(p.node) == key:
                continue
            _fill_prep(self._torch, p, vals, self._prep_bufs[p.uid_a], self._prep_bufs[p.uid_b])
            self._prep_key[p.node] = key

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
                if key.graph is not self.graph:
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

    def _run(self, inputs: Mapping[str, Any], results: Mapping[str, Any]) -> None:
        torch, cudnn = self._torch, self._cudnn
        if self.binding.preps:
            self._prep(inputs)
        uid = self._uid
        buffers = [*(inputs[n] for n in self._in), *(results[n] for n in self._out)]
        uids = [*(uid[n] for n in self._in), *(uid[n] for n in self._out)]
        for u, s in self._scalars.items():
            buffers.append(s)
            uids.append(u)
        for u, b in self._prep_bufs.items():
            buffers.append(b)
            uids.append(u)
        try:
            cudnn.set_stream(handle=self._h, stream=torch.cuda.current_stream(self.device).cuda_stream)
            if self._ordered is not False:
                try:
                    self._g.execute(tuple(buffers), self._ws, handle=self._h, tensor_uids=tuple(uids))
                    self._ordered = True
                    return
                except (TypeError, ValueError, AttributeError):
                    if self._ordered:
                        raise
                    self._ordered = False  # a frontend without the ordered form: the mapping form
            self._g.execute(dict(zip(uids, buffers, strict=True)), self._ws, handle=self._h)
        except VariantPackError:
            raise
        except Exception as exc:
            raise ExecutionError(f"cuDNN plan for graph '{self.graph.name}' failed: {type(exc).__name__}: {exc}") from exc

    # ---- persistence ------------------------------------------------------------------------------
    def serialize(self) -> bytes | None:
        """The graph (JSON), the config and cuDNN's own serialized plan, in one blob."""
        try:
            blob = bytes(self._g.serialize(as_bytes=True))
        except Exception:
            return None
        head = json.dumps({"graph": self.graph.to_json(), "config": self.config.as_dict(), "plan_name": self.plan_name}).encode()
        return MAGIC + struct.pack("<Q", len(head)) + head + blob

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update({"cudnn_plan": self.plan_name, "workspace": self._ws_size, "loaded": self.loaded})
        return d


def split_blob(data: bytes) -> tuple[dict[str, Any], bytes]:
    if not data.startswith(MAGIC):
        raise ValueError("not a serialized fusegraph cuDNN plan")
    (n,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    head = json.loads(data[start:start + n].decode())
    return head, data[start + n:]


def _fill_prep(torch: Any, p: Prep, vals: list[Any], a: Any, b: Any) -> None:
    scale, bias, mean, var = (v.reshape(-1).to(torch.float32) for v in vals)
    inv = torch.rsqrt(var + p.epsilon) * scale
    a.copy_(inv.reshape(a.shape))
    b.copy_((bias - mean * inv).reshape(b.shape))


def _into_numpy(torch: Any, dev: Any, arr: np.ndarray, t: TensorAttr) -> None:
    src = dev.detach().cpu()
    if t.dtype == DataType.BFLOAT16:
        arr[...] = src.view(torch.int16).numpy().view(arr.dtype)
    else:
        arr[...] = src.numpy()
