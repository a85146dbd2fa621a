"""The Triton engine: a graph of pointwise ops around softmax, norms or trailing
reductions becomes one generated row kernel (rows.py says which graphs, codegen.py writes
the kernel); layer and RMS norm backward become a kernel pair of their own
(norm_backward.py: dX per row, dScale/dBias summed in two deterministic stages). It
exists for the memory-bound graphs that cuDNN either has no engine for (softmax) or runs
as a library kernel that leaves bandwidth unused: on the H100 a row kernel ran softmax
8192x4096 f16 in 0.055 ms against 0.110 eager and 0.084 compiled by Inductor (docs/gpu.md).

Nothing here imports triton or torch at module import; ``supports`` answers from the
graph's shape alone (no compile), ``build`` writes the kernel's text to the cache
directory, imports it and launches it once, which is when Triton compiles (its own cache
keeps the binary for later processes).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import logging
import math
import sys
import tempfile
import threading
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from fusegraph import __version__
from fusegraph.dtypes import DataType
from fusegraph.engines.base import EngineConfig, Knob, Support, distribution_version, knob_values
from fusegraph.engines.torch.convert import cuda_torch_support, gpu_exists
from fusegraph.errors import CompileError, UnsupportedError
from fusegraph.graph.graph import Graph
from fusegraph.graph.ops import OpKind
from fusegraph.runtime.cache_dir import atomic_write_bytes, cache_enabled, cache_root, ensure_dir
from fusegraph.runtime.handle import Handle

log = logging.getLogger("fusegraph.engines.triton")

INSTALL_HINT = "Triton ships with PyTorch's CUDA wheels on Linux (pip install torch); it needs an NVIDIA GPU"
ROWS_CHOICES = (1, 2, 4, 8, 16, 32, 64)
WARPS_CHOICES = (1, 2, 4, 8, 16)
TILE_TARGET = 4096  # elements per program (H200, 8192x4096 f16: one row per program)
# _self_check's bound on ||triton - torch|| / ||torch|| over each output: the torch engine
# rounds every intermediate to the graph's type, the row kernel only its outputs
SELF_CHECK_TOL = {DataType.FLOAT: 1e-4, DataType.HALF: 2e-2, DataType.BFLOAT16: 5e-2}
PER_THREAD = 32  # elements per thread: layernorm+GELU 0.0589 ms at 4 warps vs 0.0636 at 8, 0.0724 at 16 (H200)


def default_tiling(rows: int, cols: int) -> tuple[int, int]:
    """Rows per program and warps: about TILE_TARGET elements per program, PER_THREAD per thread."""
    from fusegraph.engines.triton.codegen import block_of

    block = block_of(cols)
    per = max(1, min(ROWS_CHOICES[-1], TILE_TARGET // block, block_of(rows)))
    warps = max(WARPS_CHOICES[0], min(WARPS_CHOICES[-1], per * block // (32 * PER_THREAD)))
    return per, warps


class TritonEngine:
    """See the module docstring; knobs: ``cuda_graph`` (engines/launch_replay.py),
    ``rows_per_program``, ``num_warps`` and, for graphs with GELU, ``gelu_cdf``
    (codegen.GELU_CDF_MODES: the polynomial CDF by default)."""

    name = "triton"

    def __init__(self) -> None:
        self._libs: tuple[Any, Any] | None = None
        self._runtime: Support | None = None
        self._lock = threading.Lock()
        self._kernels: dict[str, Any] = {}  # source key -> the loaded kernel module (Triton caches its binaries)
        self._checked: set[str] = set()  # source keys whose first run agreed with the torch engine (_self_check)

    @property
    def version(self) -> str:
        try:
            return f"{__version__}+triton{distribution_version('triton')}"
        except metadata.PackageNotFoundError:
            return __version__

    def available(self) -> Support:
        """Without importing a library: Triton installed beside a CUDA build of PyTorch."""
        if importlib.util.find_spec("triton") is None:
            return Support.no(f"Triton is not installed ({INSTALL_HINT})")
        return cuda_torch_support("the Triton engine", INSTALL_HINT)

    def _load(self) -> tuple[Any, Any]:
        if self._libs is None:
            torch = importlib.import_module("torch")
            triton = importlib.import_module("triton")
            self._libs = (triton, torch)
        return self._libs

    def _device_support(self, handle: Handle) -> Support:
        if handle.device.kind != "cuda":
            return Support.no(f"Triton row kernels run on NVIDIA GPUs only; the handle is {handle.device}")
        avail = self.available()
        if not avail:
            return avail
        if self._runtime is None:
            try:
                _, torch = self._load()
                ok = torch.cuda.is_available()
                self._runtime = Support.yes() if ok else Support.no(f"no CUDA GPU visible ({torch.__version__})")
            except Exception as exc:
                self._runtime = Support.no(f"importing Triton failed: {type(exc).__name__}: {exc}")
        if not self._runtime:
            return self._runtime
        _, torch = self._load()
        return gpu_exists(torch, handle.device.index)

    def supports(self, graph: Graph, handle: Handle) -> Support:
        dev = self._device_support(handle)
        if not dev:
            return dev
        from fusegraph.engines.triton.norm_backward import analyze_norm_backward, is_norm_backward
        from fusegraph.engines.triton.rows import Refusal, analyze

        graph = graph.ensure_valid()
        try:
            if is_norm_backward(graph):
                analyze_norm_backward(graph)
            else:
                analyze(graph)
        except Refusal as why:
            return Support.no(str(why))
        return Support.yes()

    def knobs(self, graph: Graph, handle: Handle) -> Sequence[Knob]:
        from fusegraph.engines.triton.codegen import GELU_CDF_MODES, block_of, uses_gelu
        from fusegraph.engines.triton.norm_backward import is_norm_backward
        from fusegraph.engines.triton.rows import Refusal, analyze

        graph = graph.ensure_valid()
        if is_norm_backward(graph):
            return self._norm_backward_knobs(graph)
        try:
            rg = analyze(graph)
        except Refusal:
            return []
        per, warps = default_tiling(rg.rows, rg.cols)
        block = block_of(rg.cols)
        rows = tuple(r for r in ROWS_CHOICES if r <= block_of(rg.rows) and r * block <= 4 * TILE_TARGET) or (1,)
        knobs = [  # cuda_graph first: the autotuner's product varies it slowest (its "off" configs come last)
            Knob("cuda_graph", "auto", choices=("auto", "off"),
                 description="replay a captured launch when the default stream repeats the same pointers ('off': launch every call)"),
            Knob("rows_per_program", per, rows, description="rows each program holds in registers"),
            Knob("num_warps", warps, WARPS_CHOICES, description="warps per program"),
        ]
        if uses_gelu(rg):  # offered only where it changes the kernel (autotuning times every setting)
            # last: the varying knob of heuristics.knob_configs' product, so both forms are
            # tried at each tiling before its cap on configurations is reached
            knobs.append(Knob("gelu_cdf", GELU_CDF_MODES[0], GELU_CDF_MODES,
                              description="GELU's normal CDF: a polynomial with one exp2 (default), or libdevice erf"))
        return knobs

    def build(self, graph: Graph, handle: Handle, config: EngineConfig | None = None) -> Any:
        from fusegraph.engines.triton.codegen import GELU_CDF_MODES, kernel_source
        from fusegraph.engines.triton.norm_backward import is_norm_backward
        from fusegraph.engines.triton.plan import TritonPlan
        from fusegraph.engines.triton.rows import Refusal, analyze

        graph = graph.ensure_valid()
        sup = self._device_support(handle)
        if not sup:
            raise UnsupportedError(f"triton cannot run graph '{graph.name}': {sup.reason}")
        if is_norm_backward(graph):
            return self._build_norm_backward(graph, handle, config)
        try:
            rg = analyze(graph)
        except Refusal as why:
            raise UnsupportedError(f"triton cannot run graph '{graph.name}': {why}") from None
        config = config or EngineConfig(self.name)
        values = knob_values(self.name, self.knobs(graph, handle), config)
        per, warps = int(values["rows_per_program"]), int(values["num_warps"])
        text = kernel_source(graph, rg, per, str(values.get("gelu_cdf", GELU_CDF_MODES[0])))
        key = hashlib.sha256(f"{text}|{self.version}".encode()).hexdigest()[:24]
        path = _kernel_file(key, text)
        _, torch = self._load()
        try:
            kernel = self._kernel(key, path)
        except Exception as exc:
            raise _compile_error(graph, exc, text, key) from exc
        programs = -(-rg.rows // per)
        plan = TritonPlan(graph, handle, config, torch=torch, kernel=kernel, programs=programs, num_warps=warps, source=path)
        self._first_launch(plan, graph, handle, text, key)
        if any(n.kind == OpKind.RESHAPE for n in rg.order):
            self._self_check(plan, graph, handle, text, key)
        log.debug("triton: graph '%s' -> %s (%d programs x %d rows, %d warps)", graph.name, path, programs, per, warps)
        return plan

    def _kernel(self, key: str, path: Path, function: str | None = None) -> Any:
        """The jitted ``function`` (default: the row kernel's) of the module written at ``path``."""
        from fusegraph.engines.triton.codegen import KERNEL

        with self._lock:
            module = self._kernels.get(key)
            if module is None:
                name = f"fusegraph_triton_{key}"
                spec = importlib.util.spec_from_file_location(name, path)
                assert spec is not None and spec.loader is not None
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module  # Triton reads the function's source through its module
                spec.loader.exec_module(module)
                self._kernels[key] = module
            return getattr(module, function or KERNEL)

    # ---- norm backward: its own kernel pair (norm_backward.py) --------------------------------
    def _sm_count(self, handle: Handle) -> int:
        _, torch = self._load()
        return int(torch.cuda.get_device_properties(handle.device.index).multi_processor_count)

    def _norm_backward_knobs(self, graph: Graph) -> list[Knob]:
        from fusegraph.engines.triton.norm_backward import (
            PREFETCH,
            analyze_norm_backward,
            block_of,
            default_tiling,
        )
        from fusegraph.engines.triton.rows import Refusal

        try:
            view = analyze_norm_backward(graph)
        except Refusal:
            return []
        per, warps, per_sm, _ = default_tiling(view.rows, view.cols, 1)
        block = block_of(view.cols)
        # tiles past 4096 elements spill registers at 16 warps (norm_backward.py)
        rows = tuple(r for r in ROWS_CHOICES if r <= block_of(view.rows) and r * block <= 4096) or (1,)
        return [
            Knob("rows_per_program", per, rows, description="rows of each tile a program holds in registers"),
            Knob("num_warps", warps, WARPS_CHOICES, description="warps per program of the row pass"),
            Knob("programs_per_sm", per_sm, (1, 2, 4, 8),
                 description="row-pass programs per SM (each adds one row of partial column sums to the workspace)"),
            Knob("prefetch", PREFETCH, (0, 1, 2, 3),
                 description="row tiles a program has loading ahead of the one it computes (0: one tile at a time)"),
        ]

    def _build_norm_backward(self, graph: Graph, handle: Handle, config: EngineConfig | None) -> Any:
        from fusegraph.engines.triton.norm_backward import (
            ROW_KERNEL,
            SUM_KERNEL,
            analyze_norm_backward,
            norm_backward_source,
            sum_programs,
            workspace_floats,
        )
        from fusegraph.engines.triton.plan import NormBackwardPlan
        from fusegraph.engines.triton.rows import Refusal

        try:
            view = analyze_norm_backward(graph)
        except Refusal as why:
            raise UnsupportedError(f"triton cannot run graph '{graph.name}': {why}") from None
        config = config or EngineConfig(self.name)
        values = knob_values(self.name, self._norm_backward_knobs(graph), config)
        per, warps = int(values["rows_per_program"]), int(values["num_warps"])
        tiles = -(-view.rows // per)
        programs = max(1, min(tiles, self._sm_count(handle) * int(values["programs_per_sm"])))
        text = norm_backward_source(graph, view, per, programs, prefetch=int(values["prefetch"]))
        key = hashlib.sha256(f"{text}|{self.version}".encode()).hexdigest()[:24]
        path = _kernel_file(key, text)
        _, torch = self._load()
        try:
            rows_kernel = self._kernel(key, path, ROW_KERNEL)
            sums_kernel = self._kernel(key, path, SUM_KERNEL) if view.sums else None
        except Exception as exc:
            raise _compile_error(graph, exc, text, key) from exc
        plan = NormBackwardPlan(
            graph, handle, config, torch=torch, rows_kernel=rows_kernel, sums_kernel=sums_kernel, programs=programs,
            sum_programs=sum_programs(view), num_warps=warps, workspace=workspace_floats(view, programs), source=path,
        )
        self._first_launch(plan, graph, handle, text, key)
        log.debug("triton: graph '%s' -> %s (norm backward: %d programs, %d rows a tile, %d warps)",
                  graph.name, path, programs, per, warps)
        return plan

    def _first_launch(self, plan: Any, graph: Graph, handle: Handle, text: str, key: str) -> None:
        """Triton compiles on the first launch: done here, on zeroed tensors of the declared layouts."""
        _, torch = self._load()
        try:
            with torch.cuda.device(handle.device.index):
                dummy = {t.name: torch.empty_strided(t.shape, t.strides, dtype=plan._tdt[t.name], device=plan.device).zero_()
                         for t in graph.inputs()}
                plan.execute(dummy)
                torch.cuda.synchronize(handle.device.index)
        except Exception as exc:
            raise _compile_error(graph, exc, text, key) from exc

    def _self_check(self, plan: Any, graph: Graph, handle: Handle, text: str, key: str) -> None:
        """Row kernels through reshapes (a group norm's per-channel affine read through the
        [N*G, K] frame) address each tensor by div/mod terms no other kernel uses. They matched
        float64 on an H200 for 21 group norms and 30 random reshaped graphs built as given, but
        the front doors' folded forms (views into the caller's tensors) have not run on a GPU
        yet. So each such kernel's first build runs it once on random inputs against the torch
        engine running the same graph op by op, and a disagreement refuses the graph (the
        reproducer kept) instead of returning wrong numbers."""
        if key in self._checked:
            return
        import torch

        from fusegraph.engines.registry import REGISTRY

        gen = torch.Generator(device=plan.device).manual_seed(0)
        on_gpu = plan.device.type == "cuda"
        with torch.cuda.device(handle.device.index) if on_gpu else contextlib.nullcontext():
            pack = {}
            for t in graph.inputs():
                x = torch.empty_strided(t.shape, t.strides, dtype=plan._tdt[t.name], device=plan.device)
                pack[t.name] = x.normal_(generator=gen) if x.is_floating_point() else x.zero_()
            got = plan.execute(pack)
            want = REGISTRY.get("torch").build(graph, handle, EngineConfig("torch")).execute(pack)
            worst = 0.0
            for name, ref in want.items():
                a, b = torch.as_tensor(got[name]).double(), torch.as_tensor(ref).double()
                err = float((a - b).norm() / max(float(b.norm()), 1e-30)) if torch.isfinite(a).all() else math.inf
                worst = max(worst, err)
        tolerance = SELF_CHECK_TOL.get(graph.io_data_type or graph.inputs()[0].dtype, 1e-3)
        if not worst <= tolerance:
            kept = _keep_reproducer(graph, text, key)
            raise UnsupportedError(
                f"triton: the row kernel of graph '{graph.name}' disagrees with the torch engine's op-by-op run "
                f"of the same graph on random inputs (relative error {worst:.1e} > {tolerance:.0e}); reproducer: {kept}")
        self._checked.add(key)


def _kernel_file(key: str, text: str) -> Path:
    """The kernel's text under ``<cache>/triton/``, or a temporary directory when the cache is off or unusable."""
    root = cache_root() / "triton"
    if cache_enabled() and ensure_dir(root):
        path = root / f"{key}.py"
        if not path.is_file():
            atomic_write_bytes(path, text.encode())
        return path
    path = Path(tempfile.mkdtemp(prefix="fusegraph-triton-")) / f"{key}.py"
    path.write_text(text)
    return path


def _keep_reproducer(graph: Graph, text: str, key: str) -> Path | None:
    repro = cache_root() / "failures" / f"triton-{graph.name}-{key[:12]}"
    try:
        repro.mkdir(parents=True, exist_ok=True)
        (repro / "kernel.py").write_text(text)
        (repro / "graph.json").write_text(graph.to_json(indent=1))
        return repro
    except OSError as err:
        log.warning("could not keep the Triton reproducer in %s: %s", repro, err)
        return None


def _compile_error(graph: Graph, exc: BaseException, text: str, key: str) -> CompileError:
    kept = _keep_reproducer(graph, text, key)
    return CompileError(
        f"Triton could not compile the row kernel of graph '{graph.name}': {type(exc).__name__}: {str(exc)[:2000]}",
        diagnostic=str(exc), reproducer=kept,
    )
