"""The torch plan's lean call: what a user holding torch tensors pays per call (a mixin:
the state is TorchPlan's). A 64x64 ReLU's eager call is ~6.5 us of host time on the
H200's host; every check and frame here is on top of it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from fusegraph.engines.torch.compiled import as_declared
from fusegraph.engines.torch.convert import Tensor, torch_dtype
from fusegraph.errors import ExecutionError
from fusegraph.graph.graph import Graph
from fusegraph.graph.tensor import TensorAttr


class LeanCall:
    """See the module docstring."""

    graph: Graph
    device: Any
    _torch: Any
    _acts: list[TensorAttr]
    _act_names: list[str]
    _inputs: list[TensorAttr]
    _outputs: list[TensorAttr]
    _in_names: list[str]
    _out_names: list[str]
    _bound: dict[str, tuple[Any, Tensor]]
    _strides: dict[str, tuple[int, ...]]
    _positional: Any
    _fn: Callable[[dict[str, Tensor]], dict[str, Tensor]]
    _llga_on: bool
    _numerics: bool
    _threads: int
    _cuda_graph: bool
    _graph: Any
    _graph_bound: Any
    _graph_lock: Any

    # TorchPlan's and CudaGraphs' (annotations only: a method here would shadow theirs)
    _flags: Callable[[], contextlib.AbstractContextManager[None]]
    _launch: Callable[[Any], dict[str, Tensor]]
    _on_graph_stream: Callable[[], bool]

    def _lean_init(self) -> None:
        self._lean: list[tuple[Any, ...]] | None = None  # see _run_lean
        self._lean_fixed: list[Any] = []
        self._lean_slots: list[int] = []
        self._lean_out: list[tuple[str, Any, Any]] = []  # outputs given to the lean call (GPU)
        # The lean call on a GPU compares device indices (a tensor's ``.device`` builds a
        # torch.device per call) and reads the current device without torch.cuda's wrapper.
        self._lean_cuda: int | None = self.device.index if self.device.type == "cuda" else None
        torch = self._torch
        self._get_device: Any = (
            getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device if self._lean_cuda is not None else None
        )

    def _lean_spec(self) -> None:
        """What _run_lean checks each activation against: its name, shape, dtype, device and,
        for a compiled plan, the strides it was compiled for (an eager plan takes any)."""
        torch = self._torch
        if self._llga_on:  # CPU NumPy calls take _run_hot; tensors the general path
            self._lean = None
            return
        self._lean = [
            (t.name, torch.Size(t.shape), self._strides.get(t.name), torch_dtype(t.dtype))
            for t in self._acts
        ]
        self._lean_out = [(t.name, torch.Size(t.shape), torch_dtype(t.dtype)) for t in self._outputs]
        acts = {t.name: i for i, t in enumerate(self._inputs) if t.name not in self._bound}
        self._lean_slots = [acts[t.name] for t in self._acts]
        self._lean_fixed = [
            None if t.name in acts else (
                as_declared(t, self._bound[t.name][1], self._strides[t.name]) if self._positional is not None
                else self._bound[t.name][1]
            )
            for t in self._inputs
        ]

    def _run_lean(self, variant_pack: Any) -> dict[str, Any] | None:
        """The call of a user who holds torch tensors, kept to what it must do: a dict of
        tensors on the plan's device laid out as the plan takes them, bound constants left
        out, no gradients; on a GPU, every output may be given as well (a tensor of its
        shape, dtype and device, any strides: the results are copied into it, as the general
        path does). None sends the call down the general path, which also raises the
        precise errors."""
        spec = self._lean
        if spec is None or type(variant_pack) is not dict:
            return None
        torch = self._torch
        tensor = torch.Tensor
        cuda = self._lean_cuda
        n = len(variant_pack)
        given: list[Any] | None = None
        if n != len(spec):
            if cuda is None or n != len(spec) + len(self._lean_out):
                return None
            given = []
            for name, shape, dtype in self._lean_out:
                o: Any = variant_pack.get(name)
                if type(o) is not tensor or o.shape != shape or o.dtype is not dtype or not o.is_cuda or o.get_device() != cuda or o.requires_grad:
                    return None
                given.append(o)
        xs = []
        if cuda is not None:
            for name, shape, strides, dtype in spec:
                v: Any = variant_pack.get(name)
                if type(v) is not tensor or v.shape != shape or v.dtype is not dtype or not v.is_cuda or v.get_device() != cuda or v.requires_grad:
                    return None
                if strides is not None and v.stride() != strides:
                    return None
                xs.append(v)
            if self._get_device() != cuda:
                return None
        else:
            device = self.device
            for name, shape, strides, dtype in spec:
                v = variant_pack.get(name)
                if type(v) is not tensor or v.shape != shape or v.dtype != dtype or v.device != device or v.requires_grad:
                    return None
                if strides is not None and v.stride() != strides:
                    return None
                xs.append(v)
        if self._cuda_graph:
            if self._graph is None or self._graph_bound is not self._bound or not self._on_graph_stream():
                return None  # captured by the general path's first call, which also runs other streams
            # the captured buffers serve one call at a time: copy in, replay, copy out
            with self._graph_lock, torch.inference_mode():  # the captured buffers are inference tensors
                static_out = self._launch(zip(self._act_names, xs, strict=True))
                if given is None:
                    return {n: static_out[n].clone() for n in self._out_names}
                for o, name in zip(given, self._out_names, strict=True):
                    o.copy_(static_out[name])
            return {}
        if self._bound:
            full = list(self._lean_fixed)
            for slot, v in zip(self._lean_slots, xs, strict=True):
                full[slot] = v
        else:  # the activations are the inputs, in order
            full = xs
        try:
            if self._numerics or self._threads:
                with self._flags():
                    res = self._lean_call(full)
            elif self._positional is not None:
                res = dict(zip(self._out_names, self._positional(*full), strict=True))
            else:
                res = self._fn(dict(zip(self._in_names, full, strict=True)))
            if given is None:
                return res
            for o, name in zip(given, self._out_names, strict=True):
                o.copy_(res[name])
            return {}
        except Exception as exc:
            raise ExecutionError(f"torch plan for graph '{self.graph.name}' failed: {type(exc).__name__}: {exc}") from exc

    def _lean_call(self, full: list[Any]) -> dict[str, Any]:
        if self._positional is not None:
            return dict(zip(self._out_names, self._positional(*full), strict=True))
        return self._fn(dict(zip(self._in_names, full, strict=True)))

