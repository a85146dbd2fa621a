"""IreePlan: runs one compiled graph through IREE's runtime with little per-call work.

Everything that does not depend on the call is settled when the plan is made: the bound
VM function, each input's slot, dims, strides, type and buffer shape, and which inputs
are already dense. A call then only checks each value against its slot and hands the
buffer views over. Buffers in give Buffers out, with no host round trip; NumPy arrays
in give NumPy arrays out (aliasing the caller's dense inputs on the CPU instead of
copying them).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fusegraph.dtypes import DataType
from fusegraph.engines.base import EngineConfig, ExecutionPlan
from fusegraph.errors import ExecutionError, VariantPackError
from fusegraph.graph import layout
from fusegraph.runtime.buffer import Buffer
from fusegraph.runtime.variant_pack import check_array, check_no_alias, outputs_like, resolve_pack

if TYPE_CHECKING:
    from fusegraph.engines.iree.cache import CacheEntry
    from fusegraph.engines.iree.runtime import IreeRuntime, LoadedModule
    from fusegraph.graph.graph import Graph
    from fusegraph.graph.tensor import TensorAttr
    from fusegraph.runtime.handle import Handle

log = logging.getLogger("fusegraph.iree")


@dataclass(frozen=True)
class IoSlot:
    """One function argument or result: a graph tensor and its buffer at the boundary."""

    index: int
    name: str
    dim: tuple[int, ...]
    stride: tuple[int, ...]
    data_type: DataType
    physical_shape: tuple[int, ...]
    packed: bool  # dense in memory (else: a view with gaps, broadcast or overlap)

    @staticmethod
    def of(index: int, t: TensorAttr) -> IoSlot:
        dim, stride = tuple(t.shape), tuple(t.strides)
        return IoSlot(index, t.name, dim, stride, t.dtype, layout.physical_shape(dim, stride), layout.is_packed(dim, stride))


class IreePlan(ExecutionPlan):
    """A graph compiled by IREE and bound on a handle's device."""

    def __init__(
        self,
        graph: Graph,
        handle: Handle,
        config: EngineConfig,
        *,
        runtime: IreeRuntime,
        loaded: LoadedModule,
        entry: CacheEntry,
    ) -> None:
        super().__init__(graph, handle, config)
        from fusegraph.engines.iree.runtime import bindings, track

        rt = bindings()
        self.runtime = runtime
        self.loaded = loaded
        self.entry = entry
        meta = entry.meta
        self.inputs = tuple(IoSlot.of(i, graph.tensor_by_name(n)) for i, n in enumerate(meta["inputs"]))
        self.outputs = tuple(IoSlot.of(i, graph.tensor_by_name(n)) for i, n in enumerate(meta["outputs"]))
        # Pack keys (TensorAttr objects and names) -> (is_input, slot).
        self._slots: dict[Any, tuple[bool, IoSlot]] = {}
        for is_input, slots in ((True, self.inputs), (False, self.outputs)):
            for s in slots:
                t = graph.tensor_by_name(s.name)
                self._slots[t] = self._slots[s.name] = (is_input, s)
        self._n_in = len(self.inputs)
        self._invoke = loaded.context.invoke
        self._function = loaded.function
        self._VariantList = rt.VmVariantList
        self._BufferView = rt.HalBufferView
        self._track = track
        track(self)

    def _release(self) -> None:
        """Lets go of IREE objects (called at interpreter exit; see runtime.track)."""
        self.loaded = None  # type: ignore[assignment]
        self._invoke = self._function = None
        self.runtime = None  # type: ignore[assignment]

    # ---- info ------------------------------------------------------------------------------
    @property
    def key(self) -> str:
        return self.entry.key

    @property
    def dispatch_count(self) -> int:
        """Dispatches IREE scheduled for this graph (1 = everything fused into one kernel)."""
        return self.entry.dispatch_count

    @property
    def statistics(self) -> Mapping[str, Any]:
        return dict(self.entry.meta.get("statistics", {}))

    def describe(self) -> dict[str, Any]:
        m = self.entry.meta
        return {
            "engine": self.engine,
            "config": str(self.config),
            "target": m.get("target"),
            "flags": m.get("flags"),
            "key": self.entry.key,
            "cache": str(self.entry.path) if self.entry.path else None,
            "source": self.entry.source,
            "statistics": m.get("statistics"),
        }

    def serialize(self) -> bytes:
        from fusegraph.engines.iree.artifact import pack_artifact

        return pack_artifact(self.graph, self.entry)

    # ---- running ---------------------------------------------------------------------------
    def execute(self, variant_pack: Mapping[Any, Any], *, as_buffers: bool | None = None) -> dict[str, Any]:
        """Runs the graph; same contract as ``Graph.execute``.

        Values may be NumPy arrays or Buffers. Outputs given in the pack are written (a
        given Buffer is rebound to the result's device memory, or copied into on the
        device when it wraps someone else's memory); the others are returned as Buffers
        when any input was a Buffer (or ``as_buffers=True``), else as NumPy arrays.
        """
        if not isinstance(variant_pack, Mapping):
            raise VariantPackError(f"the variant pack must be a mapping, got {type(variant_pack).__name__}")
        views: list[Any] = [None] * self._n_in
        keep: list[np.ndarray] = []  # host arrays that views alias, alive until the call returns
        given: list[tuple[IoSlot, Any]] = []
        host_in: dict[str, Any] = {}  # the caller's host inputs, for the aliasing check
        if as_buffers is None:
            as_buffers = any(type(v) is Buffer for v in variant_pack.values())
        # Host inputs may be aliased rather than copied only when results go back to host
        # arrays: a returned Buffer must never share the caller's array memory.
        alias = not as_buffers
        slots = self._slots
        for key, value in variant_pack.items():
            hit = slots.get(key)
            if hit is None:
                self._bad_key(variant_pack)
            is_input, slot = hit  # type: ignore[misc]
            if is_input:
                if type(value) is Buffer:
                    self._check_buffer(slot, value)
                    views[slot.index] = value._view
                else:
                    views[slot.index] = self._host_input(slot, value, keep, alias)
                    host_in[slot.name] = value
            else:
                if type(value) is Buffer:
                    self._check_buffer(slot, value)
                else:
                    value = check_array(self.graph.tensor_by_name(slot.name), value, what="output")
                    if not value.flags.writeable:
                        raise VariantPackError("output array is read-only", tensor=slot.name)
                given.append((slot, value))
        if any(v is None for v in views):
            missing = [s.name for s in self.inputs if views[s.index] is None]
            raise VariantPackError(f"missing input(s) {missing}", tensor=missing[0])
        if given:
            check_no_alias({s.name: v for s, v in given}, host_in)
        results = self._run(views)
        out = self._outputs(results, given, as_buffers)
        if not as_buffers:
            out = outputs_like(out, variant_pack.values())
        del keep  # the aliased host inputs may go now that IREE is done with them
        return out

    def run_buffers(self, inputs: Sequence[Buffer]) -> list[Buffer]:
        """The leanest call: Buffers in function-argument order (``plan.inputs``), Buffers out."""
        if len(inputs) != self._n_in:
            raise VariantPackError(f"expected {self._n_in} input Buffers ({[s.name for s in self.inputs]}), got {len(inputs)}")
        for slot, b in zip(self.inputs, inputs, strict=True):
            if type(b) is not Buffer:
                raise VariantPackError(f"expected a Buffer, got {type(b).__name__}", tensor=slot.name)
            self._check_buffer(slot, b)
        results = self._run([b._view for b in inputs])
        get = results.get_as_object
        return [self._wrap(get(s.index, self._BufferView), s) for s in self.outputs]

    def _run(self, views: Sequence[Any]) -> Any:
        args = self._VariantList(self._n_in)
        for v in views:
            args.push_ref(v)
        results = self._VariantList(len(self.outputs))
        try:
            self._invoke(self._function, args, results)
        except Exception as exc:
            raise ExecutionError(f"IREE failed running graph '{self.graph.name}' on {self.handle.device}: {exc}") from None
        return results

    # ---- values ----------------------------------------------------------------------------
    def _check_buffer(self, slot: IoSlot, b: Buffer) -> None:
        if b._runtime is not self.runtime:
            raise VariantPackError(f"Buffer lives on {b.device}, the plan runs on {self.handle.device}", tensor=slot.name)
        if b.shape == slot.dim and b.strides == slot.stride and b.data_type is slot.data_type:
            return
        why = b.layout_mismatch(slot.dim, slot.stride, slot.data_type)
        if why:
            raise VariantPackError(why, tensor=slot.name)

    def _host_input(self, slot: IoSlot, value: Any, keep: list[np.ndarray], alias: bool) -> Any:
        arr = check_array(self.graph.tensor_by_name(slot.name), value, what="input")
        dense = layout.to_physical(arr, slot.dim, slot.stride)
        keep.append(dense)
        # IREE cannot alias read-only memory (a frozen weight, a broadcast or memory-mapped
        # array): those are copied into IREE's buffer instead.
        return self.runtime.upload(dense, slot.data_type, allow_alias=alias and dense.flags.writeable)

    def _wrap(self, view: Any, slot: IoSlot) -> Buffer:
        b = Buffer.__new__(Buffer)
        b._view, b._runtime, b._alias, b._keep = view, self.runtime, False, None
        b.handle, b.shape, b.strides, b.data_type = self.handle, slot.dim, slot.stride, slot.data_type
        b.physical_shape = slot.physical_shape
        self._track(b)
        return b

    def _outputs(self, results: Any, given: list[tuple[IoSlot, Any]], as_buf: bool) -> dict[str, Any]:
        get = results.get_as_object
        written = {s.name for s, _ in given}
        for slot, dest in given:
            view = get(slot.index, self._BufferView)
            if type(dest) is Buffer:
                if dest._alias:
                    self.runtime.copy_buffer(view.get_buffer(), dest._view.get_buffer())
                else:
                    dest._rebind(view)
            else:
                host = self.runtime.download(view, slot.data_type.numpy, copy=False)
                dest[...] = layout.from_physical(host, slot.dim, slot.stride)
        out: dict[str, Any] = {}
        for slot in self.outputs:
            if slot.name in written:
                continue
            view = get(slot.index, self._BufferView)
            if as_buf:
                out[slot.name] = self._wrap(view, slot)
                continue
            # A copy: arrays must not hold IREE memory (see runtime.track), and IREE may
            # hand back an input's memory or one buffer for two equal outputs.
            if slot.packed:
                host = self.runtime.download(view, slot.data_type.numpy, copy=True)
                out[slot.name] = layout.from_physical(host, slot.dim, slot.stride)
            else:  # a strided view into a larger buffer: returned with the declared strides
                host = self.runtime.download(view, slot.data_type.numpy, copy=False)
                arr = layout.empty_strided(slot.dim, slot.stride, slot.data_type.numpy)
                arr[...] = layout.from_physical(host, slot.dim, slot.stride)
                out[slot.name] = arr
        return out

    def _bad_key(self, variant_pack: Mapping[Any, Any]) -> None:
        """Raises the precise VariantPackError for a pack with an unusable key."""
        resolve_pack(self.graph, variant_pack, check=lambda t, v, what: v)
        raise VariantPackError("variant pack key not found in the compiled graph's inputs or outputs")
