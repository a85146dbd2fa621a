"""A built cuDNN execution plan: one cuDNN graph, its workspace, and the per-call binding.

``execute`` takes torch CUDA tensors (the fast path), DLPack objects, fusegraph Buffers or
NumPy arrays; it runs on the caller's current CUDA stream, allocates nothing but the
outputs the caller did not pass, and never synchronizes. Results come back as the kind
of the inputs: NumPy if every input was NumPy, Buffers if any was a Buffer, else tensors.
"""

from __future__ import annotations

import ctypes
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
        self.plan_count = 0  # how many plans cuDNN ranked for the graph (the plan_index knob's range)
        self.device = torch.device("cuda", handle.device.index)
        ws = int(cudnn_graph.get_workspace_size())
        self._ws_size = ws
        self._ws = torch.empty(max(ws, 1), dtype=torch.uint8, device=self.device)  # once per plan
        self._ws_ptr = int(self._ws.data_ptr())
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
        self._index = handle.device.index
        self._in_spec = [(n, t.shape, tuple(t.strides), self._tdt[n]) for n, t in self._in.items()]
        self._out_spec = [(n, t.shape, tuple(t.strides), self._tdt[n]) for n, t in self._out.items()]
        self._raw = _RawLaunch.make(cudnn_graph, cudnn_handle, binding, {**self._prep_bufs, **self._scalars})
        self.raw_launch = self._raw is not None  # the frontend's pointer-array entry (else its public execute)

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
        fast = self._execute_fast(variant_pack) if type(variant_pack) is dict else None
        if fast is not None:
            return fast
        return self._execute_general(variant_pack)

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
        try:
            stream = _current_stream(torch, self._index)
            if self._raw is not None:
                self._raw.launch(cudnn, stream, inputs, results, self._ws_ptr)
                return
            cudnn.set_stream(handle=self._h, stream=stream)
            uid = self._uid
            buffers = [*(inputs[n] for n in self._in), *(results[n] for n in self._out)]
            uids = [*(uid[n] for n in self._in), *(uid[n] for n in self._out)]
            for u, s in self._scalars.items():
                buffers.append(s)
                uids.append(u)
            for u, b in self._prep_bufs.items():
                buffers.append(b)
                uids.append(u)
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

    def use_public_execute(self) -> None:
        """Launch through the frontend's public ``execute`` from now on (tests compare the two)."""
        self._raw = None
        self.raw_launch = False

    # ---- persistence ------------------------------------------------------------------------------
    def serialize(self) -> bytes | None:
        """The graph (JSON), the config and cuDNN's own serialized plan, in one blob."""
        try:
            blob = bytes(self._g.serialize(as_bytes=True))
        except Exception:
            return None
        head = json.dumps({"graph": self.graph.to_json(), "config": self.config.as_dict(), "plan_name": self.plan_name,
                           "plan_count": self.plan_count}).encode()
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


def _current_stream(torch: Any, index: int) -> int:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


class _RawLaunch:
    """The frontend's own launch entry, ``_execute_with_raw_ptrs``: a ``void*[]`` of device
    pointers in the backend's ascending-uid operand order, the workspace, the cuDNN handle
    and the plan index -- what its public ``execute`` reaches after normalizing a pack, minus
    the normalizing (fusegraph has checked every tensor already). Private API, so it is
    looked up once per plan and the public ``execute`` is used where it is missing."""

    def __init__(self, lowered: Any, handle: Any, slots: list[tuple[str, int]], fixed: list[tuple[int, int]], n: int, index: int) -> None:
        self._lowered, self._handle = lowered, handle
        self._backend = int(handle.backend_handle)
        self._slots = slots  # (tensor name, slot) for inputs and outputs
        self._fixed = fixed  # (slot, pointer) of the plan's own device buffers
        self._n = n
        self._index = index

    @classmethod
    def make(cls, g: Any, handle: Any, binding: Binding, own: Mapping[int, Any]) -> _RawLaunch | None:
        """``own``: uid -> the plan's own buffers (device preps; host pass-by-value scalars,
        whose host pointer cuDNN reads at launch), listed where the backend asks for them."""
        try:
            lowered = g.__dict__.get("_lowered_graph")
            if lowered is None or not hasattr(lowered, "_execute_with_raw_ptrs") or getattr(handle, "backend_handle", None) is None:
                return None
            lowered._prepare_variant_pack_template()
            order = [int(u) for u in lowered._get_variant_pack_uids_sorted()]
            slot = {u: i for i, u in enumerate(order)}
            slots = [(name, slot[uid]) for name, uid in binding.uids.items()]
            fixed = [(slot[uid], int(buf.data_ptr())) for uid, buf in own.items() if uid in slot]
            if len(slots) + len(fixed) != len(order):
                return None  # operands fusegraph does not know of: leave it to execute()
            plans = getattr(g, "_plans", None) or []
            idx = getattr(g, "_plan_index", 0)
            cpp = plans[idx].cpp_index if plans and 0 <= idx < len(plans) else None
            return cls(lowered, handle, slots, fixed, len(order), -1 if cpp is None else int(cpp))
        except Exception:
            return None

    def launch(self, cudnn: Any, stream: int, inputs: Mapping[str, Any], results: Mapping[str, Any], ws_ptr: int) -> None:
        cudnn.set_stream(handle=self._handle, stream=stream)
        ptrs = (ctypes.c_void_p * self._n)()
        for name, i in self._slots:
            v = inputs.get(name)
            ptrs[i] = (v if v is not None else results[name]).data_ptr()
        for i, p in self._fixed:
            ptrs[i] = p
        self._lowered._execute_with_raw_ptrs(ctypes.addressof(ptrs), self._n, ws_ptr, self._backend, self._index)
