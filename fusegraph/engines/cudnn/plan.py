"""A built cuDNN execution plan: one cuDNN graph, its workspace, and the per-call launch
(the variant-pack contract is engines/cuda_plan.py's)."""

from __future__ import annotations

import ctypes
import functools
import json
import struct
from collections.abc import Mapping
from typing import Any

from fusegraph.engines.base import EngineConfig
from fusegraph.engines.cuda_plan import CudaTensorPlan, torch_dtype
from fusegraph.engines.cudnn.lower import Binding, Prep
from fusegraph.errors import ExecutionError, VariantPackError
from fusegraph.graph.graph import Graph
from fusegraph.runtime.handle import Handle

MAGIC = b"FGCUDNN1"


class CudnnPlan(CudaTensorPlan):
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
        stream_cell: list[int | None] | None = None,
    ) -> None:
        super().__init__(graph, handle, config, torch=torch)
        self._cudnn = cudnn
        self._h = cudnn_handle
        self._g = cudnn_graph
        self.binding = binding
        self.plan_name = plan_name
        self.loaded = loaded  # rebuilt from serialized bytes (no heuristics, no compilation)
        self.plan_count = 0  # how many plans cuDNN ranked for the graph (the plan_index knob's range)
        ws = int(cudnn_graph.get_workspace_size())
        self._ws_size = ws
        self._ws = torch.empty(max(ws, 1), dtype=torch.uint8, device=self.device)  # once per plan
        self._ws_ptr = int(self._ws.data_ptr())
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
        self._stream_cell: list[int | None] = stream_cell if stream_cell is not None else [None]
        self._raw = _RawLaunch.make(cudnn, cudnn_graph, cudnn_handle, binding, {**self._prep_bufs, **self._scalars},
                                    self._ws_ptr, self._stream_cell)
        self.raw_launch = self._raw is not None  # the frontend's pointer-array entry (else its public execute)
        # the fast call's plan of work (_execute_fast): each input's check and pointer slot,
        # each output's allocation (settled once: torch.empty_strided with its arguments)
        slot = self._raw.slot if self._raw is not None else {}
        self._fast_in = [(n, shape, strides, dt, slot.get(n, -1)) for n, shape, strides, dt in self._in_spec]
        self._fast_out = [(n, shape, strides, dt, slot.get(n, -1)) for n, shape, strides, dt in self._out_spec]
        self._fast_alloc = [
            (n, functools.partial(torch.empty_strided, shape, strides, dtype=dt, device=self.device), slot.get(n, -1))
            for n, shape, strides, dt in self._out_spec
        ]
        self._n_in, self._n_out = len(self._in_spec), len(self._out_spec)
        self._tensor = torch.Tensor

    @property
    def workspace_size(self) -> int:
        return self._ws_size

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

    def _execute_fast(self, pack: dict[Any, Any]) -> dict[str, Any] | None:
        """The common call in one frame: torch CUDA tensors keyed by name in the declared
        layouts, outputs all given or none. Each tensor is checked (type, dtype, shape,
        strides, device) and its pointer written straight into the launch's pointer array;
        outputs not given are allocated; the stream is set on the handle only when the
        caller's differs from the last one set. None sends anything else to the general
        path, which raises the precise error."""
        raw = self._raw
        if raw is None or self.binding.preps:
            return super()._execute_fast(pack)
        n = len(pack)
        if n != self._n_in and n != self._n_in + self._n_out:
            return None
        tensor = self._tensor
        index = self._index
        ptrs = raw.ptrs
        for name, shape, strides, dt, slot in self._fast_in:
            v: Any = pack.get(name)
            if type(v) is not tensor or v.dtype is not dt or v.shape != shape or v.stride() != strides or not v.is_cuda or v.get_device() != index:
                return None
            ptrs[slot] = v.data_ptr()
        results: dict[str, Any] = {}
        if n == self._n_in:
            for name, alloc, slot in self._fast_alloc:
                v = results[name] = alloc()
                ptrs[slot] = v.data_ptr()
        else:  # every output given: written in place, nothing returned
            for name, shape, strides, dt, slot in self._fast_out:
                v = pack.get(name)
                if type(v) is not tensor or v.dtype is not dt or v.shape != shape or v.stride() != strides or not v.is_cuda or v.get_device() != index:
                    return None
                ptrs[slot] = v.data_ptr()
        rs = self._raw_stream
        try:
            raw.go(rs(index) if rs is not None else self.current_stream())
        except Exception as exc:
            raise ExecutionError(f"cuDNN plan for graph '{self.graph.name}' failed: {type(exc).__name__}: {exc}") from exc
        return results

    def _set_stream(self, stream: int) -> None:
        cell = self._stream_cell
        if cell[0] != stream:
            self._cudnn.set_stream(handle=self._h, stream=stream)
            cell[0] = stream

    def _run(self, inputs: Mapping[str, Any], results: Mapping[str, Any]) -> None:
        if self.binding.preps:
            self._prep(inputs)
        try:
            stream = self.current_stream()
            if self._raw is not None:
                self._raw.launch(stream, inputs, results)
                return
            self._set_stream(stream)
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


class _RawLaunch:
    """The frontend's own launch entry, ``_execute_with_raw_ptrs``: a ``void*[]`` of device
    pointers in the backend's ascending-uid operand order, the workspace, the cuDNN handle
    and the plan index -- what its public ``execute`` reaches after normalizing a pack, minus
    the normalizing (fusegraph has checked every tensor already). Private API, so it is
    looked up once per plan and the public ``execute`` is used where it is missing.

    The pointer array is the plan's own, made once with the plan's fixed buffers in their
    slots; each call writes its tensors' pointers into it and launches. cuDNN reads it
    during the call only. A plan is not to be executed from two threads at once (nor is its
    cuDNN handle, whose stream is set per launch)."""

    def __init__(self, cudnn: Any, lowered: Any, handle: Any, slot: dict[str, int], fixed: list[tuple[int, int]], n: int,
                 index: int, ws_ptr: int, stream_cell: list[int | None]) -> None:
        self._cudnn, self._handle = cudnn, handle
        self._execute = lowered._execute_with_raw_ptrs
        self._backend = int(handle.backend_handle)
        self.slot = slot  # tensor name -> its slot, for inputs and outputs
        self._n = n
        self._index = index
        self._ws = ws_ptr
        self._cell = stream_cell
        self.ptrs = (ctypes.c_void_p * n)()
        for i, p in fixed:  # the plan's own device buffers: the same on every call
            self.ptrs[i] = p
        self._addr = ctypes.addressof(self.ptrs)

    @classmethod
    def make(cls, cudnn: Any, g: Any, handle: Any, binding: Binding, own: Mapping[int, Any], ws_ptr: int,
             stream_cell: list[int | None]) -> _RawLaunch | None:
        """``own``: uid -> the plan's own buffers (device preps; host pass-by-value scalars,
        whose host pointer cuDNN reads at launch), listed where the backend asks for them."""
        try:
            lowered = g.__dict__.get("_lowered_graph")
            if lowered is None or not hasattr(lowered, "_execute_with_raw_ptrs") or getattr(handle, "backend_handle", None) is None:
                return None
            lowered._prepare_variant_pack_template()
            order = [int(u) for u in lowered._get_variant_pack_uids_sorted()]
            at = {u: i for i, u in enumerate(order)}
            slot = {name: at[uid] for name, uid in binding.uids.items()}
            fixed = [(at[uid], int(buf.data_ptr())) for uid, buf in own.items() if uid in at]
            if len(slot) + len(fixed) != len(order):
                return None  # operands fusegraph does not know of: leave it to execute()
            plans = getattr(g, "_plans", None) or []
            idx = getattr(g, "_plan_index", 0)
            cpp = plans[idx].cpp_index if plans and 0 <= idx < len(plans) else None
            return cls(cudnn, lowered, handle, slot, fixed, len(order), -1 if cpp is None else int(cpp), ws_ptr, stream_cell)
        except Exception:
            return None

    def go(self, stream: int) -> None:
        """Launches with the pointers now in ``ptrs`` on ``stream``."""
        cell = self._cell
        if cell[0] != stream:
            self._cudnn.set_stream(handle=self._handle, stream=stream)
            cell[0] = stream
        self._execute(self._addr, self._n, self._ws, self._backend, self._index)

    def launch(self, stream: int, inputs: Mapping[str, Any], results: Mapping[str, Any]) -> None:
        ptrs = self.ptrs
        for name, i in self.slot.items():
            v = inputs.get(name)
            ptrs[i] = (v if v is not None else results[name]).data_ptr()
        self.go(stream)
