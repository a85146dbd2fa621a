"""A built cuDNN execution plan: one cuDNN graph, its workspace, and the per-call launch
(the variant-pack contract is engines/cuda_plan.py's)."""

from __future__ import annotations

import atexit
import ctypes
import json
import struct
import threading
from collections.abc import Mapping
from typing import Any

from fusegraph.engines.base import EngineConfig
from fusegraph.engines.cuda_plan import CudaTensorPlan, torch_dtype
from fusegraph.engines.cudnn.rules import Binding, Prep
from fusegraph.engines.launch_replay import DEFAULT_STREAM, LaunchReplay
from fusegraph.errors import ExecutionError, VariantPackError
from fusegraph.graph.graph import Graph
from fusegraph.runtime.exit_release import ExitRelease
from fusegraph.runtime.handle import Handle

MAGIC = b"FGCUDNN1"
# the cuda_graph knob's default: "auto" replays a captured launch for repeated pointers (engines/launch_replay.py)
CUDA_GRAPH_DEFAULT = "auto"

# cuDNN's frontend is built with nanobind, which prints a page of "leaked" lines at exit for
# each frontend object still alive (seen after every benchmark whose compiled model or session
# kept cuDNN plans until exit): the plans and the engine's caches let go of those objects
# first (runtime/exit_release.py); a plan used after that raises ExecutionError saying so.
_HOLDERS = ExitRelease()
track = _HOLDERS.track
atexit.register(_HOLDERS.release)


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
        gate: HandleGate | None = None,
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
        self._home: int | None = None  # the public execute's first stream (the workspace's)
        self._gate = gate if gate is not None else HandleGate()
        self._raw = _RawLaunch.make(cudnn, torch, cudnn_graph, cudnn_handle, self._gate, binding,
                                    {**self._prep_bufs, **self._scalars}, ws, self._ws_ptr, self.device,
                                    graphs=str(config.get("cuda_graph", CUDA_GRAPH_DEFAULT)) == "auto")
        self.raw_launch = self._raw is not None  # the frontend's pointer-array entry (else its public execute)
        slot = self._raw.slot if self._raw is not None else {}
        self._fast_in = [(n, shape, strides, dt, slot.get(n, -1)) for n, shape, strides, dt in self._in_spec]
        self._fast_out = [(n, shape, strides, dt, slot.get(n, -1)) for n, shape, strides, dt in self._out_spec]
        self._n_in, self._n_out = len(self._in_spec), len(self._out_spec)
        self._tensor = torch.Tensor
        track(self)

    def _release(self) -> None:
        """Drops the frontend's objects (at exit: ``_release_at_exit``), after any launch
        in flight on the handle (launches hold its lock)."""
        with self._gate.lock:
            self._raw = None
            self.raw_launch = False
            self._g = None
            self._h = None

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
        layouts, outputs all given or none, no batchnorm scale/shift to prepare. Each tensor
        is checked (type, dtype, shape, strides, device) and its pointer put in its slot.
        None sends anything else to the general path, which raises the precise error."""
        raw = self._raw
        if raw is None or self.binding.preps:
            return super()._execute_fast(pack)
        n = len(pack)
        if n != self._n_in and n != self._n_in + self._n_out:
            return None
        tensor, index = self._tensor, self._index
        ptrs = raw.template.copy()
        for name, shape, strides, dt, slot in self._fast_in:
            v: Any = pack.get(name)
            if type(v) is not tensor or v.dtype is not dt or v.shape != shape or v.stride() != strides or not v.is_cuda or v.get_device() != index:
                return None
            if v.requires_grad:  # the general path refuses it where gradients are recorded
                return None
            ptrs[slot] = v.data_ptr()
        results: dict[str, Any] = {}
        if n == self._n_in:
            empty, device = self._torch.empty_strided, self.device
            for name, shape, strides, dt, slot in self._fast_out:
                v = results[name] = empty(shape, strides, dtype=dt, device=device)
                ptrs[slot] = v.data_ptr()
        else:  # every output given: written in place, nothing returned
            for name, shape, strides, dt, slot in self._fast_out:
                v = pack.get(name)
                if type(v) is not tensor or v.dtype is not dt or v.shape != shape or v.stride() != strides or not v.is_cuda or v.get_device() != index:
                    return None
                ptrs[slot] = v.data_ptr()
        rs = self._raw_stream
        try:
            raw.run(ptrs, int(rs(index)) if rs is not None else self.current_stream())
        except Exception as exc:
            raise ExecutionError(f"cuDNN plan for graph '{self.graph.name}' failed: {type(exc).__name__}: {exc}") from exc
        return results

    def _run(self, inputs: Mapping[str, Any], results: Mapping[str, Any]) -> None:
        cudnn = self._cudnn
        if self._g is None:
            raise ExecutionError(f"cuDNN plan for graph '{self.graph.name}' was released: the interpreter is exiting")
        if self.binding.preps:
            self._prep(inputs)
        try:
            stream = self.current_stream()
            raw = self._raw
            if raw is not None:
                ptrs = raw.template.copy()
                for name, i in raw.slot.items():
                    v = inputs.get(name)
                    ptrs[i] = (v if v is not None else results[name]).data_ptr()
                raw.run(ptrs, stream)
                return
            uid = self._uid
            buffers = [*(inputs[n] for n in self._in), *(results[n] for n in self._out)]
            uids = [*(uid[n] for n in self._in), *(uid[n] for n in self._out)]
            for u, s in self._scalars.items():
                buffers.append(s)
                uids.append(u)
            for u, b in self._prep_bufs.items():
                buffers.append(b)
                uids.append(u)
            gate = self._gate
            with gate.lock:
                if self._home is None:
                    self._home = stream
            # the plan's workspace serves its first stream; another stream's call takes one
            # from torch's caching allocator, reused only in that stream's order
            ws = self._ws if stream == self._home else self._torch.empty(max(self._ws_size, 1), dtype=self._torch.uint8, device=self.device)
            with gate.lock:  # the handle's stream, then the launch, as one step
                cudnn.set_stream(handle=self._h, stream=stream)
                gate.stream = stream
                if self._ordered is not False:
                    try:
                        self._g.execute(tuple(buffers), ws, handle=self._h, tensor_uids=tuple(uids))
                        self._ordered = True
                        return
                    except (TypeError, ValueError, AttributeError):
                        if self._ordered:
                            raise
                        self._ordered = False  # a frontend without the ordered form: the mapping form
                self._g.execute(dict(zip(uids, buffers, strict=True)), ws, handle=self._h)
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
        d.update(self._raw.replays.describe() if self._raw is not None else {"cuda_graph": "off", "cuda_graphs_captured": 0})
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


class HandleGate:
    """What the plans sharing one GPU's cuDNN handle must agree on: the handle's stream is
    state (``cudnn.set_stream`` then the launch), so setting it and launching is one step
    under ``lock``; ``stream`` is the raw stream the handle was last given, so a launch on
    the same stream skips setting it again."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stream: int | None = None


class _RawLaunch:
    """The frontend's own launch entry, ``_execute_with_raw_ptrs``: a ``void*[]`` of device
    pointers in the backend's ascending-uid operand order, the workspace, the cuDNN handle
    and the plan index -- what its public ``execute`` reaches after normalizing a pack, minus
    the normalizing (fusegraph has checked every tensor already). Private API, so it is
    looked up once per plan and the public ``execute`` is used where it is missing.

    Calls from several threads and streams at once are safe: the pointer array is written
    and read under the handle's lock (cuDNN copies it during the call), and the plan's own
    workspace serves only its first stream -- a call on another stream takes a workspace
    from torch's caching allocator for that call, which torch reuses only in that stream's
    order. Repeated pointers on the default stream replay a captured launch
    (engines/launch_replay.py; knob ``cuda_graph``)."""

    def __init__(self, cudnn: Any, torch: Any, lowered: Any, handle: Any, gate: HandleGate, slot: dict[str, int],
                 template: list[int], index: int, ws_size: int, ws_ptr: int, device: Any, graphs: bool) -> None:
        self._cudnn, self._torch, self._handle, self._gate = cudnn, torch, handle, gate
        self._execute = lowered._execute_with_raw_ptrs
        self._backend = int(handle.backend_handle)
        self.slot = slot  # tensor name -> its slot, for inputs and outputs
        self.template = template  # every slot, the plan's own buffers already in theirs
        self._n = len(template)
        self._arr = (ctypes.c_void_p * self._n)()
        self._addr = ctypes.addressof(self._arr)
        self._index = index
        self._ws_size, self._ws_ptr = ws_size, ws_ptr
        self._device = device
        self._home: int | None = None  # the first stream a call came on: its workspace is the plan's
        self.replays = LaunchReplay(torch, device, graphs)

    @classmethod
    def make(cls, cudnn: Any, torch: Any, g: Any, handle: Any, gate: HandleGate, binding: Binding, own: Mapping[int, Any],
             ws_size: int, ws_ptr: int, device: Any, graphs: bool) -> _RawLaunch | None:
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
            template = [0] * len(order)
            fixed = 0
            for uid, buf in own.items():
                if uid in at:
                    template[at[uid]] = int(buf.data_ptr())
                    fixed += 1
            if len(slot) + fixed != len(order):
                return None  # operands fusegraph does not know of: leave it to execute()
            plans = getattr(g, "_plans", None) or []
            idx = getattr(g, "_plan_index", 0)
            cpp = plans[idx].cpp_index if plans and 0 <= idx < len(plans) else None
            return cls(cudnn, torch, lowered, handle, gate, slot, template, -1 if cpp is None else int(cpp), ws_size, ws_ptr,
                       device, graphs)
        except Exception:
            return None

    def run(self, ptrs: list[int], stream: int) -> None:
        """Launches with ``ptrs`` (every slot filled) on ``stream``."""
        home = self._home
        if home is None:
            with self._gate.lock:
                home = self._home = self._home if self._home is not None else stream
        tmp = None
        replays = self.replays
        key = tuple(ptrs) if stream == DEFAULT_STREAM and stream == home and replays.on else None
        if stream == home:
            ws = self._ws_ptr
            if key is not None and replays.graphs and replays.replay(key):
                return
        elif self._ws_size:  # another stream: a workspace for this call, in that stream's order
            tmp = self._torch.empty(self._ws_size, dtype=self._torch.uint8, device=self._device)
            ws = int(tmp.data_ptr())
        else:
            ws = 0
        with self._gate.lock:
            self._launch(ptrs, ws, stream)
        if key is not None:
            replays.launched(key, lambda s: self._launch(ptrs, self._ws_ptr, s), self._gate.lock)

    def _launch(self, ptrs: list[int], ws: int, stream: int) -> None:
        """Under the handle's lock: its stream, the pointers, cuDNN's launch."""
        gate = self._gate
        if gate.stream != stream:
            self._cudnn.set_stream(handle=self._handle, stream=stream)
            gate.stream = stream
        self._arr[:] = ptrs  # type: ignore[assignment]
        self._execute(self._addr, self._n, ws, self._backend, self._index)
