"""IreeEngine: whole graphs emitted as torch-dialect MLIR, compiled by IREE, cached, run.

build() = key -> in-memory module? -> disk cache? -> emit + compile + store -> bind.
The key covers everything the compiled code depends on (graph, target and host CPU,
flags, IREE, emitter), so a warm build never emits or compiles -- nor imports what does:
the lowerings (``emit.lower_table()``) and the compiler driver (``compile.py``) are loaded
by the first compile, and supports() answers from the cache when the graph's module for the
default knobs is there (issue 10: a cached build in a fresh process).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

from fusegraph import __version__
from fusegraph.engines.base import EngineConfig, Knob, Support
from fusegraph.engines.iree.cache import CacheEntry, ModuleCache, failures_dir
from fusegraph.engines.iree.flags import FlagSet, flag_knobs, flagset_from_knobs
from fusegraph.engines.iree.targets import TARGETS, Target, target_for_device
from fusegraph.errors import CompileError, FusegraphError, UnsupportedError
from fusegraph.graph import layout
from fusegraph.graph.graph import Graph
from fusegraph.runtime.handle import Handle

log = logging.getLogger("fusegraph.iree")

KEY_SCHEMA = 1
FUNC_NAME = "main"
# Choices of EmitOptions fields that a dataclass default cannot tell.
_EMIT_CHOICES: dict[str, tuple[Any, ...]] = {"conv_layout": ("nhwc", "nchw")}

Emitter = Callable[..., Any]  # emit_mlir(graph, func_name=..., options=...) -> EmittedModule


@cache
def iree_version() -> str:
    """The IREE runtime's version and revision (read without importing the compiler)."""
    from fusegraph.runtime.iree_hal import runtime_version_module

    try:
        v = runtime_version_module()
        rev = getattr(v, "REVISIONS", {}).get("IREE", "")
        return f"{v.VERSION}@{rev[:12]}" if rev else str(v.VERSION)
    except Exception:
        return "unavailable"


@cache
def _compiler_locations() -> tuple[str, ...]:
    """Where the iree.compiler package lives (found, not imported: the import takes 160 ms).
    Kept for the process, as compiler_version() is: selection asks available() often."""
    try:
        spec = importlib.util.find_spec("iree.compiler")
    except (ImportError, ValueError):
        return ()
    return tuple(spec.submodule_search_locations or ()) if spec else ()


@cache
def compiler_version() -> str:
    """The IREE compiler package's version, from its version.py (no import: 160 ms)."""
    try:
        for loc in _compiler_locations():
            text = (Path(loc) / "version.py").read_text()
            m = re.search(r"VERSION\s*=\s*['\"]([^'\"]+)", text)
            if m:
                return m.group(1)
    except OSError:
        pass
    return "unknown"


def _compiler() -> ModuleType:
    """engines/iree/compile.py, imported by the first compile (a cached build needs none of
    it: subprocess, signal, resource... cost a fresh process ~5 ms)."""
    from fusegraph.engines.iree import compile as iree_compile

    return iree_compile


@cache
def _has_compiler() -> bool:
    """Whether ``iree-compile`` can be found; where the package ships the binary at its usual
    place this is a stat, else compile.py's own search (which may import iree.compiler)."""
    if any((Path(loc) / "_mlir_libs" / "iree-compile").exists() for loc in _compiler_locations()):
        return True
    try:
        return _compiler().iree_compile_path() is not None
    except Exception:
        return False


@cache
def _runtime_missing() -> str:
    """Why iree.runtime cannot be found ("" when it can), without importing it."""
    try:
        found = importlib.util.find_spec("iree.runtime") is not None
    except (ImportError, ValueError) as exc:
        return str(exc)
    return "" if found else "no module named 'iree.runtime'"


def _emit_module() -> Any:
    from fusegraph.engines.iree import emit

    return emit


def emitter_version(emitter: Emitter | None) -> str:
    """Changes whenever the emitter's code does, so stale MLIR never comes from the cache."""
    if emitter is not None:
        return str(getattr(emitter, "version", None) or f"{emitter.__module__}.{getattr(emitter, '__qualname__', '?')}")
    return _default_emitter_version()


@cache
def _default_emitter_version() -> str:
    emit = _emit_module()
    src = Path(emit.__file__).read_bytes() if getattr(emit, "__file__", None) else b""
    return f"{getattr(emit, 'EMITTER_VERSION', '0')}:{hashlib.sha256(src).hexdigest()[:12]}"


class IreeEngine:
    """The IREE JIT engine (see the module docstring and docs/iree_engine.md)."""

    name = "iree"

    def __init__(self, emitter: Emitter | None = None, cache: ModuleCache | None = None) -> None:
        self._emitter = emitter  # None: fusegraph.engines.iree.emit.emit_mlir
        self.cache = cache or ModuleCache()
        # graph key -> the emitter's unsupported_reason (emitting a graph to ask costs ms).
        self._reasons: dict[str, str | None] = {}

    @property
    def version(self) -> str:
        return f"{__version__}+iree{iree_version()}"

    def __repr__(self) -> str:
        return f"<IreeEngine {self.version}>"

    # ---- protocol ------------------------------------------------------------------------------
    def available(self) -> Support:
        """Cheap (the registry asks every engine): the runtime and compiler packages are
        found, not imported; a runtime that fails to import is reported by supports()."""
        why = _runtime_missing()
        if why:
            return Support.no(f"iree-base-runtime is not installed ({why})")
        if compiler_version() == "unknown" or not _has_compiler():
            return Support.no("iree-base-compiler is not installed")
        return Support.yes()

    def supports(self, graph: Graph, handle: Handle) -> Support:
        avail = self.available()
        if not avail:
            return avail
        kind = handle.device.kind
        if kind not in TARGETS:
            return Support.no(f"no IREE target for device kind '{kind}'")
        from fusegraph.engines.iree.runtime import available_drivers, bindings, runtime_for

        target = TARGETS[kind]
        try:
            bindings()
            if target.driver not in available_drivers():
                return Support.no(f"the installed IREE runtime has no '{target.driver}' driver")
            runtime_for(handle)
        except UnsupportedError as exc:
            return Support.no(exc.detail)
        except ImportError as exc:
            return Support.no(f"iree-base-runtime is not installed ({exc})")
        if self._emitter is None and self._in_cache(graph, target):
            return Support.yes()  # the emitter lowered this graph already (its version is in the key)
        if self._emitter is None:
            try:
                emit = _emit_module()
            except ImportError as exc:
                return Support.no(f"the IREE emitter is not available: {exc}")
            check = getattr(emit, "unsupported_reason", None)
            if check is not None:
                key = f"{graph.ensure_valid().key()}:{_default_emitter_version()}"
                if key not in self._reasons:
                    if len(self._reasons) > 1024:
                        self._reasons.clear()
                    self._reasons[key] = check(graph)
                reason = self._reasons[key]
                if reason:
                    return Support.no(str(reason))
        return Support.yes()

    def _in_cache(self, graph: Graph, target: Target) -> bool:
        """Whether the module of ``graph`` for the default knobs is in the cache: then the
        emitter at this version lowered it with the default EmitOptions, which is what
        ``unsupported_reason`` would try again (and a fresh process need not load the
        lowerings to hear "yes")."""
        if not self.cache.enabled:
            return False
        try:
            key = self._key(graph, target, {})
        except (FusegraphError, ValueError):
            return False
        return self.cache.has(key)

    def knobs(self, graph: Graph, handle: Handle) -> Sequence[Knob]:
        """The knobs that can change this graph's module: autotuning times every setting of
        them, so a conv knob on a pointwise graph would only time the same module again."""
        everything = [*flag_knobs(target_for_device(handle.device)), *self._emit_knobs()]
        return [k for k in everything if _knob_applies(k.name, graph)]

    def build(self, graph: Graph, handle: Handle, config: EngineConfig | None = None) -> Any:
        from fusegraph.engines.iree.plan import IreePlan
        from fusegraph.engines.iree.runtime import runtime_for

        graph.ensure_valid()
        config = config or EngineConfig(self.name)
        target = target_for_device(handle.device)
        runtime = runtime_for(handle)
        entry = self.compile_entry(graph, target, dict(config.knobs))
        loaded = runtime.loaded(entry.key) if self.cache.enabled else None
        if loaded is None:
            if not self.cache.enabled:
                runtime.forget(entry.key)
            loaded = runtime.load(entry.key, entry.vmfb, entry.meta["func_name"], len(entry.meta["outputs"]))
        return IreePlan(graph, handle, self._config(config, entry), runtime=runtime, loaded=loaded, entry=entry)

    # ---- compile + cache --------------------------------------------------------------------------
    def compile_entry(self, graph: Graph, target: Target, knobs: Mapping[str, Any]) -> CacheEntry:
        """The compiled module for graph/target/knobs: from the cache, else compiled and stored."""
        key, flagset, flags, emit_options = self._resolve(graph, target, knobs)
        # one compile per key across processes: others wait on the key's lock, then hit
        return self.cache.compile_once(
            key, lambda: self._compile(graph, target, flagset, flags, emit_options, key)
        )

    def _resolve(self, graph: Graph, target: Target, knobs: Mapping[str, Any]) -> tuple[str, FlagSet, tuple[str, ...], Any]:
        """The cache key of graph/target/knobs, with the flag set, flags and emit options it covers."""
        flagset, emit_options = self._split_knobs(target, knobs)
        flagset = _avoid_llvm_abort(graph, target, flagset, explicit=knobs)
        flagset = _avoid_i1_pack(graph, target, flagset, explicit=knobs)
        flagset = _keep_f64_boundary(graph, flagset)
        flags = flagset.flags(target)
        return self.cache_key(graph, target, flags, emit_options), flagset, flags, emit_options

    def _key(self, graph: Graph, target: Target, knobs: Mapping[str, Any]) -> str:
        return self._resolve(graph, target, knobs)[0]

    def cache_key(self, graph: Graph, target: Target, flags: Sequence[str], emit_options: Any) -> str:
        fields = {
            "schema": KEY_SCHEMA,
            "graph": graph.key(),
            "target": target.cache_identity(),
            "flags": list(flags),
            "iree": [iree_version(), compiler_version()],
            "emitter": emitter_version(self._emitter),
            "emit_options": _options_dict(emit_options),
            "func": FUNC_NAME,
        }
        return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()

    def _compile(
        self, graph: Graph, target: Target, flagset: FlagSet, flags: Sequence[str], emit_options: Any, key: str
    ) -> CacheEntry:
        emitted = self._emit(graph, emit_options)
        iree_compile = _compiler()
        try:
            result = iree_compile.compile_mlir(emitted.text, flags)
        except iree_compile.IreeCompileFailure as exc:
            repro = iree_compile.write_reproducer(
                failures_dir() / f"{_safe(graph.name)}-{key[:12]}",
                emitted.text,
                flags,
                exc.diagnostic,
                note=f"fusegraph graph '{graph.name}' for target {target} (IREE {compiler_version()})",
                extra_files={"graph.json": graph.to_json(indent=1)},
            )
            raise CompileError(
                f"IREE could not compile graph '{graph.name}' for {target}: {exc}",
                diagnostic=exc.diagnostic,
                reproducer=repro,
            ) from None
        log.info(
            "compiled graph '%s' for %s in %.3f s: %s dispatch(es)",
            graph.name, target, result.seconds, result.summary.get("dispatch_count"),
        )
        meta = {
            "graph_name": graph.name,
            "graph_key": graph.key(),
            "target": target.spec,
            "target_identity": target.cache_identity(),
            "flags": list(flags),
            "knobs": {**flagset.as_knobs(), **_options_dict(emit_options)},
            "func_name": emitted.func_name,
            "inputs": list(emitted.inputs),
            "outputs": list(emitted.outputs),
            "statistics": result.summary,
            "compile_seconds": round(result.seconds, 4),
            "compiler_backend": result.backend,
            "iree_version": compiler_version(),
            "emitter_version": emitter_version(self._emitter),
            "fusegraph_version": __version__,
        }
        stats_flags = iree_compile.statistics_flags("repro-stats.json")
        files = {
            "module.mlir": emitted.text,
            "flags.txt": "\n".join(flags) + "\n",
            "command.sh": (
                "#!/bin/sh\n# Recompiles this entry with the iree-compile CLI (writes repro.vmfb, repro-stats.json).\n"
                'cd "$(dirname "$0")" || exit 1\n'
                f"exec {iree_compile.shell_command([*flags, *stats_flags], 'module.mlir', 'repro.vmfb')}\n"
            ),
            "stats.json": json.dumps(result.statistics, indent=1),
            "graph.json": graph.to_json(indent=1),
        }
        return self.cache.put(key, result.vmfb, files, meta)

    def _emit(self, graph: Graph, emit_options: Any) -> Any:
        if self._emitter is not None:
            emitter = self._emitter
        else:
            try:
                emitter = _emit_module().emit_mlir
            except ImportError as exc:
                raise UnsupportedError(f"the IREE emitter is not available: {exc}") from None
        try:
            emitted = emitter(graph, func_name=FUNC_NAME, options=emit_options)
        except FusegraphError:
            raise
        except Exception as exc:
            raise CompileError(f"the IREE emitter failed on graph '{graph.name}': {type(exc).__name__}: {exc}") from exc
        _check_boundary(graph, emitted)
        return emitted

    # ---- knobs -----------------------------------------------------------------------------------
    def _emit_knobs(self) -> list[Knob]:
        try:
            emit = _emit_module()
        except ImportError:
            return []
        custom = getattr(emit, "EMIT_KNOBS", None)
        if custom is not None:
            return list(custom)
        opts = getattr(emit, "EmitOptions", None)
        if opts is None or not dataclasses.is_dataclass(opts):
            return []
        out = []
        for f in dataclasses.fields(opts):
            if f.default is dataclasses.MISSING:
                continue
            choices = _emit_choices(emit, f.name, f.default)
            out.append(Knob(f.name, f.default, choices, description=f"emitter option EmitOptions.{f.name}"))
        return out

    def _split_knobs(self, target: Target, knobs: Mapping[str, Any]) -> tuple[FlagSet, Any]:
        flag_names = {k.name for k in flag_knobs(target)}
        emit_table = {k.name: k for k in self._emit_knobs()}
        emit_values: dict[str, Any] = {}
        for name, value in knobs.items():
            if name in flag_names:
                continue
            knob = emit_table.get(name)
            if knob is None:
                known = sorted(flag_names | set(emit_table))
                raise UnsupportedError(f"IREE engine has no knob '{name}' (knobs: {known})")
            knob.check(value)
            emit_values[name] = value
        flagset = flagset_from_knobs(target, knobs)
        emit_options = None
        if self._emitter is None or emit_values:
            try:
                opts_cls = getattr(_emit_module(), "EmitOptions", None)
            except ImportError:
                opts_cls = None
            if opts_cls is not None:
                emit_options = opts_cls(**emit_values)
        return flagset, emit_options

    def _config(self, config: EngineConfig, entry: CacheEntry) -> EngineConfig:
        knobs = dict(entry.meta.get("knobs", {}))
        knobs.update(config.knobs)
        return EngineConfig(self.name, tuple(sorted((k, _hashable(v)) for k, v in knobs.items())))


def _emit_choices(emit: Any, name: str, default: Any) -> tuple[Any, ...]:
    """An EmitOptions field's allowed values: the emitter's constant of that name
    (``conv_layout`` -> ``CONV_LAYOUTS``, ``attention`` -> ``ATTENTION``), else known ones."""
    if isinstance(default, bool):
        return (False, True)
    for const in (name.upper(), name.upper() + "S", name.upper() + "ES"):
        values = getattr(emit, const, None)
        if isinstance(values, tuple) and default in values:
            return values
    return _EMIT_CHOICES.get(name, ())


def _check_boundary(graph: Graph, emitted: Any) -> None:
    """The emitted function must take/return each graph tensor's dense memory-order buffer."""
    want_in = {t.name: t for t in graph.inputs()}
    want_out = {t.name: t for t in graph.outputs()}
    problems = []
    if set(emitted.inputs) != set(want_in):
        problems.append(f"inputs {list(emitted.inputs)} != graph inputs {list(want_in)}")
    if set(emitted.outputs) != set(want_out):
        problems.append(f"outputs {list(emitted.outputs)} != graph outputs {list(want_out)}")
    if not problems:
        for names, shapes, table in ((emitted.inputs, emitted.input_shapes, want_in), (emitted.outputs, emitted.output_shapes, want_out)):
            for n, shape in zip(names, shapes, strict=True):
                t = table[n]
                phys = layout.physical_shape(t.shape, t.strides)
                if tuple(shape) != phys:
                    problems.append(f"'{n}' crosses as {list(shape)}, its buffer is {list(phys)}")
    if problems:
        raise CompileError(f"the IREE emitter broke the boundary convention for graph '{graph.name}': " + "; ".join(problems))


def _options_dict(options: Any) -> dict[str, Any]:
    if options is None:
        return {}
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        return dataclasses.asdict(options)
    return {"repr": repr(options)}


def _hashable(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:60] or "graph"


def _knob_applies(name: str, graph: Graph) -> bool:
    """Whether knob ``name`` can change the module compiled for ``graph`` (unknown knobs: yes)."""
    from fusegraph.dtypes import DataType
    from fusegraph.graph.ops import CONVOLUTIONS, OpKind

    kinds = {n.kind for n in graph.nodes}
    if name in ("data_tiling", "ukernels"):  # packing and microkernels of contractions
        return bool(kinds & (CONVOLUTIONS | {OpKind.MATMUL, OpKind.SDPA}))
    if name == "fuse_padding":
        return any(
            n.kind in CONVOLUTIONS
            and any((*getattr(n.attrs, "pre_padding", ()), *getattr(n.attrs, "post_padding", ())))
            for n in graph.nodes
        )
    if name in ("conv_layout", "filter_fence"):
        return OpKind.CONV_FPROP in kinds
    if name == "attention":
        return OpKind.SDPA in kinds
    if name == "norm_variance":  # two-pass vs one-pass statistics: computed by these only
        return bool(kinds & {OpKind.LAYERNORM, OpKind.BATCHNORM})
    if name == "round_intermediates":  # rounding virtual tensors to a narrower float type
        narrow = (DataType.HALF, DataType.BFLOAT16, DataType.FP8_E4M3, DataType.FP8_E5M2)
        return any(t.is_virtual and not t.is_output and t.dtype in narrow for t in graph.tensors if not t.is_scalar)
    return True


def _has_bf16_matmul(graph: Graph) -> bool:
    from fusegraph.dtypes import DataType
    from fusegraph.graph.ops import OpKind

    return any(
        n.kind == OpKind.MATMUL and any(t.dtype == DataType.BFLOAT16 for t in n.inputs.values())
        for n in graph.nodes
    )


def _avoid_llvm_abort(graph: Graph, target: Target, flagset: FlagSet, *, explicit: Mapping[str, Any]) -> FlagSet:
    """IREE 3.13's CPU backend cannot be trusted with a data-tiled bf16 matmul: with the
    default microkernels LLVM aborts the process on some ("Do not know how to split the
    result of this operator!") and compiles others for minutes (an int8->bf16 matmul whose
    result is sliced: 117-273 s, 583 MiB, on 2 cores); with ukernels='none' the same graph's
    compile grows without bound (past 6 GiB resident in 2 minutes: the runaway of issue 16,
    benchmarks/bench_build_sequence.py). Without data tiling each compiles in 0.5-2 s. So such
    graphs compile without data tiling by default, and a config that pins data_tiling=True
    for one is refused before the compiler sees it, whatever its microkernels."""
    if target.kind != "cpu" or not flagset.data_tiling or not _has_bf16_matmul(graph):
        return flagset
    if "data_tiling" in explicit:
        raise UnsupportedError(
            f"graph '{graph.name}': a bf16 matmul with data_tiling=True (ukernels={flagset.ukernels!r}) "
            "aborts IREE 3.13's CPU compiler (LLVM: 'Do not know how to split the result of this "
            "operator') or compiles for minutes to gigabytes (ukernels='none'); use data_tiling=False"
        )
    return dataclasses.replace(flagset, data_tiling=False)


def _has_contraction_and_bool(graph: Graph) -> bool:
    from fusegraph.dtypes import DataType
    from fusegraph.graph.ops import OpKind

    if not any(n.kind in (OpKind.MATMUL, OpKind.SDPA) for n in graph.nodes):
        return False
    return any(t.data_type == DataType.BOOLEAN and not t.is_scalar for t in graph.tensors)


def _avoid_i1_pack(graph: Graph, target: Target, flagset: FlagSet, *, explicit: Mapping[str, Any]) -> FlagSet:
    """IREE 3.13 fails to compile a data-tiled matmul whose fused consumer reads a boolean
    tensor from memory ("'linalg.pack' op expected padding_value has 'i8' but got: 'i1'"):
    a select or mask on a matmul result (decomposed causal attention with a boolean mask and
    batch > 1, binary_select of a matmul with a BOOLEAN condition, a cast boolean multiplied
    into one). Such graphs compile without data tiling by default; a config that pins
    data_tiling=True for one is refused before the compiler runs."""
    if not flagset.data_tiling or not _has_contraction_and_bool(graph):
        return flagset
    if "data_tiling" in explicit:
        raise UnsupportedError(
            f"graph '{graph.name}': a matmul or attention with a BOOLEAN tensor and data_tiling=True "
            "fails to compile on IREE 3.13 ('linalg.pack' pads an i1 tensor stored as i8); use "
            "data_tiling=False"
        )
    return dataclasses.replace(flagset, data_tiling=False)


KEEP_F64 = "--iree-input-demote-f64-to-f32=false"


def _keep_f64_boundary(graph: Graph, flagset: FlagSet) -> FlagSet:
    """IREE 3.13 demotes every f64 value to f32 by default (--iree-input-demote-f64-to-f32),
    the function's arguments and results included: an f64 result is then exported as an f64
    buffer view over f32-sized storage (at run time: "buffer view byte length 24 exceeds
    backing buffer byte length 12"), and an f64 argument's bytes are read as f32 storage. The
    emitter already computes f64 graphs in f32 unless f64 is declared (lower_base.compute_type)
    and casts at the boundary, so a graph with an f64 tensor compiles with the demotion off."""
    from fusegraph.dtypes import DataType

    if KEEP_F64 in flagset.extra_flags:
        return flagset
    if not any(t.data_type == DataType.DOUBLE and not t.is_scalar for t in graph.tensors):
        return flagset
    return dataclasses.replace(flagset, extra_flags=(*flagset.extra_flags, KEEP_F64))
