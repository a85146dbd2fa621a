"""The runnable pieces of a session: a claimed subgraph on a fusegraph engine, or a group of
unclaimed nodes in an ONNX Runtime sub-session built from just those nodes.

Every unit reads ONNX values by name and returns the values it produces. Arrays cross
unit boundaries as they are: a fusegraph unit's channels-last outputs go to the next
fusegraph unit without a copy (its inputs are declared with the same strides), and are
made contiguous only when ONNX Runtime or the caller needs them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from fusegraph.errors import UnsupportedError
from fusegraph.graph.graph import Graph
from fusegraph.graph.tensor import TensorAttr
from fusegraph.onnx.importer import with_strides
from fusegraph.onnx.model import OnnxGraph, ONode
from fusegraph.runtime.cache_dir import CACHE_DIR_ENV  # where the engines keep compiled modules
from fusegraph.runtime.handle import Handle

log = logging.getLogger("fusegraph.onnx")



class Unit(Protocol):
    name: str
    kind: str  # "fusegraph", "onnxruntime" or "iree-onnx"
    inputs: list[str]  # ONNX values read (constants excluded)
    outputs: list[str]  # ONNX values produced that someone reads
    nodes: list[ONode]

    def run(self, values: Mapping[str, Any]) -> dict[str, Any]: ...


def to_host(value: Any) -> Any:
    """A NumPy array for a fusegraph Buffer, a torch tensor (on any device: a region unit's
    outputs) or anything array-like; lists pass through."""
    if isinstance(value, np.ndarray | list):
        return value
    if type(value).__module__.startswith("torch") and hasattr(value, "detach"):
        t = value.detach()
        if str(t.dtype) == "torch.bfloat16":  # NumPy has no bfloat16 of its own: through its bits
            import ml_dtypes

            return t.cpu().view(dtype=_torch_int16()).numpy().view(ml_dtypes.bfloat16)
        return t.cpu().numpy()
    for attr in ("to_numpy", "numpy", "to_host"):
        fn = getattr(value, attr, None)
        if callable(fn):
            return np.asarray(fn())
    return np.asarray(value)


def _torch_int16() -> Any:
    import torch

    return torch.int16


def build_plan(graph: Graph, handle: Handle, engine: str | None, config: Any = None) -> Any:
    """The engine layer's plan for ``graph`` (``g.build``); where the selection layer is not
    installed, the named engine (default: reference) builds it directly."""
    try:
        if config is not None:
            return graph.build(handle, config=config)
        return graph.build(handle, engine=engine)
    except ModuleNotFoundError as exc:
        if "fusegraph.select" not in str(exc):
            raise
    from fusegraph.engines.registry import REGISTRY

    eng = REGISTRY.get(engine or "reference")
    sup = eng.supports(graph, handle)
    if not sup:
        raise UnsupportedError(f"engine '{eng.name}' cannot run graph '{graph.name}': {sup.reason}")
    return eng.build(graph, handle)


class FusegraphUnit:
    """A claimed subgraph: one fusegraph Graph, its weights bound once, built by an engine.

    When the plan runs on device Buffers (the IREE engine), the weights are uploaded once
    at build time and the unit's outputs stay Buffers, so consecutive fusegraph units pass
    device memory along without a host round trip.
    """

    kind = "fusegraph"

    def __init__(
        self,
        name: str,
        nodes: list[ONode],
        graph: Graph,
        inputs: Mapping[str, TensorAttr],
        weights: Mapping[str, Any],
        outputs: Mapping[str, str],
        handle: Handle,
        engine: str | None,
        cache_dir: str | None = None,
    ) -> None:
        self.name = name
        self.nodes = nodes
        self.graph = graph
        self._in = dict(inputs)
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self._out = dict(outputs)
        self.weights: dict[str, Any] = dict(weights)
        self.handle = handle
        self.engine = engine
        self.cache_dir = cache_dir
        self.plan: Any = None
        self.fusions: dict[str, int] = {}
        self.filter_layout = ""
        self._buffers = False
        self._kept = False  # the plan keeps the bound weights: packs leave them out
        self._relayouts = False  # the plan lays host inputs out itself
        self._ran = False  # the plan has run once (lazy compiles, e.g. oneDNN Graph's, are done)
        self.engine_notes: list[str] = []  # what the engine warned of while building / first running it

    @property
    def engine_name(self) -> str:
        if self.plan is not None:
            return str(getattr(self.plan, "config", None) or getattr(self.plan, "engine", self.engine))
        return self.engine or "(selected at build)"

    def build(self, config: Any = None) -> None:
        """Builds the plan (the engine layer's choice, or exactly ``config``)."""
        if self.plan is not None:
            return
        with engine_cache(self.cache_dir):
            self.plan = build_plan(self.graph, self.handle, self.engine, config)
        self._bind()

    def autotune(self, budget_s: float) -> float | None:
        """Times the engine's configs on this subgraph (weights and random activations) for
        ``budget_s`` and keeps the fastest correct one (stored in the tuning database, so
        later sessions reuse it); returns its median time in ms, None when tuning failed."""
        with engine_cache(self.cache_dir):
            result = self._autotune(budget_s)
        if result is None:
            return None
        self.plan = result.plan
        self._bind()
        ms = result.time_of(result.best)
        return float(ms) if ms is not None else None

    def _bind(self) -> None:
        """On the IREE engine, the weights go to the device once, as Buffers; every engine is
        told they are constant (``ExecutionPlan.bind_constants``)."""
        if getattr(self.plan, "engine", None) == "iree" and not self._buffers:
            from fusegraph.runtime.buffer import Buffer

            self.weights = {
                name: Buffer.from_numpy(arr, self.handle, tensor=self.graph.tensor_by_name(name))
                for name, arr in self.weights.items()
            }
            self._buffers = True
        self._ran = False
        bind = getattr(self.plan, "bind_constants", None)
        self._kept = bool(bind(self.weights)) if bind is not None else False
        self._relayouts = bool(getattr(self.plan, "relayouts_host_inputs", False))

    def _note_cpu_path(self) -> None:
        """What runs a torch plan on the CPU, for the report, once its first call settled it
        (engines/torch/frozen.py: which candidate runs, and why the others did not)."""
        describe = getattr(self.plan, "describe", None)
        if describe is None or getattr(self.plan, "engine", None) != "torch":
            return
        d = describe()
        tried = d.get("cpu_path_attempts") or []
        if d.get("cpu_path") and tried:
            note = f"CPU path: {d['cpu_path']} ({'; '.join(tried)})"
            if note not in self.engine_notes:
                self.engine_notes.append(note)

    def _autotune(self, budget_s: float) -> Any:
        rng = np.random.default_rng(0)
        pack: dict[str, Any] = dict(self.weights)
        for t in self._in.values():
            arr = rng.standard_normal(t.shape).astype(t.dtype.numpy) if t.dtype.is_float else np.zeros(t.shape, t.dtype.numpy)
            pack[t.name] = with_strides(arr, t.strides)
        try:
            result = self.graph.autotune(
                pack, self.handle, budget_s=budget_s, engines=[self.engine] if self.engine else None, progress=False
            )
        except Exception as exc:  # tuning is an optimization: the default build still applies
            log.warning("autotuning %s failed (%s); using the default plan", self.name, str(exc).splitlines()[0])
            return None
        log.info("autotuned %s: %s", self.name, result.best)
        return result

    def run(self, values: Mapping[str, Any]) -> dict[str, Any]:
        if self.plan is None:
            self.build()
        pack: dict[str, Any] = {} if self._kept else dict(self.weights)  # a plan keeping them needs them once
        for onnx_name, t in self._in.items():
            pack[t.name] = _conform(values[onnx_name], t, self._buffers, self._relayouts)
        if self._ran:  # built and run once: nothing left to compile or cache
            res = self.plan.execute(pack)
        else:
            with engine_cache(self.cache_dir):
                res = self.plan.execute(pack)
            self._ran = True
            self._note_cpu_path()
        return {o: res[tname] for o, tname in self._out.items()}


@contextlib.contextmanager
def engine_cache(cache_dir: str | None) -> Iterator[None]:
    """Points the engines' compile cache at ``cache_dir`` (their FUSEGRAPH_CACHE_DIR) for
    the duration of a build or call."""
    if not cache_dir:
        yield
        return
    old = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = cache_dir
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(CACHE_DIR_ENV, None)
        else:
            os.environ[CACHE_DIR_ENV] = old


def _conform(value: Any, t: TensorAttr, buffers: bool, relayouts: bool = False) -> Any:
    """The value as the plan takes it: a device Buffer laid out as ``t`` declares (passed
    as is), or a host array with ``t``'s strides (copied only when the order differs), or
    in any order when the plan ``relayouts`` host arrays itself (faster than NumPy's copy)."""
    if buffers and hasattr(value, "layout_mismatch") and value.layout_mismatch(t.shape, t.strides, t.dtype) is None:
        return value
    value = to_host(value)
    if not isinstance(value, np.ndarray):
        value = np.asarray(value)
    if value.dtype != t.dtype.numpy:
        value = value.astype(t.dtype.numpy)
    return value if relayouts else with_strides(value, t.strides)


def _value_info(og: OnnxGraph, name: str, array: Any = None) -> onnx.ValueInfoProto | None:
    if array is not None and isinstance(array, np.ndarray):
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), list(array.shape))
    info = og.types.get(name)
    if info is None:
        return None
    if info.elem and info.shape is not None:
        return helper.make_tensor_value_info(name, info.elem, list(info.shape))
    if info.elem:
        return helper.make_tensor_value_info(name, info.elem, None)
    if info.proto is not None and info.proto.WhichOneof("value") is not None:
        vi = onnx.ValueInfoProto(name=name)
        vi.type.CopyFrom(info.proto)
        return vi
    return None


def sub_model(
    og: OnnxGraph,
    nodes: Sequence[ONode],
    inputs: Sequence[str],
    outputs: Sequence[str],
    name: str,
    samples: Mapping[str, Any] | None = None,
    *,
    opset: int | None = None,
) -> tuple[onnx.ModelProto, bool]:
    """An ONNX model of just ``nodes``: (model, whether every boundary type is known)."""
    complete = True
    ins = []
    for i in inputs:
        vi = _value_info(og, i, (samples or {}).get(i))
        if vi is None:
            complete = False
            vi = onnx.ValueInfoProto(name=i)
        ins.append(vi)
    outs = []
    for o in outputs:
        vi = _value_info(og, o)
        if vi is None:
            complete = False
            vi = onnx.ValueInfoProto(name=o)
        outs.append(vi)
    read = {i for n in nodes for i in n.all_inputs()}
    inits = [numpy_helper.from_array(og.constants[c], c) for c in sorted(read) if c in og.constants]
    graph = helper.make_graph([n.to_proto() for n in nodes], name, ins, outs, inits)
    imports = list(og.opset_imports)
    if opset is not None:
        imports = [helper.make_opsetid("", opset)] + [o for o in imports if o.domain not in ("", "ai.onnx")]
    model = helper.make_model(graph, opset_imports=imports, ir_version=max(og.ir_version, 4))
    model.functions.extend(og.functions)
    return model, complete


class OrtUnit:
    """Unclaimed nodes, run by an ONNX Runtime session over a model of just those nodes."""

    kind = "onnxruntime"

    def __init__(
        self,
        name: str,
        og: OnnxGraph,
        nodes: list[ONode],
        inputs: list[str],
        outputs: list[str],
        sess_options: Any,
        providers: list[Any],
        dump: Any = None,
    ) -> None:
        self.name = name
        self.og = og
        self.nodes = nodes
        self.inputs = inputs
        self.outputs = outputs
        self._sess_options = sess_options
        self._providers = providers
        self._dump = dump
        self.session: ort.InferenceSession | None = None
        self.model: onnx.ModelProto | None = None
        model, complete = sub_model(og, nodes, inputs, outputs, name)
        if complete:
            self._open(model, check=True)
        # else: typed from the first call's arrays (an input's type was unknown)

    @classmethod
    def whole(
        cls, name: str, og: OnnxGraph, model: onnx.ModelProto, sess_options: Any, providers: list[Any],
        *, session: ort.InferenceSession | None = None, path: str | None = None,
    ) -> OrtUnit:
        """The whole model, as given (not re-exported from the specialized graph: for a
        244 MB AlexNet that export and its check took 2.4 s of a 4.2 s session): an ONNX
        Runtime session already open on it, else its file (ONNX Runtime reads a file faster
        than the bytes of a re-serialized proto: 58 vs 96+132 ms for a 42 MB BERT)."""
        unit = cls.__new__(cls)
        unit.name, unit.og, unit.nodes = name, og, list(og.nodes)
        unit.inputs = [i for i in og.inputs if i not in og.constants]
        unit.outputs = list(og.outputs)
        unit._sess_options, unit._providers, unit._dump = sess_options, providers, None
        unit.model = model
        if session is None:
            source: str | bytes = path if path is not None else model.SerializeToString()
            session = ort.InferenceSession(source, sess_options=sess_options, providers=providers)
        unit.session = session
        return unit

    def _open(self, model: onnx.ModelProto, *, check: bool) -> None:
        if check:
            try:
                onnx.checker.check_model(model)
            except onnx.checker.ValidationError as exc:
                log.debug("sub-model %s does not pass the checker: %s", self.name, exc)
        self.model = model
        if self._dump is not None:
            self._dump(f"{self.name}.onnx", model.SerializeToString())
        self.session = ort.InferenceSession(
            model.SerializeToString(), sess_options=self._sess_options, providers=self._providers
        )

    def run(self, values: Mapping[str, Any]) -> dict[str, Any]:
        feed = {i: _ort_value(values[i]) for i in self.inputs}
        if self.session is None:
            model, _ = sub_model(self.og, self.nodes, self.inputs, self.outputs, self.name, feed)
            self._open(model, check=False)
        assert self.session is not None
        res = self.session.run(self.outputs, feed)
        return dict(zip(self.outputs, res, strict=True))


def _ort_value(value: Any) -> Any:
    v = to_host(value)
    if isinstance(v, np.ndarray) and not v.flags.c_contiguous:
        v = np.ascontiguousarray(v)
    return v
