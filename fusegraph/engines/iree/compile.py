"""Runs the IREE compiler: by default as a child ``iree-compile`` under a memory and time
ceiling, or in-process through libIREECompiler (the embedding API's session/invocation).

Why a child by default: the compiler is native code that can take the whole process with it.
IREE 3.13 segfaults on an int8 matmul (torch-to-linalg), aborts on a bf16 matmul with data
tiling (LLVM "Do not know how to split"), and an allocation storm in a compile cannot be
stopped from Python; in a child each of these costs the child, the caller gets a typed
CompileError with the reproducer kept, and selection goes on to the next engine. The price
is starting ``iree-compile`` (loading its 100+ MB library) per compile: measured on the
sequence of small graphs in benchmarks/bench_build_sequence.py, see docs/reliability.md.
``FUSEGRAPH_IREE_COMPILER=inprocess`` (or ``FUSEGRAPH_IREE_COMPILE_LIMITS=off``) compiles
in-process, unbounded, for whoever wants the start-up back. Either way the result carries
IREE's dispatch statistics, which are the evidence of what was fused.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import logging
import os
import re
import shlex
import signal
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from fusegraph.runtime import progress
from fusegraph.runtime.bounded import default_memory_ceiling, run_bounded

log = logging.getLogger("fusegraph.iree")

COMPILER_ENV = "FUSEGRAPH_IREE_COMPILER"  # "cli" (default: a bounded child) | "inprocess"
# "MEM_MIB,SECONDS" (either may be empty: the default for it) or "off": the child's ceilings.
LIMITS_ENV = "FUSEGRAPH_IREE_COMPILE_LIMITS"
# Default ceilings: resident memory min(8 GiB, half the machine), 10 minutes. Small graphs
# compile in 0.3-3 s at 150-250 MiB; the ceilings exist for the runaway, not to judge speed.
DEFAULT_SECONDS = 600.0
# What a compile that ran out of its address space says (the RLIMIT_AS backstop).
_OOM = re.compile(
    r"out of memory|std::bad_alloc|Cannot allocate memory|failed to map segment|Allocation failed|"
    r"mmap.*(failed|ENOMEM)",
    re.IGNORECASE,
)
STATS_FILE = "stats.json"

_SEVERITY = {0: "note", 1: "warning", 2: "error", 3: "remark"}
_DIAG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
# One compile at a time in-process: the compiler library keeps process-wide LLVM state,
# and two compiles on two cores would only race each other for the same cores.
_LOCK = threading.Lock()


class IreeCompileFailure(Exception):
    """IREE rejected the module; ``diagnostic`` is what the compiler said."""

    def __init__(self, message: str, diagnostic: str) -> None:
        super().__init__(message)
        self.diagnostic = diagnostic


class IreeCompileLimitExceeded(IreeCompileFailure):
    """The compile passed its memory or time ceiling and was stopped (the process lives on)."""


@dataclass(frozen=True)
class CompileLimits:
    """Ceilings for one compile, enforced on a child ``iree-compile`` by
    runtime/bounded.py (resident memory read every 50 ms, an address-space backstop, a
    timeout). An in-process compile cannot be stopped, so a bounded compile is always a child."""

    memory_bytes: int | None = None
    seconds: float | None = None

    def describe(self) -> str:
        parts = []
        if self.memory_bytes is not None:
            parts.append(f"memory {self.memory_bytes / 2**20:.0f} MiB")
        if self.seconds is not None:
            parts.append(f"time {self.seconds:g} s")
        return ", ".join(parts) or "none"


def default_limits() -> CompileLimits:
    """The ceilings of a compile nobody configured: min(8 GiB, half the physical memory)
    resident, ``DEFAULT_SECONDS``."""
    return CompileLimits(memory_bytes=default_memory_ceiling(), seconds=DEFAULT_SECONDS)


_OFF = ("off", "none", "no", "0", "inprocess")


def limits_from_env() -> CompileLimits | None:
    """FUSEGRAPH_IREE_COMPILE_LIMITS as ceilings; None when it is unset or "off" (see
    :func:`plan_compile` for what each means)."""
    raw = os.environ.get(LIMITS_ENV, "").strip()
    if not raw or raw.lower() in _OFF:
        return None
    mem, _, sec = raw.partition(",")
    base = default_limits()
    try:
        limits = CompileLimits(
            memory_bytes=int(float(mem) * 2**20) if mem.strip() else base.memory_bytes,
            seconds=float(sec) if sec.strip() else base.seconds,
        )
    except ValueError:
        log.warning("%s=%r is not 'MEM_MIB,SECONDS' or 'off'; using the default ceilings (%s)",
                    LIMITS_ENV, raw, base.describe())
        return base
    if (limits.memory_bytes is not None and limits.memory_bytes <= 0) or (
        limits.seconds is not None and not limits.seconds > 0
    ):
        log.warning("%s=%r: ceilings must be positive; using the default ceilings (%s)", LIMITS_ENV, raw, base.describe())
        return base
    return limits


def plan_compile(backend: str | None = None, limits: CompileLimits | None = None) -> tuple[str, CompileLimits | None]:
    """(backend, ceilings) of a compile. In order: explicit ``limits`` (a bounded child); an
    explicit ``backend`` ("inprocess": unbounded; "cli": a child under the configured or
    default ceilings); FUSEGRAPH_IREE_COMPILE_LIMITS ("off": no ceilings, in-process unless
    FUSEGRAPH_IREE_COMPILER=cli; "MEM_MIB,SECONDS": a child under those);
    FUSEGRAPH_IREE_COMPILER=inprocess (unbounded); else a child under :func:`default_limits`."""
    if limits is not None:
        return "cli", limits
    raw = os.environ.get(LIMITS_ENV, "").strip().lower()
    off = raw in _OFF and raw != ""
    if backend == "inprocess":
        return "inprocess", None
    if backend == "cli":
        return "cli", None if off else (limits_from_env() or default_limits())
    if off:
        return compiler_backend(default="inprocess"), None
    if raw:
        return "cli", limits_from_env()
    chosen = compiler_backend(default="cli")
    return chosen, default_limits() if chosen == "cli" else None


@dataclass(frozen=True)
class CompileResult:
    vmfb: bytes
    statistics: dict[str, Any]
    seconds: float
    backend: str  # "inprocess" | "cli"
    diagnostics: str = ""
    summary: dict[str, Any] = field(default_factory=dict)
    peak_rss_bytes: int | None = None  # the child's, as last read (None in-process)


def statistics_flags(path: str | Path) -> tuple[str, ...]:
    """Flags that make IREE write its scheduling statistics (dispatch count...) as JSON."""
    return ("--iree-scheduling-dump-statistics-format=json", f"--iree-scheduling-dump-statistics-file={path}")


def summarize_statistics(stats: dict[str, Any]) -> dict[str, int]:
    """Dispatch/executable counts summed over IREE's statistics (one block per function
    or an aggregate, depending on the module)."""
    out = {"dispatch_count": 0, "executable_count": 0, "submission_count": 0}
    agg = stats.get("stream-aggregate")
    blocks = [agg] if isinstance(agg, dict) else [v for v in stats.values() if isinstance(v, dict)]
    for b in blocks:
        ex = b.get("execution", {})
        out["dispatch_count"] += int(ex.get("dispatch-count", 0))
        out["submission_count"] += int(ex.get("submission-count", 0))
        out["executable_count"] += int(b.get("executable", {}).get("executable-count", 0))
    return out


_DISPATCH_NAME = re.compile(rb"_dispatch_(\d+)_([A-Za-z0-9_]+)")
_EXECUTABLE_FORMATS = re.compile(r"^(embedded_elf|system_elf|system_dylib|vmvx|cuda|rocm|hip|vulkan|spirv)")


def dispatch_names(vmfb: bytes) -> list[str]:
    """The dispatches of a compiled module by IREE's names (``dispatch_2_conv_56x56x64...``),
    read from the flatbuffer's strings. IREE names a dispatch after its root op, so a
    conv+bias+ReLU fused into one kernel shows as one ``conv`` dispatch and no
    ``elementwise`` one."""
    found: dict[int, str] = {}
    for m in _DISPATCH_NAME.finditer(vmfb):
        idx, name = int(m.group(1)), m.group(2).decode()
        if idx not in found and not _EXECUTABLE_FORMATS.match(name):
            found[idx] = f"dispatch_{idx}_{name}"
    return [found[i] for i in sorted(found)]


@cache
def iree_compile_path() -> Path:
    """The ``iree-compile`` binary shipped inside the installed iree.compiler package."""
    spec = importlib.util.find_spec("iree.compiler")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc) / "_mlir_libs" / "iree-compile"
            if p.exists():
                return p
    from iree.compiler.tools import binaries

    return Path(binaries.find_tool("iree-compile"))


def command_line(flags: Sequence[str], source: str, output: str) -> list[str]:
    """The exact iree-compile invocation for ``flags`` (argv form)."""
    return [str(iree_compile_path()), *flags, source, "-o", output]


def shell_command(flags: Sequence[str], source: str = "module.mlir", output: str = "module.vmfb") -> str:
    return shlex.join(command_line(flags, source, output))


def compiler_backend(default: str = "cli") -> str:
    """FUSEGRAPH_IREE_COMPILER ("cli" or "inprocess"), else ``default``."""
    value = os.environ.get(COMPILER_ENV, "").strip().lower() or default
    if value not in ("inprocess", "cli"):
        log.warning("%s=%r is not 'inprocess' or 'cli'; using %s", COMPILER_ENV, value, default)
        return default
    return value


def compile_mlir(
    text: str, flags: Sequence[str], *, backend: str | None = None, limits: CompileLimits | None = None
) -> CompileResult:
    """Compiles torch-dialect MLIR text to a VM flatbuffer; raises IreeCompileFailure
    (IreeCompileLimitExceeded past a ceiling; which ceilings: :func:`plan_compile`)."""
    backend, limits = plan_compile(backend, limits)
    with tempfile.TemporaryDirectory(prefix="fusegraph-iree-") as tmp:
        stats_path = Path(tmp) / STATS_FILE
        all_flags = [*flags, *statistics_flags(stats_path)]
        t0 = time.perf_counter()
        with progress.working("fusegraph: IREE compiling"):
            if backend == "cli":
                vmfb, diag, peak = _compile_cli(text, all_flags, Path(tmp), limits)
            else:
                vmfb, diag = _compile_inprocess(text, all_flags)
                peak = None
        seconds = time.perf_counter() - t0
        stats = _read_stats(stats_path)
    log.debug("compiled %d bytes of MLIR in %.3f s (%s)", len(text), seconds, backend)
    summary: dict[str, Any] = {**summarize_statistics(stats), "dispatches": dispatch_names(vmfb)}
    return CompileResult(vmfb, stats, seconds, backend, diag, summary, peak)


def _read_stats(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("IREE wrote no readable statistics (%s)", exc)
        return {}
    return data if isinstance(data, dict) else {"stats": data}


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _compile_cli(
    text: str, flags: Sequence[str], tmp: Path, limits: CompileLimits | None = None
) -> tuple[bytes, str, int]:
    src, out = tmp / "module.mlir", tmp / "module.vmfb"
    src.write_text(text)
    mem = limits.memory_bytes if limits is not None else None
    seconds = limits.seconds if limits is not None else None
    run = run_bounded(command_line(flags, str(src), str(out)), memory_bytes=mem, seconds=seconds)
    stderr, peak, rc = run.stderr.strip(), run.peak_rss_bytes, run.returncode
    ceilings = limits.describe() if limits is not None else ""
    if run.stopped == "time":
        raise IreeCompileLimitExceeded(
            f"the compile passed its time ceiling ({ceilings}) and was stopped (at {peak / 2**20:.0f} MiB resident)",
            f"iree-compile killed after {seconds:g} s\n{stderr[-4000:]}",
        )
    if run.stopped == "memory":
        raise IreeCompileLimitExceeded(
            f"the compile passed its memory ceiling ({ceilings}): iree-compile reached {peak / 2**20:.0f} MiB "
            "resident and was stopped",
            stderr[-4000:],
        )
    if rc != 0 and mem is not None and _OOM.search(stderr):
        raise IreeCompileLimitExceeded(
            f"the compile passed its memory ceiling ({ceilings}): iree-compile ran out of address space "
            f"(exit status {rc})",
            stderr[-4000:],
        )
    if rc < 0:
        raise IreeCompileFailure(f"iree-compile crashed ({_signal_name(rc)}); the calling process is unharmed", stderr)
    if rc != 0 or not out.exists():
        raise IreeCompileFailure(f"iree-compile exited with status {rc}", stderr)
    return out.read_bytes(), stderr, peak


def _compile_inprocess(text: str, flags: Sequence[str]) -> tuple[bytes, str]:
    from iree.compiler.api import Output, Session, Source
    from iree.compiler.api import ctypes_dl as dl

    messages: list[str] = []

    def on_diag(severity: int, message: int | None, size: int, _user: int | None) -> None:
        body = ctypes.string_at(message, size).decode("utf-8", "replace") if message else ""
        messages.append(f"{_SEVERITY.get(severity, 'diag')}: {body}")

    callback = _DIAG_CALLBACK(on_diag)  # kept alive until the invocation is closed
    with _LOCK:
        session = Session()
        try:
            try:
                session.set_flags(*flags)
            except ValueError as exc:
                raise IreeCompileFailure("IREE rejected the compile flags", str(exc)) from None
            inv = session.invocation()
            try:
                fn = dl._dylib.ireeCompilerInvocationEnableCallbackDiagnostics
                fn.restype, fn.argtypes = None, [ctypes.c_void_p, ctypes.c_int, _DIAG_CALLBACK, ctypes.c_void_p]
                fn(inv._inv_p, 0, callback, None)
                source = Source.wrap_buffer(session, text.encode(), buffer_name="module.mlir")
                if not inv.parse_source(source):
                    raise IreeCompileFailure("IREE could not parse the module", "\n".join(messages))
                if not inv.execute():
                    raise IreeCompileFailure("IREE failed to compile the module", "\n".join(messages))
                output = Output.open_membuffer()
                try:
                    inv.output_vm_bytecode(output)
                    vmfb = bytes(output.map_memory())
                finally:
                    output.close()
            finally:
                inv.close()
        finally:
            session.close()
    return vmfb, "\n".join(m for m in messages if not m.startswith("remark"))


def write_reproducer(
    directory: Path,
    text: str,
    flags: Sequence[str],
    diagnostic: str,
    *,
    note: str = "",
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Keeps MLIR + flags + a ``repro.sh`` that re-runs the exact failing iree-compile."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "module.mlir").write_text(text)
    (directory / "flags.txt").write_text("\n".join(flags) + "\n")
    (directory / "diagnostic.txt").write_text(diagnostic + "\n")
    for name, content in (extra_files or {}).items():
        (directory / name).write_text(content)
    script = directory / "repro.sh"
    script.write_text(
        "#!/bin/sh\n"
        f"# {note}\n" * bool(note)
        + "# Re-runs the iree-compile command that failed; expect the diagnostic in diagnostic.txt.\n"
        'cd "$(dirname "$0")" || exit 1\n'
        f"exec {shell_command(flags)}\n"
    )
    script.chmod(0o755)
    return directory
