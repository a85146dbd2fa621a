"""A built cuDNN execution plan: one cuDNN graph, its workspace, and the per-call launch
(the variant-pack contract is engines/cuda_plan.py's)."""

from __future__ import annotations

import ctypes
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
        self._raw = _RawLaunch.make(cudnn_graph, cudnn_handle, binding, {**self._prep_bufs, **self._scalars})
        self.raw_launch = self._raw is not None  # the frontend's pointer-array entry (else its public execute)

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

    def _run(self, inputs: Mapping[str, Any], results: Mapping[str, Any]) -> None:
        cudnn = self._cudnn
        if self.binding.preps:
            self._prep(inputs)
        try:
            stream = self.current_stream()
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
