"""Runs the IREE compiler: in-process through libIREECompiler (the embedding API's
session/invocation), or the ``iree-compile`` CLI when ``FUSEGRAPH_IREE_COMPILER=cli``.

In-process compiles skip process start-up and re-reading the compiler's 100+ MB library,
which is most of a small graph's compile time. The CLI stays one switch away because it
is what a reproducer uses and what an IREE developer will ask for. Either way the result
carries IREE's dispatch statistics, which are the evidence of what was fused.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import logging
import os
import re
import shlex
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from fusegraph.runtime import progress

log = logging.getLogger("fusegraph.iree")

COMPILER_ENV = "FUSEGRAPH_IREE_COMPILER"  # "inprocess" (default) | "cli"
# "MEM_MIB,SECONDS" (either may be empty): compile in a child process under these ceilings.
LIMITS_ENV = "FUSEGRAPH_IREE_COMPILE_LIMITS"
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
    """Ceilings for one compile, enforced on a child ``iree-compile`` (RLIMIT_AS, a timeout):
    an in-process compile cannot be stopped, so a bounded compile is always a child."""

    memory_bytes: int | None = None
    seconds: float | None = None

    def describe(self) -> str:
        parts = []
        if self.memory_bytes is not None:
            parts.append(f"memory {self.memory_bytes / 2**20:.0f} MiB")
        if self.seconds is not None:
            parts.append(f"time {self.seconds:g} s")
        return ", ".join(parts) or "none"


def limits_from_env() -> CompileLimits | None:
    raw = os.environ.get(LIMITS_ENV, "").strip()
    if not raw:
        return None
    mem, _, sec = raw.partition(",")
    try:
        return CompileLimits(
            memory_bytes=int(float(mem) * 2**20) if mem.strip() else None,
            seconds=float(sec) if sec.strip() else None,
        )
    except ValueError:
        log.warning("%s=%r is not 'MEM_MIB,SECONDS'; compiling without ceilings", LIMITS_ENV, raw)
        return None


@dataclass(frozen=True)
class CompileResult:
    vmfb: bytes
    statistics: dict[str, Any]
    seconds: float
    backend: str  # "inprocess" | "cli"
    diagnostics: str = ""
    summary: dict[str, Any] = field(default_factory=dict)


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


def compiler_backend() -> str:
    value = os.environ.get(COMPILER_ENV, "inprocess").strip().lower() or "inprocess"
    if value not in ("inprocess", "cli"):
        log.warning("%s=%r is not 'inprocess' or 'cli'; using in-process", COMPILER_ENV, value)
        return "inprocess"
    return value


def compile_mlir(
    text: str, flags: Sequence[str], *, backend: str | None = None, limits: CompileLimits | None = None
) -> CompileResult:
    """Compiles torch-dialect MLIR text to a VM flatbuffer; raises IreeCompileFailure
    (IreeCompileLimitExceeded past a ceiling: ``limits`` or FUSEGRAPH_IREE_COMPILE_LIMITS)."""
    limits = limits or limits_from_env()
    backend = "cli" if limits is not None else (backend or compiler_backend())
    with tempfile.TemporaryDirectory(prefix="fusegraph-iree-") as tmp:
        stats_path = Path(tmp) / STATS_FILE
        all_flags = [*flags, *statistics_flags(stats_path)]
        t0 = time.perf_counter()
        with progress.working("fusegraph: IREE compiling"):
            if backend == "cli":
                vmfb, diag = _compile_cli(text, all_flags, Path(tmp), limits)
            else:
                vmfb, diag = _compile_inprocess(text, all_flags)
        seconds = time.perf_counter() - t0
        stats = _read_stats(stats_path)
    log.debug("compiled %d bytes of MLIR in %.3f s (%s)", len(text), seconds, backend)
    summary: dict[str, Any] = {**summarize_statistics(stats), "dispatches": dispatch_names(vmfb)}
    return CompileResult(vmfb, stats, seconds, backend, diag, summary)


def _read_stats(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("IREE wrote no readable statistics (%s)", exc)
        return {}
    return data if isinstance(data, dict) else {"stats": data}


def _compile_cli(text: str, flags: Sequence[str], tmp: Path, limits: CompileLimits | None = None) -> tuple[bytes, str]:
    src, out = tmp / "module.mlir", tmp / "module.vmfb"
    src.write_text(text)
    mem = limits.memory_bytes if limits is not None else None

    def ceiling() -> None:  # runs in the child before exec
        import resource

        if mem is not None:
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))

    try:
        proc = subprocess.run(
            command_line(flags, str(src), str(out)), capture_output=True, text=True, check=False,
            timeout=limits.seconds if limits is not None else None,
            preexec_fn=ceiling if mem is not None else None,
        )
    except subprocess.TimeoutExpired:
        assert limits is not None
        raise IreeCompileLimitExceeded(
            f"the compile passed its time ceiling ({limits.describe()}) and was stopped",
            f"iree-compile killed after {limits.seconds:g} s",
        ) from None
    if mem is not None and proc.returncode != 0 and (
        proc.returncode < 0 or re.search(r"alloc|out of memory|Cannot allocate|mmap|map segment|LLVM ERROR", proc.stderr)
    ):
        assert limits is not None
        raise IreeCompileLimitExceeded(
            f"the compile passed its memory ceiling ({limits.describe()}); iree-compile exited with "
            f"status {proc.returncode}",
            proc.stderr.strip()[-4000:],
        )
    if proc.returncode != 0 or not out.exists():
        raise IreeCompileFailure(f"iree-compile exited with status {proc.returncode}", proc.stderr.strip())
    return out.read_bytes(), proc.stderr.strip()


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
