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

While the caller's session runs an inference the child is held (``Gate``: SIGSTOP of its
process group, SIGCONT once the session has been idle for longer than usual), so it works
only in the caller's longer pauses and a first session runs as fast as ONNX Runtime alone
(nice 10 alone left it 1.2-2.3x slower on 2 cores: docs/models.md, "The first session").
A model with dynamic dimensions is evaluated per set of input shapes (``at_shapes``,
``direct.ShapedOrt``), each new set running on ONNX Runtime meanwhile. Holding
it from outside, not asking it to yield, is what reaches its compiles (torch, IREE and
their worker processes), which make up most of its time; the child's timing loops drop
any call it was held in (``floor.PAUSES``, read from a counter the parent bumps before
each stop). A child still at work when the caller's process exits is let go (continued,
it finishes the verdict for the next session) and a warning names its log.

The verdict only steers speed: a session that runs the whole model on ONNX Runtime is
correct whatever the verdict says, so a stale key (a file rewritten within the same
nanosecond at the same size) costs at most a slower choice, never a wrong number.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import hashlib
import json
import logging
import os
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
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
RESUME_S = 0.1  # the child goes on once the caller's session has been idle at least this long,
IDLE_FACTOR = 4.0  # and this many times its usual pause between runs (a steady caller never lets it)
GAPS = 16  # pauses between runs remembered for "usual"
MAX_IDLE_S = 10.0  # but never longer than this: a slow-paced caller still lets the child finish
PAUSE_CHILD = True  # hold the child while the caller's session runs (benchmarks turn it off to compare)
COUNTER = struct.Struct("<Q")  # the gate file: how many times the parent has held the child


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


class Gate:
    """Holds the child's process group stopped while the caller's session runs inferences.

    ``enter`` (a run starts) stops the group at once -- after bumping the counter in the
    gate file, so the child can tell a timed call it was held in (``floor.PAUSES``) -- and
    ``leave`` (the run ended) lets a thread continue it once the session has been idle
    for ``resume_s`` and IDLE_FACTOR times the median of its last GAPS pauses between runs
    (at most MAX_IDLE_S: a caller pausing longer, or a child holding a cache table's lock
    when it was stopped, is not kept waiting for ever).
    Stopped is not enough: a run right after the child worked in the pause before it is
    slower (its caches and TLBs cold: squeezenet 1.2-1.7x ONNX Runtime alone with the child
    let go after 20 ms of every 200 ms pause, 1.05x kept stopped; docs/models.md), so a
    caller running at a steady pace never lets the child go, and one that pauses for longer
    than usual does (the child then finishes its work, or it goes on when the process
    exits). Overlapping runs from several threads count as one busy stretch. Where SIGSTOP
    does not exist (Windows) it does nothing: the child is only nice'd there. ``close``
    continues the group for good (the child finished, or the caller's process exits)."""

    def __init__(self, pgid: int, counter: Path | None, resume_s: float | None = None) -> None:
        self.pgid = pgid
        self.resume_s = RESUME_S if resume_s is None else resume_s
        self.enabled = PAUSE_CHILD and hasattr(signal, "SIGSTOP") and hasattr(os, "killpg")
        self.pauses = 0  # how many times it stopped the child (the gate file's value)
        self.stopped = False
        self._fd: int | None = None
        if self.enabled and counter is not None:
            with contextlib.suppress(OSError):
                self._fd = os.open(counter, os.O_WRONLY)
        self._cond = threading.Condition(threading.Lock())  # a plain lock: run() takes it twice per call
        self._active = 0
        self._last_end = 0.0
        self._gaps: collections.deque[float] = collections.deque(maxlen=GAPS)
        self._closed = False
        self._thread: threading.Thread | None = None

    def enter(self) -> None:
        with self._cond:
            if self._active == 0 and self._last_end:
                self._gaps.append(time.monotonic() - self._last_end)
            self._active += 1
            if self.enabled and not self.stopped and not self._closed:
                self.pauses += 1
                if self._fd is not None:
                    with contextlib.suppress(OSError):
                        os.pwrite(self._fd, COUNTER.pack(self.pauses), 0)
                try:
                    os.killpg(self.pgid, signal.SIGSTOP)
                except OSError:  # the child is gone: nothing to hold any more
                    self.enabled = False
                    return
                self.stopped = True
                if self._thread is None:
                    self._thread = threading.Thread(target=self._resumer, name="fusegraph-gate", daemon=True)
                    self._thread.start()
                self._cond.notify()

    def leave(self) -> None:
        """Wakes nobody (a woken thread on a busy machine costs the caller's next run more
        than the check it makes): the resumer sleeps in timed waits while the child is held."""
        with self._cond:
            self._active -= 1
            self._last_end = time.monotonic()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """The child held for the block (a run of the caller's session, or a benchmark's
        baseline that must not share the CPU with it)."""
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            if self.stopped:
                self._continue()
            self._cond.notify()
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def idle_needed(self) -> float:
        """Seconds without a run before the child goes on."""
        usual = statistics.median(self._gaps) if self._gaps else 0.0
        return max(self.resume_s, min(IDLE_FACTOR * usual, MAX_IDLE_S))

    def _continue(self) -> None:
        with contextlib.suppress(OSError):
            os.killpg(self.pgid, signal.SIGCONT)
        self.stopped = False

    def _resumer(self) -> None:
        with self._cond:
            while not self._closed:
                if not self.stopped:
                    self._cond.wait()  # until enter holds the child again
                    continue
                wait = self.resume_s if self._active else self._last_end + self.idle_needed() - time.monotonic()
                if wait <= 0:
                    self._continue()
                    continue
                self._cond.wait(wait)


class Evaluation:
    """The child evaluating one model; ``done`` never blocks."""

    def __init__(self, proc: subprocess.Popen[bytes] | None, pid: int, log_path: Path, lock: Path,
                 cache: floor.VerdictCache, source: Source, gate: Gate | None = None) -> None:
        self.proc = proc  # None: another process's child evaluates the model
        self.pid = pid
        self.log_path = log_path
        self.lock = lock
        self.gate = gate  # None: not ours to hold (another process's child)
        self._cache = cache
        self._source = source
        self.started = time.monotonic()

    def done(self) -> bool:
        if self.proc is not None:
            finished = self.proc.poll() is not None
            if finished and self.gate is not None:
                self.gate.close()
            return finished
        return not self.lock.exists()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the child has finished (within ``timeout`` seconds, None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return False
            return self.done()
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


# The children this process started, for the warning at exit (an explicit registry).
_RUNNING: set[Evaluation] = set()
_RUNNING_LOCK = threading.Lock()


def _register(evaluation: Evaluation) -> None:
    with _RUNNING_LOCK:
        for done in [e for e in _RUNNING if e.proc is not None and e.proc.poll() is not None]:
            _RUNNING.discard(done)
        _RUNNING.add(evaluation)


@atexit.register
def at_exit() -> None:
    """Lets every child of this process that is still at work go on (continued where it was
    held: it records the verdict for the next session) and says where its log is."""
    with _RUNNING_LOCK:
        running = [e for e in _RUNNING if e.proc is not None and e.proc.poll() is None]
        _RUNNING.clear()
    for e in running:
        if e.gate is not None:
            e.gate.close()
        log.warning("fusegraph's background evaluation of %s is still running (pid %d); it records its "
                    "verdict for the next session when it finishes. Its log: %s", e._source.content, e.pid, e.log_path)


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


def at_shapes(source: Source, shapes: Mapping[str, Sequence[int]]) -> Source:
    """``source`` at one set of input shapes (a model with dynamic dimensions is evaluated,
    and its verdict kept, per set of shapes it is run at)."""
    text = ",".join(f"{k}={'x'.join(str(int(d)) for d in v)}" for k, v in sorted(shapes.items()))
    return Source(f"{source.content}|shapes {text}", source.path, source.data)


def launch(source: Source, opts: ProviderOptions, cache: floor.VerdictCache,
           shapes: Mapping[str, Sequence[int]] | None = None) -> Evaluation | None:
    """Starts the child for ``source`` (at ``shapes``, for a model with dynamic dimensions:
    ``source`` is then ``at_shapes``'s) unless one is already at it (then follows that one).
    None when the cache directory cannot hold the lock (nothing can be recorded either) or a
    previous child died without a verdict (recorded as ONNX Runtime's, so no session retries
    a model that takes its evaluator down)."""
    if not cache.enabled:
        return None
    root = Path(opts.cache_dir) if opts.cache_dir else cache_root()
    work = root / DIR
    digest = _digest(source.content, cache.settings)
    lock, log_path, counter = work / f"{digest}.lock", work / f"{digest}.log", work / f"{digest}.gate"
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
    if shapes is not None:
        cmd += ["--shapes", json.dumps({k: [int(d) for d in v] for k, v in shapes.items()})]
    if source.path is None:
        cmd += ["--remove-model"]
    try:
        counter.write_bytes(COUNTER.pack(0))
        cmd += ["--gate", str(counter)]
    except OSError as exc:
        log.debug("no gate file (%s): the child's timings cannot drop held calls", exc)
    try:
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    except OSError as exc:
        os.close(fd)
        lock.unlink(missing_ok=True)
        log.info("background evaluation not started (%s)", exc)
        return None
    os.write(fd, f"{proc.pid}\n{os.getpid()}".encode())
    os.close(fd)
    log.info("fusegraph evaluates %s in the background (pid %d, log %s)", source.content, proc.pid, log_path)
    evaluation = Evaluation(proc, proc.pid, log_path, lock, cache, source, Gate(proc.pid, counter))
    _register(evaluation)
    return evaluation


def _follow(lock: Path, log_path: Path, cache: floor.VerdictCache, source: Source) -> Evaluation | None:
    try:
        text = lock.read_text().split()
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return None
    pid = int(text[0]) if text and text[0].isdigit() else 0
    parent = int(text[1]) if len(text) > 1 and text[1].isdigit() else 0
    if pid and _alive(pid):
        if parent and not _alive(parent) and _held(pid):
            # Its process was killed while it held the child (no exit handler ran): let it go.
            log.info("background evaluation pid %d was left held by pid %d, which is gone: continued", pid, parent)
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGCONT)
        return Evaluation(None, pid, log_path, lock, cache, source)
    if not pid and age < FRESH_LOCK_S:
        return Evaluation(None, pid, log_path, lock, cache, source)
    # The child died without a verdict (a crash in a native library, a kill): record ONNX
    # Runtime's so that no later session starts another.
    if cache.lookup(source.content) is None:
        cache.record(source.content, floor.Verdict(
            False, source="measured", why=f"the background evaluation (pid {pid}) ended without a verdict: see {log_path}"))
        cache.flush()
    lock.unlink(missing_ok=True)
    return None


def _held(pid: int) -> bool:
    """Whether process ``pid`` is stopped (Linux: its state in /proc; False elsewhere)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].startswith(("T", "t"))
