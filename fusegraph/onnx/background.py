"""Background evaluation: a model fusegraph has not measured opens on ONNX Runtime at once,
while a child process builds fusegraph's plan and runs the floor.

The floor (``floor.py``) needs fusegraph's units built -- torch and IREE loaded, modules
compiled -- before it can time them against ONNX Runtime: seconds to minutes on 2 cores,
against ONNX Runtime's 10-900 ms session creation (issue 14: cold setup 87x ONNX
Runtime's, warm 2.5x). So, as tiered JITs do, a session of a model with no verdict runs
the whole model on ONNX Runtime -- the incumbent, correct and as fast as the caller would
otherwise have it -- and starts a child (``python -m fusegraph.onnx.evaluate``, nice 10,
its own process group, a time ceiling) that opens the model with the floor inline and
records every verdict in the cache. When the child finishes, the session reads the
verdict: where fusegraph's plan won, the plan is built from the caches (in a thread) and
later ``run`` calls use it; where ONNX Runtime won, nothing changes. A later session of the
same model decides from the verdict alone: it opens ONNX Runtime directly (no parsing,
partitioning or building: the model is identified by its file's path, size and
modification time, or by a hash of the bytes given), or builds fusegraph's plan from the
caches.

The verdict only steers speed: a session that runs the whole model on ONNX Runtime is
correct whatever the verdict says, so a stale key (a file rewritten within the same
nanosecond at the same size) costs at most a slower choice, never a wrong number.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from fusegraph.onnx import floor
from fusegraph.onnx.options import ProviderOptions
from fusegraph.runtime.cache_dir import cache_root

log = logging.getLogger("fusegraph.onnx")

DIR = "onnx-background"  # under the cache directory: locks, logs, models given as bytes
POLL_S = 0.5  # run() looks at the child at most this often
FRESH_LOCK_S = 30.0  # a lock without a pid yet is a launch in progress this long


@dataclass(frozen=True)
class Source:
    """How a session names a model without parsing it: ``content`` keys its verdict."""

    content: str
    path: str | None  # the file, where the model came as a path
    data: bytes | None  # the serialized model, where it came as bytes or a ModelProto

    @property
    def ort_model(self) -> str | bytes:
        return self.path if self.path is not None else self.data  # type: ignore[return-value]


def source_of(model: Any) -> Source | None:
    """The model's identity, or None where it cannot be had cheaply (a ModelProto over 2 GB)."""
    try:
        if isinstance(model, str | os.PathLike):
            path = os.path.realpath(os.fspath(model))
            st = os.stat(path)
            return Source(f"model-file|{path}|{st.st_size}|{st.st_mtime_ns}", path, None)
        if isinstance(model, onnx.ModelProto):
            data = model.SerializeToString()
        elif isinstance(model, bytes | bytearray | memoryview):
            data = bytes(model)
        else:
            return None
    except (OSError, ValueError) as exc:
        log.debug("no cheap identity for the model: %s", exc)
        return None
    return Source("model-bytes|" + hashlib.blake2b(data, digest_size=20).hexdigest(), None, data)


class Evaluation:
    """The child evaluating one model; ``done`` never blocks."""

    def __init__(self, proc: subprocess.Popen[bytes] | None, pid: int, log_path: Path, lock: Path,
                 cache: floor.VerdictCache, source: Source) -> None:
        self.proc = proc  # None: another process's child evaluates the model
        self.pid = pid
        self.log_path = log_path
        self.lock = lock
        self._cache = cache
        self._source = source
        self.started = time.monotonic()

    def done(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is not None
        return not self.lock.exists()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the child has finished (within ``timeout`` seconds, None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return False
            return True
        while not self.done():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def verdict(self) -> floor.Verdict | None:
        """The recorded verdict (re-read from disk: the child wrote it)."""
        fresh = floor.VerdictCache(str(self._cache.path.parent), self._cache.settings)
        return fresh.lookup(self._source.content)

    def describe(self) -> str:
        state = "finished" if self.done() else f"running for {time.monotonic() - self.started:.0f} s"
        return f"fusegraph's evaluation {state} in the background (pid {self.pid}, log {self.log_path})"


def _digest(content: str, settings: str) -> str:
    return hashlib.sha256(f"{content}|{settings}".encode()).hexdigest()[:24]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def launch(source: Source, opts: ProviderOptions, cache: floor.VerdictCache) -> Evaluation | None:
    """Starts the child for ``source`` unless one is already at it (then follows that one).
    None when the cache directory cannot hold the lock (nothing can be recorded either) or a
    previous child died without a verdict (recorded as ONNX Runtime's, so no session retries
    a model that takes its evaluator down)."""
    if not cache.enabled:
        return None
    root = Path(opts.cache_dir) if opts.cache_dir else cache_root()
    work = root / DIR
    digest = _digest(source.content, cache.settings)
    lock, log_path = work / f"{digest}.lock", work / f"{digest}.log"
    try:
        work.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return _follow(lock, log_path, cache, source)
    except OSError as exc:
        log.info("background evaluation not started (%s): the floor is not measured", exc)
        return None
    model_path = source.path
    if model_path is None:  # bytes: the child reads them from a file of its own
        model_path = str(work / f"{digest}.onnx")
        Path(model_path).write_bytes(source.data or b"")
    child_opts = {k: v for k, v in opts.as_strings().items() if v != ""}
    child_opts["floor_mode"] = "inline"
    cmd = [sys.executable, "-m", "fusegraph.onnx.evaluate", "--model", model_path,
           "--options", json.dumps(child_opts), "--content", source.content, "--lock", str(lock)]
    if source.path is None:
        cmd += ["--remove-model"]
    try:
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    except OSError as exc:
        os.close(fd)
        lock.unlink(missing_ok=True)
        log.info("background evaluation not started (%s)", exc)
        return None
    os.write(fd, str(proc.pid).encode())
    os.close(fd)
    log.info("fusegraph evaluates %s in the background (pid %d, log %s)", source.content, proc.pid, log_path)
    return Evaluation(proc, proc.pid, log_path, lock, cache, source)


def _follow(lock: Path, log_path: Path, cache: floor.VerdictCache, source: Source) -> Evaluation | None:
    try:
        text = lock.read_text().strip()
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return None
    pid = int(text) if text.isdigit() else 0
    if (pid and _alive(pid)) or (not pid and age < FRESH_LOCK_S):
        return Evaluation(None, pid, log_path, lock, cache, source)
    # The child died without a verdict (a crash in a native library, a kill): record ONNX
    # Runtime's so that no later session starts another.
    if cache.lookup(source.content) is None:
        cache.record(source.content, floor.Verdict(
            False, source="measured", why=f"the background evaluation (pid {pid}) ended without a verdict: see {log_path}"))
        cache.flush()
    lock.unlink(missing_ok=True)
    return None
