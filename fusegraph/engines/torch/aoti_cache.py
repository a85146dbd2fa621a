"""AOTInductor packages of compiled plans kept in fusegraph's cache directory, so that a
later process loads a plan's compiled code instead of compiling it again.

Why: a ``compile=True`` plan is compiled by ``torch._inductor.compile`` (compiled.py), and
every new process pays for it again even with Inductor's own caches warm: importing Dynamo
and Inductor (~5 s), re-tracing, Inductor's code generation and Triton's (an ONNX session
of Swin-T on an H200 with 7 compiled regions opened warm in 33.6 s + 10 s first run). An
AOTInductor package is the same compiled code with a C++ wrapper, kept as one file: torch's
C++ loader (``AOTIModelPackageLoader``) opens it in tens of milliseconds without importing
Dynamo, Inductor or Triton.

What is kept, under ``<cache>/torch-aoti/`` (the store the size limit and ``fusegraph cache
clear --only torch-aoti`` already cover):

- ``<key>.pt2``: the package, keyed by what the compiled code depends on (``region_key``).
- ``regions.json``: per key, the package's SHA-256 and size (a damaged or foreign file is
  compiled again, never loaded), or why the package cannot be made (``refused``): torch.export
  or AOTInductor failed, or its outputs disagreed with the traced graph's -- a later process
  goes straight to ``torch._inductor.compile`` instead of trying the export again.

frozen.py's CPU packages (weights frozen in) share the directory and the loader.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import logging
import os
import platform
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fusegraph.engines.torch.convert import Tensor, _torch
from fusegraph.runtime import cache_limit
from fusegraph.runtime.cache_dir import (
    cache_enabled,
    cache_root,
    ensure_dir,
    file_lock,
    read_table,
    update_table,
)

log = logging.getLogger("fusegraph.engines.torch")

PACKAGES = "torch-aoti"  # under the cache directory (a part of `fusegraph cache`)
INDEX = "regions.json"  # in PACKAGES: digests of compiled plans' packages, and refusals
RECIPE = 1  # how a compiled plan is written as a package; part of the key (bump on change)
# Relative L2 a package's outputs may differ from the traced graph's run eagerly on its
# first build (Inductor reorders float reductions; narrow types round in other places).
# Whether packages are made and loaded for CUDA plans. Off: on an H200 (torch 2.11) the C++
# loader crashed the process (SIGSEGV inside AOTIModelPackageLoader's constructor) on a
# freshly compiled CUDA package of a layer norm + transpose + pointwise region; a crash
# cannot be caught, so CUDA plans compile in process until that is understood.
CUDA_PACKAGES = False
AGREE = {"float64": 1e-9, "float32": 1e-4, "float16": 2e-2, "bfloat16": 3e-2}


# ---- what the compiled code depends on ---------------------------------------------------------
@functools.cache
def cpu_identity() -> str:
    """The CPU model and its instruction-set flags (Inductor compiles for the host)."""
    text = ""
    with contextlib.suppress(OSError):
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    model = flags = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = hashlib.sha256(value.strip().encode()).hexdigest()[:12]
    return f"{platform.machine()} {model or platform.processor()} {flags}"


def device_identity(device: Any) -> str:
    """What code compiled for ``device`` (a torch.device) runs on: the CPU's model and flags,
    or the GPU's name and compute capability with the CUDA and Triton versions it was
    built with (a cubin is compiled for one architecture)."""
    if device.type == "cpu":
        return f"cpu {cpu_identity()}"
    return _gpu_identity(device.type, device.index if device.index is not None else _torch().cuda.current_device())


@functools.cache
def _gpu_identity(kind: str, index: int) -> str:
    torch = _torch()
    major, minor = torch.cuda.get_device_capability(index)
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "none"
    return (f"{kind} {torch.cuda.get_device_name(index)} sm{major}{minor} "
            f"cuda {torch.version.cuda} hip {torch.version.hip} triton {triton}")


def region_key(
    graph_key: str,
    in_names: Sequence[str],
    out_names: Sequence[str],
    example: Sequence[Tensor],
    options: Mapping[str, Any] | None,
    variant: tuple[Any, ...],
) -> str:
    """The key of a compiled plan's package: the graph's content, its inputs' and outputs'
    names, the layouts and dtypes it is specialized to, Inductor's options, what the
    lowering traces differently (``variant``), the device, and torch's and fusegraph's
    versions (the lowering that writes the traced function is fusegraph's)."""
    from fusegraph import __version__

    torch = _torch()
    h = hashlib.sha256()
    h.update(f"region recipe {RECIPE}|torch {torch.__version__}|fusegraph {__version__}|".encode())
    h.update(f"{device_identity(example[0].device) if example else 'none'}|{graph_key}|".encode())
    h.update(f"in {list(in_names)}|out {list(out_names)}|".encode())
    for x in example:
        h.update(f"{tuple(x.shape)} {tuple(x.stride())} {x.dtype} {x.device.type}|".encode())
    h.update(f"options {sorted((options or {}).items())!r}|variant {variant!r}".encode())
    return "r" + h.hexdigest()[:32]


# ---- loading ------------------------------------------------------------------------------------
def load_package(path: Path, device: Any = None) -> Callable[..., list[Tensor]]:
    """An AOTInductor package through torch's C++ loader: tens of milliseconds, where
    ``torch._inductor.aoti_load_package`` first imports Inductor and Dynamo (5-12 s on the
    shared 2-core machine). Inputs and outputs are flat tensors, so the Python wrapper's
    pytree handling is not needed.

    On a GPU the package runs on the caller's current CUDA stream (the loader's run() is
    given no stream, and AOTInductor's CUDA runner then takes the current one), so a plan
    captured in a CUDA graph on a side stream captures its kernels. It is loaded
    single-threaded there: the thread-safe runner waits on the previous call's CUDA event
    (``cudaEventQuery`` / ``cudaEventSynchronize``), which a stream capture forbids; a lock
    keeps the calls of the threads that share the package apart instead."""
    torch = _torch()
    gpu = device is not None and device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if gpu else -1
    if gpu:  # the loader's C++ side expects torch's CUDA state (a process's first CUDA touch here crashed it)
        torch.cuda.init()
        with torch.cuda.device(index):
            loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", gpu, 1, index)
    else:
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", gpu, 1, index)
    run = loader.run
    if gpu:
        lock = threading.Lock()

        def call_locked(*xs: Tensor) -> list[Tensor]:
            with lock:
                return run(list(xs))  # type: ignore[no-any-return]

        call_locked.loader = loader  # type: ignore[attr-defined]  # keeps the loaded library alive
        return call_locked

    def call(*xs: Tensor) -> list[Tensor]:
        return run(list(xs))  # type: ignore[no-any-return]

    call.loader = loader  # type: ignore[attr-defined]
    return call


def _index_path() -> Path:
    return cache_root() / PACKAGES / INDEX


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def refusal(key: str) -> str:
    """Why the package for ``key`` cannot be made, as a process found before; '' if none did."""
    if not cache_enabled():
        return ""
    entry = read_table(_index_path()).get(key)
    return str(entry.get("refused", "")) if isinstance(entry, dict) else ""


def cached(key: str, device: Any) -> Callable[..., list[Tensor]] | None:
    """The package kept for ``key``, loaded on ``device``; None when there is none, or when
    the file is not the one stored (damaged, truncated, replaced: logged, then compiled again)."""
    if not cache_enabled():
        return None
    path = cache_root() / PACKAGES / f"{key}.pt2"
    entry = read_table(_index_path()).get(key)
    if not isinstance(entry, dict) or "sha256" not in entry or not path.is_file():
        return None
    try:
        size = path.stat().st_size
        damaged = size != entry.get("bytes") or _digest(path) != entry["sha256"]
    except OSError as exc:
        log.warning("AOTInductor package %s unreadable (%s); compiling the plan again", path, exc)
        return None
    if damaged:
        log.warning("AOTInductor package %s is not the file stored (size or SHA-256 differs); compiling the plan again",
                    path)
        return None
    try:
        fn = load_package(path, device)
    except Exception as exc:  # a package this torch cannot load: compiled again
        log.warning("AOTInductor package %s could not be loaded (%s); compiling the plan again", path, exc)
        return None
    cache_limit.touch(path)
    return fn


# ---- building ----------------------------------------------------------------------------------
def packs(device: Any) -> bool:
    """Whether plans on ``device`` (a torch device, None: the CPU) are packaged (CUDA_PACKAGES)."""
    return device is None or device.type != "cuda" or CUDA_PACKAGES


def staging_dir() -> str | None:
    """Where a package is written before ``store`` moves it into place (the store's own
    directory, so the move is a rename); None where it cannot be kept (``can_keep``)."""
    return str(cache_root() / PACKAGES) if can_keep() else None


def can_keep() -> bool:
    """Whether a package can be kept: the cache on and its directory writable (else one
    CacheUnavailableWarning; a package nobody can load later is not worth its compile)."""
    return cache_enabled() and ensure_dir(cache_root() / PACKAGES, cache_root())


def remember_refusal(key: str, why: str) -> None:
    """Keeps why ``key``'s package cannot be made, so a later process does not try again."""
    if not cache_enabled() or not ensure_dir(cache_root() / PACKAGES):
        return

    def change(table: dict[str, Any]) -> None:
        table[key] = {"refused": why[:500], "at": time.strftime("%Y-%m-%dT%H:%M:%S")}

    try:
        update_table(_index_path(), change)
    except OSError as exc:
        log.info("could not record the AOTInductor refusal for %s: %s", key, exc)


def build(
    gm: Any, example: Sequence[Tensor], options: Mapping[str, Any] | None, key: str
) -> Callable[..., list[Tensor]]:
    """``gm`` (a make_fx graph of positional tensors -> a list) exported, compiled by
    AOTInductor with Inductor's ``options``, checked against ``gm`` run eagerly on random
    inputs, kept under ``key`` and loaded. Raises when any step fails or the outputs
    disagree (the caller records the refusal and compiles in process instead)."""
    torch = _torch()
    device = example[0].device if example else torch.device("cpu")
    keep = staging_dir()
    with torch.inference_mode(False), torch.no_grad():
        plain = [_plain(x) for x in example]

        class Positional(torch.nn.Module):  # type: ignore[misc,name-defined]
            def __init__(self) -> None:
                super().__init__()
                self.gm = gm

            def forward(self, *xs: Tensor) -> list[Tensor]:
                return list(self.gm(*xs))

        with tempfile.TemporaryDirectory(prefix="fusegraph-aoti-", dir=keep) as tmp:
            target = Path(tmp) / "model.pt2"
            program = torch.export.export(Positional(), tuple(plain))
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(target), inductor_configs=dict(options or {})
            )
            fn = load_package(target, device)
            check = [_random_like(x) for x in plain]
            why = agrees(fn(*check), list(gm(*check)))
            if why:
                raise ValueError(f"the package's outputs disagree with the traced graph's: {why}")
            if keep:
                store(target, key)
    return fn


def store(target: Path, key: str) -> None:
    """Moves the package into place and records its digest, both under one lock (a reader
    sees the digest of the file it reads, or a mismatch it treats as a miss, ``cached``)."""
    root = cache_root() / PACKAGES
    final = root / f"{key}.pt2"
    try:
        digest, size = _digest(target), target.stat().st_size
        with file_lock(root / ".regions.lock"):
            os.replace(target, final)

            def change(table: dict[str, Any]) -> None:
                table[key] = {"sha256": digest, "bytes": size}

            update_table(root / INDEX, change)
    except OSError as exc:
        log.info("could not keep the AOTInductor package in %s: %s", root, exc)
        return
    cache_limit.enforce(keep=[final])


def _plain(x: Tensor) -> Tensor:
    """A normal tensor with ``x``'s values and strides (export refuses inference tensors)."""
    torch = _torch()
    return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device=x.device).copy_(x)


def _random_like(x: Tensor) -> Tensor:
    """Float inputs uniform in [0.5, 1.5) (no log or sqrt of a negative, no division by
    zero), laid out as ``x``; other inputs as given (index inputs must stay in range)."""
    torch = _torch()
    if not x.dtype.is_floating_point:
        return x
    out = torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device=x.device)
    return out.copy_(torch.rand(tuple(x.shape), dtype=torch.float32, device=x.device) + 0.5)


def agrees(got: Sequence[Tensor], want: Sequence[Tensor]) -> str:
    """'' when every output matches ``want``'s (shape, dtype, NaN / inf places, relative L2
    to AGREE of its dtype), else why not."""
    if len(got) != len(want):
        return f"{len(got)} outputs, the traced graph has {len(want)}"
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        if tuple(g.shape) != tuple(w.shape) or g.dtype != w.dtype:
            return f"output {k}: {tuple(g.shape)} {g.dtype} vs {tuple(w.shape)} {w.dtype}"
        g64, w64 = g.detach().double().cpu().numpy(), w.detach().double().cpu().numpy()
        if not np.array_equal(np.isnan(g64), np.isnan(w64)) or not np.array_equal(np.isinf(g64), np.isinf(w64)):
            return f"output {k}: NaN / inf in other places"
        g64, w64 = np.nan_to_num(g64, posinf=0.0, neginf=0.0), np.nan_to_num(w64, posinf=0.0, neginf=0.0)
        err = float(np.linalg.norm(g64 - w64)) / max(float(np.linalg.norm(w64)), 1e-30)
        tol = AGREE.get(str(w.dtype).removeprefix("torch."), 0.0)  # integers and booleans: exact
        if err > tol:
            return f"output {k}: relative error {err:.1e}"
    return ""


__all__ = [
    "AGREE",
    "INDEX",
    "PACKAGES",
    "RECIPE",
    "agrees",
    "build",
    "cached",
    "can_keep",
    "cpu_identity",
    "device_identity",
    "load_package",
    "refusal",
    "region_key",
    "remember_refusal",
]
