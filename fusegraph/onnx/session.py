"""InferenceSession: the ONNX Runtime session API, with fusegraph as the first provider.

``fusegraph.onnx.InferenceSession(model, providers=[...])`` is a drop-in for
``onnxruntime.InferenceSession``: supported subgraphs run on fusegraph engines, the rest
on ONNX Runtime. Provider options go to ``FusegraphExecutionProvider`` either in the
``providers`` list as ``("FusegraphExecutionProvider", {...})`` or in ``provider_options``
(one dict per provider, as ONNX Runtime takes them).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from fusegraph.onnx import background, floor
from fusegraph.onnx.direct import (
    DirectOrt,
    OrtRunner,
    ShapedOrt,
    as_allowed,
    choose_whole_runner,
    make_runner,
)
from fusegraph.onnx.index_ranges import IndexRange, index_ranges, out_of_range
from fusegraph.onnx.iobinding import IOBinding, feed_value, is_device_value, numpy_dtype
from fusegraph.onnx.lean_model import stripped
from fusegraph.onnx.load import MIN_OPSET, _first_line, default_opset, load_model_with_views
from fusegraph.onnx.memory import PeakMemory, measure_peak
from fusegraph.onnx.metadata import ModelMetadata
from fusegraph.onnx.model import input_signature
from fusegraph.onnx.options import PROVIDER, ProviderOptions
from fusegraph.onnx.ort_errors import InvalidFeedError, MissingFeedError
from fusegraph.onnx.plan import EngineChoice, SessionPlan
from fusegraph.onnx.plan_regions import RegionUnit
from fusegraph.onnx.report import PartitionReport
from fusegraph.onnx.units import FusegraphUnit
from fusegraph.runtime import progress
from fusegraph.runtime.handle import Handle, default_handle
from fusegraph.select.device_id import device_id

log = logging.getLogger("fusegraph.onnx")

DEFAULT_PROVIDERS = (PROVIDER, "CPUExecutionProvider")
Dim = int | str | None


@dataclass(frozen=True)
class NodeArg:
    """An input or output of the model, as onnxruntime's NodeArg describes it."""

    name: str
    shape: list[Dim] | None
    type: str

    def __repr__(self) -> str:
        return f"NodeArg(name={self.name!r}, type={self.type!r}, shape={self.shape})"


def _type_string(t: onnx.TypeProto) -> str:
    which = t.WhichOneof("value")
    if which == "tensor_type":
        elem = onnx.TensorProto.DataType.Name(t.tensor_type.elem_type).lower()
        return f"tensor({_ORT_NAMES.get(elem, elem)})"
    if which == "sequence_type":
        return f"seq({_type_string(t.sequence_type.elem_type)})"
    if which == "map_type":
        key = onnx.TensorProto.DataType.Name(t.map_type.key_type).lower()
        return f"map({_ORT_NAMES.get(key, key)},{_type_string(t.map_type.value_type)})"
    if which == "optional_type":
        return f"optional({_type_string(t.optional_type.elem_type)})"
    return "unknown"


_ORT_NAMES = {"float": "float", "double": "double", "float16": "float16", "bool": "bool"}


def _np_dtypes() -> dict[str, np.dtype[Any]]:
    out: dict[str, np.dtype[Any]] = {}
    for code in onnx.TensorProto.DataType.values():
        name = onnx.TensorProto.DataType.Name(code).lower()
        try:
            out[f"tensor({_ORT_NAMES.get(name, name)})"] = np.dtype(helper.tensor_dtype_to_np_dtype(code))
        except (KeyError, TypeError, ValueError):  # UNDEFINED, STRING-like codes without a NumPy dtype
            continue
    return out


# ONNX Runtime's type strings ("tensor(float)") -> NumPy dtypes, for a session that never
# parses the model (its inputs come from ONNX Runtime's NodeArgs); absent: not a tensor.
NP_OF_TYPE = _np_dtypes()


def session_handle(opts: ProviderOptions) -> Handle:
    return default_handle() if opts.device == "cpu" else Handle(opts.device)


def _shape_of(t: onnx.TypeProto) -> list[Dim] | None:
    if t.WhichOneof("value") != "tensor_type" or not t.tensor_type.HasField("shape"):
        return None
    return [
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
        for d in t.tensor_type.shape.dim
    ]


def _parse_providers(
    providers: Sequence[Any] | None, provider_options: Sequence[Mapping[str, Any]] | None
) -> tuple[list[str], ProviderOptions, list[Any]]:
    """(provider names, our options, what ONNX Runtime sub-sessions get)."""
    entries = list(providers) if providers is not None else list(DEFAULT_PROVIDERS)
    if provider_options is not None and len(provider_options) != len(entries):
        raise ValueError(
            f"provider_options has {len(provider_options)} entries for {len(entries)} providers"
        )
    available = set(ort.get_available_providers())
    names: list[str] = []
    ours: dict[str, Any] = {}
    ort_list: list[Any] = []
    for k, entry in enumerate(entries):
        if isinstance(entry, tuple | list):
            if len(entry) != 2 or not isinstance(entry[0], str) or not isinstance(entry[1], Mapping):
                raise ValueError(f"provider entry {entry!r}: expected a name or (name, options dict)")
            name, opts = entry[0], dict(entry[1])
        elif isinstance(entry, str):
            name, opts = entry, {}
        else:
            raise ValueError(f"provider entry {entry!r}: expected a name or (name, options dict)")
        if provider_options is not None:
            opts.update(provider_options[k])
        if name in names:
            raise ValueError(f"provider {name} is listed twice")
        names.append(name)
        if name == PROVIDER:
            ours = opts
        elif name in available:
            ort_list.append((name, opts) if opts else name)
        else:  # as ONNX Runtime: warned about and dropped
            names.pop()
            warnings.warn(
                f"Specified provider {name!r} is not in available provider names; dropped. "
                f"Available providers: {', '.join([PROVIDER, *sorted(available)])}",
                stacklevel=3,
            )
    if not any((p if isinstance(p, str) else p[0]) == "CPUExecutionProvider" for p in ort_list):
        ort_list.append("CPUExecutionProvider")  # ONNX Runtime always falls back to CPU
    return names, ProviderOptions.parse(ours), ort_list


class InferenceSession:
    """Runs an ONNX model: claimed subgraphs on fusegraph, the rest on ONNX Runtime."""

    def __init__(
        self,
        path_or_bytes: str | os.PathLike[str] | bytes | onnx.ModelProto,
        sess_options: ort.SessionOptions | None = None,
        providers: Sequence[Any] | None = None,
        provider_options: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            raise TypeError(f"InferenceSession got unexpected keyword argument(s) {sorted(kwargs)}")
        self._providers, self._opts, self._ort_providers = _parse_providers(providers, provider_options)
        if self._opts.load == "auto":
            # read once: the session, its plan and its background child stamp the verdicts they
            # measure with it, and a whole-model runner's win applies in its own class only
            self._opts = dataclasses.replace(self._opts, load=floor.machine_load())
        self._enabled = PROVIDER in self._providers
        self._sess_options = sess_options
        self._model_name = (
            os.fspath(path_or_bytes) if isinstance(path_or_bytes, str | os.PathLike) else "<in-memory model>"
        )
        self._source_arg = path_or_bytes
        self._model_value: onnx.ModelProto | None = None
        self._views: dict[str, np.ndarray] = {}  # initializers read without a copy, for the first plan
        # ... and for every plan where the model was parsed without its weights' bytes
        # (lean_model.py): then the views are the only values of those weights
        self._lean_views: dict[str, np.ndarray] = {}
        self._handle: Handle = session_handle(self._opts)
        self._engine = EngineChoice(self._opts.engine, self._handle) if self._enabled else None
        self._plans: dict[tuple[Any, ...], SessionPlan] = {}
        # Plans hold reference cycles (a graph and its engine plans, a region unit and its
        # chooser): cut when the session goes, so `del sess` frees the weights at once.
        weakref.finalize(self, _release_plans, self._plans).atexit = False  # nothing to free at exit
        self._last: SessionPlan | None = None
        self.last_peak: PeakMemory | None = None
        # Off by default: resetting the kernel's peak-RSS mark walks the page tables, which
        # costs more than a small model's whole run.
        self.measure_memory = False
        self._direct: DirectOrt | None = None
        self._runners: floor.Verdict | None = None  # the whole-model runners' verdict (floor.choose_runner)
        self._index_ranges: dict[str, list[IndexRange]] = {}  # the plan path's (ONNX Runtime checks its own)
        source = self._background_source(path_or_bytes)
        if source is not None and self._open_direct(source):
            self._views = {}  # no plan now: the bytes under the views are not kept for one
            return
        self._signature = input_signature(self._model)
        self._index_ranges = index_ranges(self._model)
        inits = {i.name for i in self._model.graph.initializer}
        self._inputs = [
            NodeArg(i.name, _shape_of(i.type), _type_string(i.type))
            for i in self._model.graph.input
            if i.name not in inits
        ]
        input_types = {i.name: i.type for i in self._model.graph.input if i.name not in inits}
        # Per input, the NumPy dtype a tensor must have (None: not a tensor, passed as is).
        self._input_dtypes: dict[str, np.dtype[Any] | None] = {
            name: np.dtype(helper.tensor_dtype_to_np_dtype(t.tensor_type.elem_type))
            if t.WhichOneof("value") == "tensor_type" else None
            for name, t in input_types.items()
        }
        self._output_names = [o.name for o in self._model.graph.output]
        self._output_set = frozenset(self._output_names)
        static = {
            k: tuple(int(d) for d in v)  # type: ignore[arg-type]
            for k, v in self._signature.items()
            if v is not None and all(isinstance(d, int) for d in v)
        }
        if len(static) == len(self._signature) and not self._open_runner():
            with progress.working(f"fusegraph: building the session for {os.path.basename(self._model_name)}"):
                plan = self._plan_for(static)
                self._direct, self._runners = choose_whole_runner(self, plan)
        self._outputs = self._output_args()
        if self._direct is not None:  # another runner won the whole model: the plan is not needed
            self._plans.clear()
            self._last = None

    # ---- ONNX Runtime API -----------------------------------------------------------------------
    def get_inputs(self) -> list[NodeArg]:
        return list(self._inputs)

    def get_outputs(self) -> list[NodeArg]:
        return list(self._outputs)

    def get_providers(self) -> list[str]:
        names = list(self._providers)
        if "CPUExecutionProvider" not in names:
            names.append("CPUExecutionProvider")
        return names

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for name in self.get_providers():
            if name == PROVIDER:
                out[name] = self._opts.as_strings()
            else:
                match = [p for p in self._ort_providers if not isinstance(p, str) and p[0] == name]
                out[name] = {k: str(v) for k, v in match[0][1].items()} if match else {}
        return out

    def get_session_options(self) -> ort.SessionOptions | None:
        return self._sess_options

    @property
    def _model(self) -> onnx.ModelProto:
        """The checked model, parsed at first need (a session that runs the whole model on
        ONNX Runtime by a recorded verdict never parses it)."""
        if self._model_value is None:
            self._model_value, self._views = load_model_with_views(self._source_arg, self._opts.cache_dir)
            if stripped(self._model_value):
                self._lean_views = self._views
        return self._model_value

    def get_modelmeta(self) -> ModelMetadata:
        return ModelMetadata.of(self._model)

    @property
    def device(self) -> str:
        """The device the claimed units run on ("cpu", "cuda:0"...): where io_binding's
        inputs and outputs may live."""
        return str(self._handle.device)

    def io_binding(self) -> IOBinding:
        """ONNX Runtime's IOBinding; on a GPU session it takes CUDA inputs and outputs
        (fusegraph/onnx/iobinding.py)."""
        return IOBinding(self)

    def run_with_iobinding(self, iobinding: IOBinding, run_options: ort.RunOptions | None = None) -> None:
        """Runs with the bound inputs; results land in the bound outputs (``get_outputs``)."""
        iobinding._run(run_options)

    def run(
        self,
        output_names: Sequence[str] | None,
        input_feed: Mapping[str, Any],
        run_options: ort.RunOptions | None = None,
    ) -> list[Any]:
        """Outputs in the order asked (all of them for None), as NumPy arrays."""
        feed = self._check_feed(input_feed)
        wanted = list(output_names) if output_names else self._output_names
        for name in wanted:
            if name not in self._output_set:
                raise InvalidFeedError(f"Invalid output name: not an output of the model (outputs: {self._output_names})", tensor=name)
        if self._direct is not None:
            self._direct.poll(self)
        if self._direct is not None:
            feed = _on_host(feed)
            if not self.measure_memory:
                return self._direct.run(wanted, feed, run_options)
            with measure_peak() as peak:
                result = self._direct.run(wanted, feed, run_options)
            self.last_peak = peak
            return result
        plan = self._plan_for(_shapes(feed))
        if not self.measure_memory:
            return plan.run(feed, wanted)
        with measure_peak() as peak:
            result = plan.run(feed, wanted)
        self.last_peak = peak
        return result

    def _run_on_device(self, output_names: Sequence[str], input_feed: Mapping[str, Any],
                       run_options: ort.RunOptions | None = None) -> list[Any]:
        """``run`` for io_binding on a GPU session: CUDA inputs go to the units as they are and
        the outputs come back as the units made them (torch CUDA tensors from region units;
        NumPy from a unit on ONNX Runtime)."""
        feed = self._check_feed(input_feed)
        for name in output_names:
            if name not in self._output_set:
                raise InvalidFeedError(f"Invalid output name: not an output of the model (outputs: {self._output_names})", tensor=name)
        if self._direct is not None:
            self._direct.poll(self)
        if self._direct is not None:  # the whole model on ONNX Runtime: through the host
            return list(self._direct.run(list(output_names), _on_host(feed), run_options))
        return self._plan_for(_shapes(feed)).run(feed, list(output_names), host=False)

    # ---- fusegraph additions ------------------------------------------------------------------
    def partition_report(self) -> PartitionReport:
        """What runs where (for the most recent input shapes), and why the rest is not claimed."""
        if self._direct is not None:
            return self._direct.report(self)
        if self._last is None:
            raise RuntimeError(
                "the model's input shapes are dynamic: the partition is made at the first run()"
            )
        report = self._last.report()
        return dataclasses.replace(report, runners=self._runners.candidates) if self._runners else report

    @property
    def peak_live_bytes(self) -> int:
        """Peak bytes of the intermediates the session held during the last run() (cheap,
        always tracked; set ``measure_memory = True`` for the process-wide peak in
        ``last_peak``)."""
        return self._last.last_peak_live if self._last is not None else 0

    def wait_for_evaluation(self, timeout: float | None = None) -> bool:
        """Waits for fusegraph's background evaluation of the model (``floor_mode=background``)
        and, where fusegraph's plan won, for the plan to be built; on a GPU, for the regions
        chosen in the background (region_upgrade.py) and their plan swapped in. Later ``run``
        calls use it. True when nothing is pending any more (at once where nothing was)."""
        if self._direct is not None:
            return self._direct.wait(self, timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        for plan in list(self._plans.values()):
            if not plan.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                return False
        return True

    # ---- internals ------------------------------------------------------------------------------
    def _background_source(self, path_or_bytes: Any) -> background.Source | None:
        """The model's identity where its floor verdict may come from the background."""
        o = self._opts
        if not self._enabled or o.floor_mode != "background" or o.lazy_compile or o.autotune > 0:
            return None
        if o.device != "cpu" or o.floor_budget(pinned=self._engine is not None and self._engine.name is not None) <= 0:
            return None
        return background.source_of(path_or_bytes)

    def _open_direct(self, source: background.Source) -> bool:
        """The whole model on one ONNX Runtime session, where the model's verdict says so or
        is not known yet (then measured in the background); False: build fusegraph's plan."""
        cache = floor.cache_for(self._opts, device_id(self._handle))
        known = cache.lookup(source.content)
        if known is not None:
            known = as_allowed(known, self._sess_options, self._opts.load)
        if known is not None and (known.keep or known.runner == "openvino"):
            self._runners = known if known.runner else None
            return False  # fusegraph's plan or OpenVINO won: made from the caches (the model parsed)
        if known is None:
            _ = self._model  # checked (typed errors for a malformed model) before anything else reads it
        try:
            if known is not None and known.runner:  # another ONNX Runtime configuration won
                runner = make_runner(known.runner, source.ort_model, {}, self._sess_options, self._ort_providers,
                                     self._opts.cache_dir)
                assert isinstance(runner, OrtRunner)
                sess = runner.session
            else:
                sess = ort.InferenceSession(source.ort_model, sess_options=self._sess_options, providers=self._ort_providers)
                runner = OrtRunner(sess)
        except Exception as exc:  # what ONNX Runtime refuses whole, the plan may still run in parts
            log.info("ONNX Runtime could not open the whole model (%s): building the plan", _first_line(exc))
            return False
        inputs = [NodeArg(i.name, list(i.shape), i.type) for i in sess.get_inputs()]
        dynamic = not all(isinstance(d, int) for i in inputs for d in (i.shape or [None]))
        if dynamic and any(i.shape is None for i in inputs):
            return False  # an input of unknown rank: plans per shape, as in floor_mode=inline
        self._inputs = inputs
        self._signature = {i.name: tuple(i.shape) for i in inputs}  # type: ignore[arg-type,misc]
        self._input_dtypes = {i.name: NP_OF_TYPE.get(i.type) for i in inputs}
        self._outputs = [NodeArg(o.name, list(o.shape), o.type) for o in sess.get_outputs()]
        self._output_names = [o.name for o in self._outputs]
        self._output_set = frozenset(self._output_names)
        if dynamic:  # every shape on ONNX Runtime at once; each new one evaluated in the background
            self._direct = ShapedOrt(runner, known, source, cache, self)
            return True
        evaluation = background.launch(source, self._opts, cache) if known is None else None
        self._direct = DirectOrt(runner, known, evaluation)
        return True

    def _open_runner(self) -> bool:
        """Where the model's background verdict named OpenVINO: its runner, made at once (it
        loads its compiled model from the cache); False where there is none or it fails to
        start (then fusegraph's plan is built and decides again)."""
        known = self._runners
        if known is None or not known.runner:
            return False
        try:
            self._direct = DirectOrt(self._make_runner(known.runner), known, None)
        except Exception as exc:
            log.warning("%s won the floor for %s but did not start (%s): building the plan", known.runner,
                        self._model_name, _first_line(exc))
            self._runners = None
            return False
        return True

    def _runner_model(self) -> str | bytes:
        """The model as a whole-model runner reads it: the caller's file, else its bytes."""
        src = self._source_arg
        if isinstance(src, str | os.PathLike):
            return os.fspath(src)
        return src.SerializeToString() if isinstance(src, onnx.ModelProto) else bytes(src)

    def _make_runner(self, name: str) -> Any:
        """Whole-model runner ``name`` (``floor.RUNNERS``) for this session's model and shapes."""
        shapes = {k: tuple(int(d) for d in v) for k, v in self._signature.items() if v is not None}  # type: ignore[arg-type]
        return make_runner(name, self._runner_model(), shapes, self._sess_options, self._ort_providers, self._opts.cache_dir)

    def _plan_for(self, shapes: Mapping[str, tuple[int, ...]]) -> SessionPlan:
        key = tuple(sorted(shapes.items()))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._new_plan(shapes)
            if self._handle.device.is_gpu:
                _note_host_copies(plan)
            self._plans[key] = plan
            log.info("%s", plan.report().summary())
        self._last = plan
        return plan

    def _new_plan(self, shapes: Mapping[str, tuple[int, ...]], direct: Any = None) -> SessionPlan:
        path = self._model_name if isinstance(self._source_arg, str | os.PathLike) else None
        model = self._model  # parsed (and its views read) first
        views, self._views = self._views or self._lean_views, {}  # the plan drops its constants once built: so do we
        return SessionPlan(
            model, shapes, self._opts, enabled=self._enabled, handle=self._handle,
            engine=self._engine, sess_options=self._sess_options, ort_providers=self._ort_providers,
            model_name=self._model_name,
            model_path=path if path is not None and default_opset(self._model) > MIN_OPSET else None,
            direct=direct, initializers=views,
        )

    def _check_feed(self, input_feed: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(input_feed, Mapping):
            raise InvalidFeedError(f"input_feed must be a dict of name -> array, got {type(input_feed).__name__}")
        feed: dict[str, Any] = {}
        for name, value in input_feed.items():
            if name not in self._input_dtypes:
                raise InvalidFeedError(
                    f"not an input of the model (inputs: {[i.name for i in self._inputs]})", tensor=name
                )
            want = self._input_dtypes[name]
            if want is None:
                feed[name] = value
                continue
            if isinstance(value, list | tuple):  # ONNX Runtime converts Python sequences to the input's type
                try:
                    arr = np.asarray(value, dtype=want)
                except (ValueError, TypeError) as exc:
                    raise InvalidFeedError(f"cannot convert the list to {np.dtype(want)}: {exc}", tensor=name) from None
            else:  # a host array, or on a GPU session a torch tensor on its device (iobinding.py)
                arr = feed_value(value, name, self.device)
            dtype = numpy_dtype(arr)
            where = f" on {arr.device}" if is_device_value(arr) else ""
            if dtype != want:
                raise InvalidFeedError(
                    f"Unexpected input data type: dtype {dtype}{where}, the model expects {np.dtype(want)}", tensor=name
                )
            declared = self._signature.get(name)
            shape = tuple(arr.shape)
            if declared is not None and (
                len(declared) != len(shape)
                or any(isinstance(d, int) and d != s for d, s in zip(declared, shape, strict=False))
            ):
                raise InvalidFeedError(
                    f"Got invalid dimensions: shape {list(shape)}{where}, the model declares {list(declared)}",
                    tensor=name,
                )
            ranges = self._index_ranges.get(name)
            if ranges and not is_device_value(arr):
                why = out_of_range(np.asarray(arr), ranges)
                if why:
                    raise InvalidFeedError(why, tensor=name)
            feed[name] = arr
        missing = [i.name for i in self._inputs if i.name not in feed]
        if missing:
            raise MissingFeedError(f"Required inputs ({missing}) are missing from input feed", tensor=missing[0])
        return feed

    def _output_args(self) -> list[NodeArg]:
        out = []
        for o in self._model.graph.output:
            shape = _shape_of(o.type)
            if self._last is not None and (shape is None or any(not isinstance(d, int) for d in shape)):
                info = self._last.og.types.get(o.name)
                if info is not None and info.shape is not None:
                    shape = list(info.shape)
            out.append(NodeArg(o.name, shape, _type_string(o.type)))
        return out


def _release_plans(plans: dict[tuple[Any, ...], SessionPlan]) -> None:
    for plan in plans.values():
        plan.release()
    plans.clear()


def _shapes(feed: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The feed's tensor shapes (arrays and torch CUDA tensors), which key the plan."""
    return {k: tuple(int(d) for d in v.shape) for k, v in feed.items()
            if isinstance(v, np.ndarray) or is_device_value(v)}


def _on_host(feed: Mapping[str, Any]) -> dict[str, Any]:
    """The feed with CUDA tensors copied to the host (for ONNX Runtime running the whole model)."""
    from fusegraph.onnx.units import to_host

    return {k: to_host(v) if is_device_value(v) else v for k, v in feed.items()}


def _note_host_copies(plan: SessionPlan) -> None:
    """A GPU plan's report says where values leave the device: every unit that does not run
    region by region (ONNX Runtime's CPU provider, the torch-mlir tier, a unit built whole)
    reads and writes host memory, so what it reads from the device (a region unit's result,
    a model input bound on the GPU) is copied to the host and what a region unit reads from
    it is copied back. Region units pass torch tensors on the device to each other."""
    producer = {o: u for u in plan.units for o in u.outputs}
    on_gpu = {id(u) for u in plan.units if isinstance(u, RegionUnit)}
    model_inputs = set(plan.og.inputs)
    for u in plan.units:
        if id(u) in on_gpu:
            continue
        down = [v for v in u.inputs if (v in producer and id(producer[v]) in on_gpu)]
        fed = [v for v in u.inputs if v in model_inputs and v not in producer]
        up = [v for v in u.outputs if any(id(w) in on_gpu and v in w.inputs for w in plan.units)
              or v in plan.og.outputs]
        if not (down or fed or up):
            continue
        parts = []
        if down:
            parts.append(f"{len(down)} value(s) copied from the GPU to the host ({', '.join(down[:4])})")
        if fed:
            parts.append(f"model input(s) {', '.join(fed[:4])} copied to the host when bound on the GPU")
        if up:
            parts.append(f"{len(up)} result(s) copied back to the GPU ({', '.join(up[:4])}; model outputs only "
                         "when bound there)")
        note = "host copies (this unit reads host memory): " + "; ".join(parts)
        if isinstance(u, FusegraphUnit):
            u.engine_notes.append(note)
        else:
            plan.notes[u.name] = f"{plan.notes[u.name]} | {note}" if plan.notes.get(u.name) else note
