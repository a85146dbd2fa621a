"""The cuDNN graph engine: a fusegraph graph becomes one cuDNN frontend graph, so that
cuDNN's runtime fusion runs a convolution or matmul with its pointwise prologue and
epilogue as one kernel (DESIGN.md: conv+bias+ReLU 0.043 ms fused vs 0.066 ms as three
PyTorch calls on the H200).

Nothing here imports cudnn or torch at module import: ``available``/``supports``/``build``
do, the first time they are asked; the lowering, store and plan modules are imported on
first use too (listing the engines for a build on another engine need not load them). ``supports`` answers from cuDNN itself (the operation
graph built and its support checked), cached per graph key and device.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import threading
from collections.abc import Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any

from fusegraph import __version__
from fusegraph.dtypes import DataType
from fusegraph.engines.base import EngineConfig, ExecutionPlan, Knob, Support, distribution_version
from fusegraph.engines.torch.convert import cuda_torch_support, gpu_exists
from fusegraph.errors import CompileError, UnsupportedError
from fusegraph.graph.graph import Graph
from fusegraph.runtime.handle import Handle

if TYPE_CHECKING:
    from fusegraph.engines.cudnn.plan import CudnnPlan

log = logging.getLogger("fusegraph.engines.cudnn")

HEUR_MODES = ("a", "b", "fallback")
MAX_PLAN_INDEX = 8  # plan indices offered to the autotuner (cuDNN ranks its best first)
MAX_READY = 32  # cuDNN graphs built by supports() and kept for the build() that usually follows
INSTALL_HINT = "pip install 'fusegraph[cuda]' (nvidia-cudnn-frontend) on a machine with an NVIDIA GPU and a CUDA build of PyTorch"


def _modes(cudnn: Any, mode: str) -> list[Any]:
    hm = cudnn.heur_mode
    return {"a": [hm.A, hm.FALLBACK], "b": [hm.B, hm.FALLBACK], "fallback": [hm.FALLBACK]}[mode]


class CudnnEngine:
    """See the module docstring; knobs: ``heur_mode`` (cuDNN's heuristic: a, b, fallback)
    and ``plan_index`` (which of cuDNN's ranked execution plans: what the autotuner times)."""

    name = "cudnn"

    def __init__(self) -> None:
        self._libs: tuple[Any, Any] | None = None
        self._lib_error: str | None = None
        self._runtime: Support | None = None
        self._handles: dict[int, Any] = {}
        self._gates: dict[int, Any] = {}  # GPU index -> the HandleGate its plans share
        self._verdicts: dict[tuple[str, str], tuple[Support, int]] = {}
        self._ready: dict[tuple[str, str], Any] = {}  # built by supports(), taken by build()
        self._loaded: dict[tuple[str, str], CudnnPlan] = {}  # loaded from the store by supports()
        self._lock = threading.Lock()

    # ---- the libraries, loaded on first need ------------------------------------------------------
    @property
    def version(self) -> str:
        try:
            return f"{__version__}+fe{distribution_version('nvidia-cudnn-frontend')}"
        except metadata.PackageNotFoundError:
            return __version__

    def _load(self) -> tuple[Any, Any]:
        if self._libs is not None:
            return self._libs
        if self._lib_error is not None:
            raise ImportError(self._lib_error)
        if importlib.util.find_spec("cudnn") is None:
            self._lib_error = f"cuDNN's Python frontend is not installed ({INSTALL_HINT})"
        elif importlib.util.find_spec("torch") is None:
            self._lib_error = f"PyTorch is not installed; the cuDNN engine takes its CUDA runtime and cuDNN library ({INSTALL_HINT})"
        else:
            try:
                # torch first: cuDNN's frontend then binds the libcudnn that torch loaded
                torch = importlib.import_module("torch")
                cudnn = importlib.import_module("cudnn")
                self._libs = (cudnn, torch)
                from fusegraph.engines.cudnn.plan import track

                track(self)  # its caches hold frontend objects: let go of at exit
                return self._libs
            except Exception as exc:
                self._lib_error = f"importing cuDNN's frontend failed: {type(exc).__name__}: {exc}"
        raise ImportError(self._lib_error)

    def available(self) -> Support:
        """What can be known without importing a library (the Engine protocol: importing torch
        costs 1-2 s, and a build on another engine must not pay it): the frontend installed
        and a CUDA build of PyTorch, read from torch/version.py. Whether a GPU is visible and
        the cuDNN library loads is asked with the first CUDA handle (_runtime_support)."""
        if importlib.util.find_spec("cudnn") is None:
            return Support.no(f"cuDNN's Python frontend is not installed ({INSTALL_HINT})")
        return cuda_torch_support("the cuDNN engine", INSTALL_HINT)

    def _runtime_support(self) -> Support:
        """The libraries loaded and a GPU visible (asked once per process, under a CUDA handle)."""
        if self._runtime is not None:
            return self._runtime
        try:
            cudnn, torch = self._load()
        except ImportError as exc:
            self._runtime = Support.no(str(exc))
            return self._runtime
        if not torch.cuda.is_available():
            self._runtime = Support.no(f"cuDNN needs an NVIDIA GPU: no CUDA GPU visible ({torch.__version__})")
            return self._runtime
        try:
            cudnn.backend_version()
        except Exception as exc:
            self._runtime = Support.no(f"the cuDNN library could not be loaded: {exc}")
            return self._runtime
        self._runtime = Support.yes()
        return self._runtime

    def library_versions(self) -> dict[str, str]:
        """The frontend's version from its distribution and the cuDNN library's from torch,
        whose libcudnn the frontend binds (``_load``): every verdict and plan key reads this,
        and importing the frontend costs a warm session's open ~0.1 s that the key does not
        need. Where the frontend is not an installed distribution, it is imported."""
        if importlib.util.find_spec("cudnn") is None or importlib.util.find_spec("torch") is None:
            return {}
        try:
            frontend = distribution_version("nvidia-cudnn-frontend")
        except metadata.PackageNotFoundError:
            try:
                cudnn, _ = self._load()
            except ImportError:
                return {}
            frontend = str(getattr(cudnn, "__version__", "?"))
        torch = importlib.import_module("torch")
        out = {"cudnn_frontend": frontend}
        with contextlib.suppress(Exception):
            lib = torch.backends.cudnn.version()
            if lib:
                out["cudnn"] = str(lib)
        if torch.version.cuda:
            out["cuda"] = str(torch.version.cuda)
        return out

    def _release(self) -> None:
        """Drops the cached frontend graphs and plans (at exit: plan._release_at_exit)."""
        with self._lock:
            self._ready.clear()
            self._loaded.clear()

    def cudnn_handle(self, index: int) -> Any:
        """One cuDNN handle per GPU, made on first use (cuDNN handles are costly to make)."""
        with self._lock:
            h = self._handles.get(index)
            if h is None:
                cudnn, torch = self._load()
                with torch.cuda.device(index):
                    h = self._handles[index] = cudnn.create_handle()
            return h

    def gate(self, index: int) -> Any:
        """The lock and last-set stream that the plans on GPU ``index`` share with its handle."""
        from fusegraph.engines.cudnn.plan import HandleGate

        with self._lock:
            g = self._gates.get(index)
            if g is None:
                g = self._gates[index] = HandleGate()
            return g

    # ---- support ----------------------------------------------------------------------------------
    def _device_support(self, handle: Handle) -> Support:
        if handle.device.kind != "cuda":
            return Support.no(f"cuDNN runs on NVIDIA GPUs only; the handle is {handle.device}")
        avail = self.available()
        if not avail:
            return avail
        ready = self._runtime_support()
        if not ready:
            return ready
        _, torch = self._load()
        return gpu_exists(torch, handle.device.index)

    def supports(self, graph: Graph, handle: Handle) -> Support:
        return self._verdict(graph, handle)[0]

    def _verdict(self, graph: Graph, handle: Handle) -> tuple[Support, int]:
        dev = self._device_support(handle)
        if not dev:
            return dev, 0
        from fusegraph.engines.cudnn import rules

        why = rules.refusal(graph)
        if why is not None:
            return Support.no(why), 0
        key = (graph.key(), str(handle.device))
        got = self._verdicts.get(key)
        if got is None:
            got = self._stored_verdict(graph, handle, key)
        if got is None:
            # cuDNN's check_support answers for the backend as a whole; only a built plan
            # proves one of its engines takes the graph. The built graph is kept for build().
            try:
                g = self._planned(graph, handle, "a", tf32=False)
                _, torch = self._load()
                with torch.cuda.device(handle.device.index):
                    g.build_plans()
                self._ready[key] = g
                while len(self._ready) > MAX_READY:  # asked about but never built: drop the oldest
                    self._ready.pop(next(iter(self._ready)))
                got = (Support.yes(), int(g.get_execution_plan_count()))
            except Exception as exc:
                hint = " (float32 graphs run only on plans without TF32 rounding; pin knob tf32=True to allow it)" if _wide_floats_only(graph) else ""
                got = (Support.no(f"cuDNN: {_message(exc)}{hint}"), 0)
        self._verdicts[key] = got
        return got

    def _stored_verdict(self, graph: Graph, handle: Handle, key: tuple[str, str]) -> tuple[Support, int] | None:
        """A plan stored by an earlier process answers without cuDNN's heuristics or
        compilation: loaded here, handed to build()."""
        from fusegraph.engines.cudnn import store

        config = EngineConfig(self.name)
        data = store.load(self._store_key(graph, handle, config))
        if data is None:
            return None
        try:
            plan = self._load_plan(graph, handle, config, data)
        except Exception as exc:
            log.info("stored cuDNN plan for '%s' not used (%s)", graph.name, exc)
            return None
        self._loaded[key] = plan
        return Support.yes(), max(1, plan.plan_count)

    def _planned(self, graph: Graph, handle: Handle, mode: str, *, tf32: bool) -> Any:
        """The cuDNN graph, validated, planned with ``mode`` and support-checked. Float32
        graphs keep to plans without tensor-core down-conversion (TF32) unless ``tf32``."""
        from fusegraph.engines.cudnn import lower, rules

        cudnn, torch = self._load()
        b = rules.binding(graph, tf32=tf32)
        with torch.cuda.device(handle.device.index):
            g = lower.lower(graph, b, cudnn, self.cudnn_handle(handle.device.index))
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans(_modes(cudnn, mode))
            if not tf32 and _wide_floats_only(graph):
                notes = cudnn.numerical_note
                g.deselect_numeric_notes([notes.TENSOR_CORE, notes.DOWN_CONVERT_INPUTS])
            g.check_support()
        return g

    def knobs(self, graph: Graph, handle: Handle) -> Sequence[Knob]:
        ok, count = self._verdict(graph, handle)
        if not ok:
            return []
        out = [  # cuda_graph first: the autotuner's product varies it slowest (its "off" configs come last)
            Knob("cuda_graph", "auto", choices=("auto", "off"),
                 description="replay a captured launch when the default stream repeats the same pointers "
                             "(saves cuDNN's ~10 us host launch; 'off': launch every call)"),
            Knob("heur_mode", "a", choices=HEUR_MODES, description="cuDNN's heuristic: A (fast), B (better, slower to ask), FALLBACK"),
            Knob("plan_index", 0, choices=tuple(range(max(1, min(count, MAX_PLAN_INDEX)))),
                 description="which of cuDNN's ranked execution plans (0: its first choice that builds)"),
        ]
        if _wide_floats_only(graph):
            out.append(Knob("tf32", False, choices=(False, True), numerics=True,
                            description="allow tensor-core plans that round float32 inputs to TF32 (faster, ~1e-3 relative error)"))
        return out

    # ---- building ---------------------------------------------------------------------------------
    def _store_key(self, graph: Graph, handle: Handle, config: EngineConfig) -> str:
        from fusegraph.engines.cudnn import store

        _, torch = self._load()
        gpu = torch.cuda.get_device_name(handle.device.index)
        return store.plan_key(graph.key(), str(config), f"{handle.device}[{gpu}]", {**self.library_versions(), "fusegraph": __version__})

    def build(self, graph: Graph, handle: Handle, config: EngineConfig | None = None) -> ExecutionPlan:
        from fusegraph.engines.cudnn import rules, store
        from fusegraph.engines.cudnn.plan import CudnnPlan

        config = config or EngineConfig(self.name)
        mode = str(config.get("heur_mode", "a"))
        index = int(config.get("plan_index", 0))
        if mode not in HEUR_MODES:
            raise ValueError(f"cudnn knob 'heur_mode': {mode!r} not in {list(HEUR_MODES)}")
        if str(config.get("cuda_graph", "auto")) not in ("auto", "off"):
            raise ValueError(f"cudnn knob 'cuda_graph': {config.get('cuda_graph')!r} not in ['auto', 'off']")
        tf32 = bool(config.get("tf32", False))
        dev = self._device_support(handle)
        why = dev.reason if not dev else rules.refusal(graph, tf32=tf32)
        if why:
            raise UnsupportedError(f"cudnn cannot run graph '{graph.name}': {why}")
        key = (graph.key(), str(handle.device))
        if config == EngineConfig(self.name):
            loaded = self._loaded.pop(key, None)
            if loaded is not None:
                return loaded
        skey = self._store_key(graph, handle, config)
        data = store.load(skey)
        if data is not None:  # a known graph: no heuristics query, no kernel compilation
            try:
                return self._load_plan(graph, handle, config, data)
            except Exception as exc:  # a stale or foreign plan: build afresh, replace it
                log.info("stored cuDNN plan for '%s' not used (%s); rebuilding", graph.name, exc)
                store.forget(skey)
        sup, count = self._verdict(graph, handle)
        if not sup and not tf32:  # the verdict is for plans without TF32; a pinned tf32 is tried
            raise UnsupportedError(f"cudnn cannot run graph '{graph.name}': {sup.reason}")
        cudnn, torch = self._load()
        try:
            g = self._ready.pop((graph.key(), str(handle.device)), None) if (mode, index, tf32) == ("a", 0, False) else None
            if g is None:
                g = self._planned(graph, handle, mode, tf32=tf32)
                with torch.cuda.device(handle.device.index):
                    if index == 0:
                        g.build_plans()  # cuDNN's first plan that builds
                    else:
                        g.build_plan_at_index(index)
        except Exception as exc:
            raise CompileError(f"cuDNN could not build a plan for graph '{graph.name}' ({config}): {_message(exc)}",
                               diagnostic=str(exc)) from exc
        plan = CudnnPlan(graph, handle, config, cudnn=cudnn, torch=torch, cudnn_handle=self.cudnn_handle(handle.device.index),
                         cudnn_graph=g, binding=rules.binding(graph, tf32=tf32), plan_name=_plan_name(g),
                         gate=self.gate(handle.device.index))
        plan.plan_count = count
        blob = plan.serialize()
        if blob is not None:
            store.save(skey, blob)
        return plan

    def _load_plan(self, graph: Graph, handle: Handle, config: EngineConfig, data: bytes) -> CudnnPlan:
        from fusegraph.engines.cudnn import rules
        from fusegraph.engines.cudnn.plan import CudnnPlan, split_blob

        head, blob = split_blob(data)
        cudnn, torch = self._load()
        h = self.cudnn_handle(handle.device.index)
        with torch.cuda.device(handle.device.index):
            g = cudnn.pygraph(handle=h)
            g.deserialize(h, blob)
        plan = CudnnPlan(graph, handle, config, cudnn=cudnn, torch=torch, cudnn_handle=h, cudnn_graph=g,
                         binding=rules.binding(graph, tf32=bool(config.get("tf32", False))),
                         plan_name=str(head.get("plan_name", "")), loaded=True,
                         gate=self.gate(handle.device.index))
        plan.plan_count = int(head.get("plan_count", 0))
        return plan

    def load_plan(self, data: bytes, handle: Handle) -> ExecutionPlan:
        """A plan from ``CudnnPlan.serialize()`` bytes: the graph, config and cuDNN's plan."""
        from fusegraph.engines.cudnn.plan import split_blob

        head, _ = split_blob(data)
        graph = Graph.from_json(head["graph"]).validate()
        c = head.get("config") or {}
        config = EngineConfig(self.name, tuple(sorted((c.get("knobs") or {}).items())))
        return self._load_plan(graph, handle, config, data)


def _wide_floats_only(graph: Graph) -> bool:
    """No half, bfloat16 or fp8 tensor: the graph asks for float32 (or float64) accuracy."""
    return all(t.dtype in (DataType.FLOAT, DataType.DOUBLE) for t in graph.tensors
               if not t.is_scalar and t.data_type is not None and t.dtype.is_float)


def _plan_name(g: Any) -> str:
    try:
        return str(g.get_plan_name_at_index(g._plan_index))
    except Exception:
        return ""


def _message(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:400] if len(text) > 400 else text
