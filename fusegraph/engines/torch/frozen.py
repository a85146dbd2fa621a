"""The torch engine's default CPU path: the plan compiled with its bound weights frozen in.

Why: the CPU speed of a torch plan used to rest on PyTorch's TorchScript oneDNN Graph bridge
(``torch.jit.trace`` + freeze, deprecated in PyTorch 2.13), which refuses most graphs it
has not seen (MobileNetV3: ``vector::_M_range_check``; ConvNeXt and Swin: ``isIntList()
INTERNAL ASSERT``; MobileNetV2: a wrong result), and the op-by-op plan it falls back to is
2-12x slower than ONNX Runtime (issue 14). Measured side by side (``benchmarks/
bench_cpu_paths.py``, docs/models.md), the same claimed graphs compiled by Inductor with
freezing on (conv and linear weights prepacked for oneDNN, pointwise work fused) run at
ONNX Runtime's speed on ResNet and BERT single-threaded, and AOTInductor's C++ wrapper is
the faster of the two Inductor forms (BERT 0.94x ONNX Runtime vs 1.06x for the Python
wrapper, one thread each) -- and its package can be kept on disk, so a later session loads
it in a fraction of a second instead of compiling for tens.

So once a CPU plan's weights are bound (``bind_constants``) its first call tries, in order
(``chain``): ``aoti`` -- ``torch.export`` + ``aoti_compile_and_package`` with freezing,
the package cached in the fusegraph cache directory (``torch-aoti/``) under a key of the
graph, the weights' bytes, torch and the CPU; ``inductor`` -- ``make_fx`` + Inductor with
freezing, in process (when torch.export refuses the graph); the oneDNN Graph bridge only
where its knob asks for it. Each result is checked against the op-by-op plan before use.
A candidate that refuses says why (``Attempt``); the plan runs op by op only when all of
them refused, with a warning naming each reason.

Threads: on a busy or shared machine a team of OpenMP threads waits at every barrier for
a core (a 2-thread 256x256 matmul took 13 ms instead of 1.3 single-threaded on the shared
2-core machine), while ONNX Runtime's own pool degrades gently. ``AdaptiveThreads`` times
the calls and, now and then, a pair of calls on the other setting (all cores vs one), and
keeps the faster: under load it settles on one thread, on a quiet machine on all cores.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fusegraph.engines.base import EngineConfig
from fusegraph.engines.torch import aoti_cache
from fusegraph.engines.torch.aoti_cache import cpu_identity, load_package
from fusegraph.engines.torch.compiled import inductor_compile
from fusegraph.engines.torch.context import _Ctx
from fusegraph.engines.torch.convert import Tensor, _torch
from fusegraph.engines.torch.function import _graph_function
from fusegraph.graph.graph import Graph
from fusegraph.graph.ops import CONVOLUTIONS, OpKind
from fusegraph.graph.tensor import TensorAttr
from fusegraph.runtime.handle import Handle

log = logging.getLogger("fusegraph.engines.torch")

ENV = "FUSEGRAPH_TORCH_CPU_COMPILE"  # the cpu_compile knob's default ("auto" opts in)
CHOICES = ("auto", "aoti", "inductor", "off")
RECIPE = 1  # how a graph is written for AOTInductor; part of the package key (bump on change)
PACKAGES = aoti_cache.PACKAGES  # under the cache directory: one store for the plans' and the regions' packages
MIN_NODES = 8  # smaller graphs without a conv / matmul / attention are not worth a compile
_HEAVY = CONVOLUTIONS | {OpKind.MATMUL, OpKind.SDPA}
AGREE = 1e-4  # relative L2 against the op-by-op plan on the first call


def knob_default() -> str:
    """The ``cpu_compile`` knob's default: ``FUSEGRAPH_TORCH_CPU_COMPILE``, else ``off``.

    Off by default because a compile at session creation costs 15-90 s a model on two
    cores (AOTInductor) against ONNX Runtime's 0.03-0.7 s, and in the 21-model corpus run
    (docs/models.md) the floor handed every compiled unit back to ONNX Runtime: cold setup
    went to 212x ONNX Runtime's for no unit kept. The chain is there for who opts in
    (``cpu_compile="auto"``, or the variable), and a package once compiled loads in ~20 ms.
    """
    value = os.environ.get(ENV, "off").strip().lower()
    return value if value in CHOICES else "off"


def chain(cpu_compile: str, onednn_graph: bool) -> tuple[str, ...]:
    """The candidates a plan tries, in order (the oneDNN Graph bridge first where asked for)."""
    compiled = {"auto": ("aoti", "inductor"), "aoti": ("aoti",), "inductor": ("inductor",)}.get(cpu_compile, ())
    return (("onednn_graph",) if onednn_graph else ()) + compiled


def worth_compiling(graph: Graph) -> bool:
    """A compile costs seconds (tens for AOTInductor's first): graphs with a convolution, a
    matmul or attention, or at least MIN_NODES nodes."""
    return len(graph.nodes) >= MIN_NODES or any(n.kind in _HEAVY for n in graph.nodes)


@dataclass(frozen=True)
class Attempt:
    """One candidate tried on a plan: ``why`` is empty when it runs."""

    path: str
    why: str = ""
    seconds: float = 0.0
    cached: bool = False

    def describe(self) -> str:
        if self.why:
            return f"{self.path} refused ({self.why})"
        how = "loaded from the cache" if self.cached else "compiled"
        return f"{self.path} {how} in {self.seconds:.1f} s"


# ---- the graph as a module --------------------------------------------------------------------
def graph_module(
    graph: Graph, handle: Handle, config: EngineConfig, weights: Mapping[str, Tensor], acts: Sequence[TensorAttr]
) -> Any:
    """The graph as a torch Module: weights as buffers (what freezing folds), the
    activations as positional arguments, the outputs as a tuple in the graph's order."""
    torch = _torch()
    ctx = _Ctx(graph, handle, EngineConfig("torch", (("compile", True), ("memory_format", config.get("memory_format", "auto")))))
    ctx.functional = True
    fn = _graph_function(graph, ctx, torch.device("cpu"), {})
    names = list(weights)
    act_names = [t.name for t in acts]
    out_names = [t.name for t in graph.outputs()]

    class GraphModule(torch.nn.Module):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            for i, n in enumerate(names):
                self.register_buffer(f"w{i}", weights[n])

        def forward(self, *xs: Tensor) -> tuple[Tensor, ...]:
            env = {n: getattr(self, f"w{i}") for i, n in enumerate(names)}
            env.update(zip(act_names, xs, strict=True))
            res = fn(env)
            return tuple(res[n] for n in out_names)

    return GraphModule().eval()


def _plain(x: Tensor) -> Tensor:
    """A normal tensor with ``x``'s values and strides (export and make_fx refuse inference
    tensors, and the plan's tensors may view read-only NumPy memory)."""
    torch = _torch()
    return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype).copy_(x)


# ---- the candidates ---------------------------------------------------------------------------
def compile_inductor(module: Any, example: Sequence[Tensor]) -> Callable[..., Sequence[Tensor]]:
    """make_fx (weights become constants of the FX graph) + Inductor with freezing."""

    def run(*xs: Tensor) -> list[Tensor]:
        return list(module(*xs))

    return inductor_compile(run, example, {"freezing": True})


def package_key(graph: Graph, weights: Mapping[str, Tensor], acts: Sequence[TensorAttr], memory_format: str = "auto") -> str:
    """What an AOTInductor package is compiled from: the graph, the activations' layouts,
    every weight's bytes (they are folded in), torch and the CPU (code is built for it)."""
    torch = _torch()
    h = hashlib.sha256()
    h.update(f"recipe {RECIPE}|torch {torch.__version__}|{cpu_identity()}|{memory_format}|".encode())
    h.update(graph.to_json().encode())
    for t in acts:
        h.update(f"|act {t.name} {t.dtype.name} {t.shape} {t.strides}".encode())
    for name, value in weights.items():
        h.update(f"|w {name} {value.dtype} {tuple(value.shape)} {tuple(value.stride())}|".encode())
        arr = value.detach().contiguous().numpy() if value.dtype != torch.bfloat16 else value.view(torch.int16).contiguous().numpy()
        h.update(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)
    return h.hexdigest()[:32]


def cached_package(key: str) -> Callable[..., Sequence[Tensor]] | None:
    """The cached AOTInductor package for ``key``, loaded; None when there is none, or it is
    not the file stored or unusable (aoti_cache.cached: compiled again)."""
    return aoti_cache.cached(key, None)


def compile_aoti(module: Any, example: Sequence[Tensor], key: str) -> Callable[..., Sequence[Tensor]]:
    """torch.export + AOTInductor with freezing; the package kept in the cache under ``key``
    (aoti_cache.store, with its digest)."""
    torch = _torch()
    keep = aoti_cache.staging_dir()
    with tempfile.TemporaryDirectory(prefix="fusegraph-aoti-", dir=keep) as tmp:
        target = Path(tmp) / "model.pt2"
        program = torch.export.export(module, tuple(example))
        torch._inductor.aoti_compile_and_package(program, package_path=str(target), inductor_configs={"freezing": True})
        call = load_package(target)
        if keep:
            aoti_cache.store(target, key)
        return call


# ---- threads ----------------------------------------------------------------------------------
class AdaptiveThreads:
    """Calls ``fn`` with all cores or one, whichever the calls say is faster.

    ``warm`` times one call on each setting at build time (after an untimed first call on
    each: a first call on a thread count creates oneDNN's primitives for it) and starts on
    the faster. Every call is timed; after ``gap`` calls on the current setting, up to PROBE
    calls run on the other, and the medians decide (the other must be MARGIN faster to
    switch; a probe more than twice as slow ends the probing at once; a call on several
    threads JUMP times slower than the recent ones probes at once). A confirmed choice
    at least doubles the gap, and stretches it so that the extra time probes cost stays
    under OVERHEAD of the time spent: on a loaded 2-core machine a 2-thread call of a
    transformer unit took 500 ms against 11 ms on one thread (every parallel region waits
    for a descheduled thread), so probes must be rare there. A switch resets the gap.
    Numerics do not depend on the choice beyond summation order.
    """

    PROBE = 2
    MIN_GAP = 16
    MAX_GAP = 1 << 16
    MARGIN = 0.95
    OVERHEAD = 0.01
    JUMP = 3.0

    def __init__(self, fn: Callable[..., Sequence[Tensor]], many: int) -> None:
        self.fn = fn
        self.many = max(1, many)
        self.threads = self.many
        self.gap = self.MIN_GAP
        self.left = self.MIN_GAP
        self.recent: deque[float] = deque(maxlen=8)
        self.probes: list[float] = []
        self.switches = 0

    def warm(self, *xs: Tensor) -> None:
        """One untimed and one timed call on each setting; the faster is the first choice."""
        if self.many == 1:
            return
        took: dict[int, float] = {}
        for n in (self.many, 1):
            self._call(n, xs)
            t0 = time.perf_counter()
            self._call(n, xs)
            took[n] = time.perf_counter() - t0
        self.threads = min(took, key=lambda n: took[n])
        self.recent.clear()
        self.recent.append(took[self.threads])

    def __call__(self, *xs: Tensor) -> Sequence[Tensor]:
        if self.many == 1:
            return self.fn(*xs)
        probing = self.left <= 0
        n = (1 if self.threads != 1 else self.many) if probing else self.threads
        t0 = time.perf_counter()
        out = self._call(n, xs)
        took = time.perf_counter() - t0
        if not probing:
            self.left -= 1
            if n > 1 and len(self.recent) >= 4 and took > self.JUMP * statistics.median(self.recent):
                self.left = 0  # on several threads and suddenly slow (a neighbour took a core): look now
                self.recent.clear()  # the probe is compared with now, not with before
            self.recent.append(took)
            return out
        self.probes.append(took)
        mine = statistics.median(self.recent) if self.recent else math.inf
        if took > 2 * mine:
            self._stay(mine)
        elif len(self.probes) >= self.PROBE:
            if statistics.median(self.probes) < self.MARGIN * mine:
                self.threads, self.gap, self.switches = n, self.MIN_GAP, self.switches + 1
                self.recent.clear()
                self.recent.extend(self.probes)
                self.probes = []
                self.left = self.gap
            else:
                self._stay(mine)
        return out

    def _stay(self, mine: float) -> None:
        extra = max(sum(self.probes) - len(self.probes) * mine, 0.0)
        bound = math.ceil(extra / (self.OVERHEAD * mine)) if math.isfinite(mine) and mine > 0 else 0
        self.gap = min(max(2 * self.gap, bound), self.MAX_GAP)
        self.probes = []
        self.left = self.gap

    def _call(self, n: int, xs: Sequence[Tensor]) -> Sequence[Tensor]:
        torch = _torch()
        before = torch.get_num_threads()
        if n == before:
            return self.fn(*xs)
        torch.set_num_threads(n)  # process-wide in torch: restored right after
        try:
            return self.fn(*xs)
        finally:
            torch.set_num_threads(before)


# ---- the chain ------------------------------------------------------------------------------
def build(
    path: str,
    graph: Graph,
    handle: Handle,
    config: EngineConfig,
    weights: Mapping[str, Tensor],
    acts: Sequence[TensorAttr],
    values: Sequence[Tensor],
) -> tuple[Callable[..., Sequence[Tensor]], Attempt]:
    """Compiles ``graph`` with ``weights`` frozen in through ``path`` (``aoti`` or
    ``inductor``); raises on refusal (the caller records why and tries the next)."""
    torch = _torch()
    t0 = time.perf_counter()
    key = package_key(graph, weights, acts, str(config.get("memory_format", "auto"))) if path == "aoti" else ""
    fn = cached_package(key) if key else None
    cached = fn is not None
    if fn is None:
        with torch.inference_mode(False), torch.no_grad():  # freezing needs grad off, export normal tensors
            plain = {n: _plain(w) for n, w in weights.items()}
            example = [_plain(v) for v in values]
            module = graph_module(graph, handle, config, plain, acts)
            if path == "aoti":
                fn = compile_aoti(module, example, key)
            elif path == "inductor":
                fn = compile_inductor(module, example)
            else:
                raise ValueError(f"unknown compiled CPU path {path!r}")
    return fn, Attempt(path, "", time.perf_counter() - t0, cached)


def can_compile() -> str:
    """'' where Inductor can build CPU code here (a C++ compiler on PATH), else why not.
    Asked per CPU plan build: the PATH search (three ``shutil.which``) was about a fifth of a
    build's profile in a session's open, so it is made once per PATH."""
    return _compiler_on(os.environ.get("PATH"))


@functools.cache
def _compiler_on(path: str | None) -> str:
    import shutil

    if any(shutil.which(c, path=path) for c in ("g++", "c++", "clang++")):
        return ""
    return "no C++ compiler on PATH (Inductor needs one on CPU)"


def plan_chain(graph: Graph, config: EngineConfig, onednn_graph: bool) -> tuple[str, ...]:
    """The candidates a CPU plan of ``graph`` under ``config`` tries once its weights are bound."""
    knob = str(config.get("cpu_compile", knob_default()))
    if not worth_compiling(graph) or can_compile():
        knob = "off"
    return chain(knob, onednn_graph)


class FrozenCpu:
    """TorchPlan's CPU path once weights are bound (a mixin: the state is the plan's):
    the chain of candidates tried on the first call, the one that runs, and why the others
    did not. The result sits where the oneDNN Graph function did (``_llga``), so the plan's
    hot path serves both."""

    graph: Graph
    handle: Handle
    config: EngineConfig
    _torch: Any
    _fn: Callable[[dict[str, Tensor]], dict[str, Tensor]]
    _dense: dict[str, Tensor]
    _bound: dict[str, tuple[Any, Tensor]]
    _out_names: list[str]
    _cpu_chain: tuple[str, ...]
    _cpu_path: str
    _cpu_attempts: list[Attempt]
    _llga: Any
    _llga_bound: Any
    _llga_fresh: frozenset[str]
    _hot_in: list[tuple[Any, ...]] | None
    _hot_out: list[tuple[str, TensorAttr, bool]]

    def onednn_graph_verdict(
        self, pack: Any, *, probe: bool = True, acts: list[TensorAttr] | None = None, values: list[Tensor] | None = None
    ) -> str:
        raise NotImplementedError  # TorchPlan's

    def _inputs_of(self, pack: Any) -> dict[str, Tensor]:
        raise NotImplementedError  # TorchPlan's

    def _hot_spec(self) -> tuple[list[tuple[Any, ...]] | None, list[tuple[str, TensorAttr, bool]]]:
        raise NotImplementedError  # TorchPlan's

    def _settle_cpu_path(self, pack: Any, acts: list[TensorAttr], values: list[Tensor]) -> str:
        """Tries the chain in order; '' once one runs (installed as ``_llga``), else every
        candidate's reason, '; '-joined."""
        from fusegraph.engines.torch.onednn_graph import agrees

        self._cpu_attempts = []
        eager: list[Tensor] | None = None
        for path in self._cpu_chain:
            t0 = time.perf_counter()
            if path == "onednn_graph":
                why = self.onednn_graph_verdict(pack, acts=acts, values=values)
                self._cpu_attempts.append(Attempt(path, why, time.perf_counter() - t0))
                if not why:
                    self._cpu_path = path
                    return ""
                continue
            try:
                fn, attempt = build(path, self.graph, self.handle, self.config, self._dense, acts, values)
                torch = self._torch
                with torch.inference_mode():
                    got = list(fn(*values))
                    again = list(fn(*values))  # with ``got`` alive: a result at the same address is not fresh
                    if eager is None:
                        res = self._fn(self._inputs_of(pack))
                        eager = [res[n] for n in self._out_names]
                why = agrees(got, eager, AGREE)
            except Exception as exc:  # the candidate's gap: an op it cannot take, a failed compile
                attempt, why = Attempt(path, "", time.perf_counter() - t0), reason(exc)
            if why:
                self._cpu_attempts.append(Attempt(path, why, time.perf_counter() - t0))
                continue
            self._cpu_attempts.append(attempt)
            fresh = {
                name for name, a, b in zip(self._out_names, got, again, strict=True)
                if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
            }
            self._llga = AdaptiveThreads(fn, self._torch.get_num_threads())
            with self._torch.inference_mode():
                self._llga.warm(*values)
            self._llga_bound, self._llga_fresh = self._bound, frozenset(fresh)
            self._hot_in, self._hot_out = self._hot_spec()
            self._cpu_path = path
            refused = [a.describe() for a in self._cpu_attempts if a.why]
            if refused:
                log.warning("graph '%s': CPU path %s (%s)", self.graph.name, path, "; ".join(refused))
            log.info("graph '%s': CPU path %s", self.graph.name, attempt.describe())
            return ""
        return "; ".join(a.describe() for a in self._cpu_attempts) or "no CPU path candidate"


def reason(exc: BaseException) -> str:
    """An exception as one short line for the report."""
    text = str(exc).strip()
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first[:240]}" if first else type(exc).__name__


__all__ = [
    "CHOICES",
    "ENV",
    "AdaptiveThreads",
    "Attempt",
    "FrozenCpu",
    "build",
    "cached_package",
    "can_compile",
    "chain",
    "compile_aoti",
    "compile_inductor",
    "cpu_identity",
    "graph_module",
    "knob_default",
    "load_package",
    "package_key",
    "plan_chain",
    "reason",
    "worth_compiling",
]
