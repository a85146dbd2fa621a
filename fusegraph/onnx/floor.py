"""The floor: fusegraph keeps a claimed subgraph only where it is faster than ONNX Runtime.

Nothing else compares a claimed subgraph with what ONNX Runtime would have done with it,
and on graphs nobody tuned for fusegraph's plans are often slower (issue 14: 1.4-7.2x on
twelve real architectures). So at session creation each built claimed unit is timed
against an ONNX Runtime session of the same sub-model (the export the partitioner makes
for its ORT units), on the same random activations, in alternating blocks with
time-based warm-ups (as ``benchmarks/bench_onnx.py`` does, in one process here), within
a bounded budget; a unit that is not clearly faster is handed back to ONNX Runtime and
re-partitioned with its ORT neighbours, so no extra unit boundary appears. Then the
whole plan is timed against ONNX Runtime running the whole model, which counts what the
unit timings cannot see (boundary copies, one ORT call instead of several): when the
plan loses, the whole model runs on ONNX Runtime.

Verdicts are cached (``onnx-floor.json`` in the cache directory) by a content key of the
sub-model (op types, attributes, shapes, types, small constants; not weight values), the
machine's identity and the versions involved, so later sessions decide without timing.

Here: what the floor is without a plan (verdicts, the timing, the cache, the whole-model
runners); a session plan is held to it in ``plan_floor``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import onnx

from fusegraph import __version__
from fusegraph.onnx.model import OnnxGraph, ONode
from fusegraph.onnx.options import ProviderOptions
from fusegraph.runtime.cache_dir import cache_enabled, cache_root, read_table, update_table

log = logging.getLogger("fusegraph.onnx")

FILE = "onnx-floor.json"
KEEP_BELOW = 0.97  # fusegraph stays only when at least 3% faster: ties (and noise) go to ORT
ROUNDS = 3  # alternating rounds of the two timing blocks
CLEAR = 4.0  # one call of each side differing this much decides without timing blocks
MIN_RUNS = 2  # timed runs per block, whatever the budget
WARM_S = 0.05  # a block's warm-up lasts at least this long (or its share of the budget)
AGREE = 1e-3  # a unit whose trial output differs more from ONNX Runtime's (relative) is handed back
UNIT_S = 0.6  # the most one unit's comparison takes (its share of the budget may be less)
UNITS_SHARE = 0.8  # of the budget, for the units; the rest for the whole-model comparison
WHOLE_S = 3.0  # the most the whole-model comparison takes
SMALL_CONSTANT = 64  # constants up to this many elements enter the content key by value
RUNNER_WARM_S = 0.1  # each side's warm-up before a whole-model runner is timed
BUSY_LOAD = 0.5  # run-queue length per usable core from which the machine counts as busy
RUNNER_AGREE = 1e-4  # a whole-model runner further than this from ONNX Runtime (relative) is refused
# Whole-model runners besides fusegraph's plan and the caller's ONNX Runtime session (the
# incumbent, always a candidate): name -> label. Made by ``direct.make_runner``.
RUNNERS = {"openvino": "OpenVINO", "ort-nospin": "ONNX Runtime without spinning"}

Call = Callable[[], object]
# (fusegraph call, ORT call, budget in seconds) -> (fusegraph ms, ORT ms[, paired ratio])
Timer = Callable[[Call, Call, float], Sequence[float | None]]


@dataclass(frozen=True)
class Verdict:
    """The floor's decision for one unit (or the whole plan). A whole-model verdict may name
    a ``runner`` other than fusegraph's plan or the caller's ONNX Runtime session (one of
    ``RUNNERS``): then the whole model runs on it, ``fusegraph_ms`` is that runner's time and
    ``ort_ms`` the incumbent's; ``candidates`` says what every whole-model candidate did."""

    keep: bool  # True: fusegraph runs it; False: ONNX Runtime does (or ``runner``)
    fusegraph_ms: float | None = None
    ort_ms: float | None = None
    source: str = "measured"  # "measured", "cached", or "not measured"
    why: str = ""
    runner: str = ""  # whole model only: a RUNNERS name that won, "" where none did
    candidates: tuple[str, ...] = ()  # whole model only: one line per candidate runner
    against: str = ""  # whole model only: what ``runner`` was timed against (default ONNX Runtime)
    load: str = ""  # the machine's load class when it was measured (``machine_load``; "" where unknown)

    def describe(self) -> str:
        if self.runner:
            label = RUNNERS.get(self.runner, self.runner)
            times = ""
            if self.fusegraph_ms is not None and self.ort_ms is not None:
                times = (f"{label} {self.fusegraph_ms:.3f} ms vs {self.against or 'ONNX Runtime'} "
                         f"{self.ort_ms:.3f} ms ({self.source})")
            parts = [p for p in (times, self.why, self._under()) if p]
            return f"floor: on {label}" + (f" -- {'; '.join(parts)}" if parts else "")
        times = ""
        if self.fusegraph_ms is not None and self.ort_ms is not None:
            times = f"fusegraph {self.fusegraph_ms:.3f} ms vs ONNX Runtime {self.ort_ms:.3f} ms ({self.source})"
        who = "kept on fusegraph" if self.keep else "handed to ONNX Runtime"
        if not times and self.source == "not measured":
            times = "not measured"
        parts = [p for p in (times, self.why, self._under()) if p]
        return f"floor: {who}" + (f" -- {'; '.join(parts)}" if parts else "")

    def _under(self) -> str:
        return f"measured on a {self.load} machine" if self.load else ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"keep": self.keep, "fusegraph_ms": self.fusegraph_ms, "ort_ms": self.ort_ms, "why": self.why}
        if self.runner:
            out["runner"] = self.runner
        if self.candidates:
            out["candidates"] = list(self.candidates)
        if self.against:
            out["against"] = self.against
        if self.load:
            out["load"] = self.load
        return out

    @staticmethod
    def from_json(entry: Any) -> Verdict | None:
        if not isinstance(entry, dict) or not isinstance(entry.get("keep"), bool):
            return None
        try:
            fg = entry.get("fusegraph_ms")
            ort_ms = entry.get("ort_ms")
            runner = str(entry.get("runner", ""))
            if runner and runner not in RUNNERS:
                return None  # a runner this version does not know: measure again
            return Verdict(
                entry["keep"], None if fg is None else float(fg), None if ort_ms is None else float(ort_ms),
                "cached", str(entry.get("why", "")), runner, tuple(str(c) for c in entry.get("candidates", ())),
                str(entry.get("against", "")), str(entry.get("load", "")),
            )
        except (TypeError, ValueError):
            return None


def with_note(verdict: Verdict, note: str) -> Verdict:
    """``verdict`` with ``note`` added to its reason."""
    return dataclasses.replace(verdict, why="; ".join(p for p in (verdict.why, note) if p))


class Timing(NamedTuple):
    fusegraph_ms: float
    ort_ms: float
    paired: float | None = None  # median over rounds of fusegraph's block / ORT's adjacent block


def decide(fusegraph_ms: float, ort_ms: float, paired: float | None = None) -> Verdict:
    """Keep fusegraph only when clearly faster (``KEEP_BELOW``), by its best blocks and,
    where measured, by the rounds' paired ratios too."""
    keep = fusegraph_ms <= ort_ms * KEEP_BELOW and (paired is None or paired <= KEEP_BELOW)
    why = "" if paired is None or keep or fusegraph_ms > ort_ms * KEEP_BELOW else (
        f"the rounds' paired ratio {paired:.2f}x is not a clear win")
    return Verdict(keep, fusegraph_ms, ort_ms, "measured", why)


def decide_timing(timing: Sequence[float | None]) -> Verdict:
    """``decide`` on what a timer returned: (fusegraph ms, ORT ms[, paired ratio])."""
    fg_ms, ort_ms, *rest = timing
    assert fg_ms is not None and ort_ms is not None
    return decide(fg_ms, ort_ms, rest[0] if rest else None)


# ---- pauses ----------------------------------------------------------------------------------
class PauseCount:
    """How many times this process has been paused from outside (the background child, held
    by its parent while the caller's session runs: ``background.Gate``). A timed call during
    which the count moved is not that call's time and is dropped. Zero pauses elsewhere."""

    def __init__(self) -> None:
        self.read: Callable[[], int] = lambda: 0

    def __call__(self) -> int:
        return self.read()


PAUSES = PauseCount()  # set once by the background child (evaluate.py); read by the timing loops
MAX_DROPPED = 50  # calls a block may drop to pauses before it keeps what it has


def _timed(fn: Call) -> float | None:
    """One call's seconds, None where the process was paused during it."""
    p = PAUSES()
    t = time.perf_counter()
    fn()
    dt = time.perf_counter() - t
    return dt if PAUSES() == p else None


def _block(fn: Call, block_s: float, out: list[float]) -> None:
    """A time-based warm-up, then timed runs for ``block_s`` (at least MIN_RUNS): after any
    pause this shared machine runs slowly for tens of milliseconds. A call the process was
    paused in is timed again (``PAUSES``)."""
    t0 = time.perf_counter()
    fn()
    while time.perf_counter() - t0 < min(WARM_S, block_s / 2):
        fn()
    t1 = time.perf_counter()
    k = dropped = 0
    while k < MIN_RUNS or time.perf_counter() - t1 < block_s:
        dt = _timed(fn)
        if dt is None and dropped < MAX_DROPPED:
            dropped += 1
            continue
        out.append(dt if dt is not None else math.inf)
        k += 1


def time_pair(fusegraph: Call, ort: Call, budget_s: float) -> Timing:
    """Each side's ms: the best of its per-block medians over ROUNDS alternating blocks (never
    interleaved call by call: an ORT run right before slows the next PyTorch run on 2 cores).
    The best block, not the median of all runs: a neighbour's burst on this shared machine
    slows whichever side it lands on by up to tens of times (measured: a MobileNetV2 unit at
    456 ms in one block, 22 ms alone), and a burst rarely covers every block of one side."""
    one = [math.inf, math.inf]
    whole = 0  # rounds of one call each, neither paused
    for _ in range(2 + MAX_DROPPED):
        times = [_timed(fn) for fn in (fusegraph, ort)]
        if times[0] is None or times[1] is None:
            continue
        one = [min(one[0], times[0]), min(one[1], times[1])]
        whole += 1
        if not (one[0] > CLEAR * one[1] or one[1] > CLEAR * one[0]):
            break
        if whole == 2:
            # Clear-cut after two calls each (e.g. a plan that fell to op-by-op execution): no
            # blocks, whose minimum of runs would cost minutes where a call takes seconds. Two,
            # not one: a single call stalled by a neighbour's burst on this shared machine (a
            # 600 ms call of an 11 ms plan) must not decide.
            return Timing(one[0] * 1e3, one[1] * 1e3)
    block = max(budget_s, 0.0) / (2 * ROUNDS)
    a: list[float] = []
    b: list[float] = []
    for k in range(ROUNDS):
        first, second = ((fusegraph, a), (ort, b)) if k % 2 == 0 else ((ort, b), (fusegraph, a))
        for fn, out in (first, second):
            runs: list[float] = []
            _block(fn, block, runs)
            out.append(statistics.median(runs))
    # Each round's two adjacent blocks saw about the same load: the median of their ratios
    # must agree with the best blocks before fusegraph is kept (a lucky block alone kept
    # a BERT plan measured at 0.70x ONNX Runtime that ran at 1.08x).
    paired = statistics.median(x / y for x, y in zip(a, b, strict=True))
    return Timing(min(a) * 1e3, min(b) * 1e3, paired)


# ---- whole-model runners -------------------------------------------------------------------
class Runner(Protocol):
    """The whole model on one runtime (``direct.OrtRunner``, ``openvino_runner.OpenVinoRunner``)."""

    def run(self, wanted: Sequence[str] | None, feed: Mapping[str, Any], run_options: Any = None) -> list[Any]: ...


def choose_runner(
    incumbent: Call, against: str, candidates: Mapping[str, Callable[[], Runner]],
    feed: Mapping[str, np.ndarray], wanted: Sequence[str], reference: Sequence[Any], budget_s: float,
) -> tuple[Runner | None, Verdict]:
    """The whole model on each candidate runner against the incumbent (``incumbent``: the
    session's choice so far -- the caller's ONNX Runtime session or fusegraph's plan -- named
    ``against``), as a claimed unit is timed against ONNX Runtime: a trial run compared with
    ONNX Runtime's outputs (``reference``; the same dtypes and shapes, within RUNNER_AGREE,
    else refused with the reason), then ``time_pair`` with the budget, kept only when at least
    3% faster (KEEP_BELOW: ties go to the incumbent). Of the candidates that win, the one with
    the best ratio. Returns (the winner or None, the verdict naming it with every candidate's
    line); a candidate that cannot be made (not installed, refuses the model) is a line."""
    lines: list[str] = []
    best: tuple[float, str, Runner, Verdict] | None = None
    for name, make in candidates.items():
        label = RUNNERS.get(name, name)
        try:
            runner = make()
            got = runner.run(list(wanted), feed)
        except Exception as exc:
            lines.append(f"{label}: refused -- {_one_line(exc)}")
            continue
        why = _disagreement(got, reference, wanted)
        if why:
            lines.append(f"{label}: refused -- {why}")
            continue
        # A fresh runner's first calls are slow (OpenVINO's first inferences): warm both up,
        # or a clear-cut decision after two calls each would judge the warm-up.
        for fn in (lambda r=runner: r.run(list(wanted), feed), incumbent):  # type: ignore[misc]
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < RUNNER_WARM_S:
                fn()
        timing = time_pair(lambda r=runner: r.run(list(wanted), feed), incumbent, budget_s)  # type: ignore[misc]
        verdict = decide_timing(timing)
        ratio = (verdict.fusegraph_ms or math.inf) / max(verdict.ort_ms or math.inf, 1e-12)
        word = "faster" if verdict.keep else "not faster"
        lines.append(f"{label} {verdict.fusegraph_ms:.3f} ms vs {against} {verdict.ort_ms:.3f} ms "
                     f"({ratio:.2f}x: {word}{'; ' + verdict.why if verdict.why else ''})")
        if verdict.keep and (best is None or ratio < best[0]):
            best = (ratio, name, runner, verdict)
    if best is None:
        return None, Verdict(False, source="measured", candidates=tuple(lines), against=against)
    _, name, runner, verdict = best
    return runner, Verdict(False, verdict.fusegraph_ms, verdict.ort_ms, "measured", runner=name,
                           candidates=tuple(lines), against=against)


def _disagreement(got: Sequence[Any], want: Sequence[Any], names: Sequence[str]) -> str:
    """Why a runner's outputs are not ONNX Runtime's ("" where they agree)."""
    for name, g, w in zip(names, got, want, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        if g.dtype != w.dtype or g.shape != w.shape:
            return f"output {name} is {g.dtype}{list(g.shape)}, ONNX Runtime's {w.dtype}{list(w.shape)}"
    err = agreement(dict(zip(names, got, strict=True)), dict(zip(names, want, strict=True)))
    if err > RUNNER_AGREE:
        return f"disagrees with ONNX Runtime (rel err {err:.1e} > {RUNNER_AGREE:.0e})"
    return ""


def _one_line(exc: BaseException, n: int = 300) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:n]


# ---- content keys ---------------------------------------------------------------------------
def group_key(og: OnnxGraph, nodes: Sequence[ONode], inputs: Sequence[str], outputs: Sequence[str]) -> str:
    """What decides a sub-model's speed, hashed: per node its op type, domain and attributes,
    the values it reads and writes renamed by first appearance, their types and shapes, and
    the values of small constants (shapes, axes); not node names, not weight values."""
    h = hashlib.sha256()
    names: dict[str, str] = {}

    def ref(v: str) -> str:
        if v not in names:
            names[v] = f"v{len(names)}"
            info = og.types.get(v)
            c = og.constants.get(v)
            desc = ""
            if c is not None:
                arr = np.asarray(c)
                desc = f"const {arr.dtype} {arr.shape}"
                if arr.size <= SMALL_CONSTANT:
                    desc += f" {arr.tolist()}"
            elif info is not None:
                desc = f"{info.elem} {info.shape}"
            h.update(f"{names[v]}:{desc};".encode())
        return names[v]

    for i in inputs:
        ref(i)
    for n in nodes:
        h.update(f"[{n.domain}:{n.op_type} ".encode())
        h.update(" ".join(ref(i) if i else "-" for i in n.inputs).encode())
        h.update(b" -> ")
        h.update(" ".join(ref(o) if o else "-" for o in n.outputs).encode())
        for k in sorted(n.attrs):
            h.update(f" {k}={_attr_text(n.attrs[k])}".encode())
        h.update(b"]")
    h.update(("out " + " ".join(ref(o) for o in outputs)).encode())
    return h.hexdigest()


def _attr_text(v: Any) -> str:
    if isinstance(v, onnx.GraphProto | onnx.TensorProto):
        return hashlib.sha256(v.SerializeToString()).hexdigest()[:16]
    if isinstance(v, np.ndarray):
        return f"{v.dtype}{v.shape}{hashlib.sha256(v.tobytes()).hexdigest()[:16]}"
    if isinstance(v, list | tuple):
        return "[" + ",".join(_attr_text(x) for x in v) + "]"
    return repr(v)


def settings_key(device: str, settings: Mapping[str, Any]) -> str:
    """The machine and everything besides the sub-model that decides the verdict: a verdict
    stands until fusegraph, an engine or runtime it measured, or the options change. Not the
    machine's load: a model is evaluated once per machine and device (the class it was
    measured in travels in the verdict, ``Verdict.load``, and decides whether a whole-model
    runner's win applies: ``direct.as_allowed``)."""
    import onnxruntime

    from fusegraph.onnx import openvino_runner

    parts = [device, f"fusegraph {__version__}", f"onnxruntime {onnxruntime.__version__}", _torch_version(),
             openvino_runner.version(), _version("iree-base-compiler")]
    parts += [f"{k}={settings[k]}" for k in sorted(settings)]
    return "|".join(parts)


def _torch_version() -> str:
    return _version("torch")


def _version(dist: str) -> str:
    import importlib.metadata as md

    try:
        return f"{dist} {md.version(dist)}"
    except md.PackageNotFoundError:
        return f"no {dist}"


def cache_for(opts: ProviderOptions, device: str) -> VerdictCache:
    """The verdict table under the settings that decide a verdict: one key for a session,
    its plan and its background evaluation, whatever the machine's load (every verdict it
    records carries the class it was measured in)."""
    settings: dict[str, Any] = {
        "engine": opts.engine or "auto", "channels_last": opts.channels_last,
        "autotune": opts.autotune > 0, "keep_below": KEEP_BELOW, "runners": ",".join(opts.runner_candidates()),
    }
    load = opts.load if opts.load != "auto" else machine_load()
    return VerdictCache(opts.cache_dir, settings_key(device, settings), load)


def machine_load() -> str:
    """"busy" where the last minute's run queue (os.getloadavg) averages at least BUSY_LOAD
    per usable core, else "quiet". A whole-model runner's win only holds in the class it
    was measured in: ONNX Runtime without spinning won 15 of 18 models beside other work
    and loses ~10% on a quiet machine, so a runner measured under load does not run the
    model on a quiet machine (nor is the model measured again there: the caller's session
    runs it). The average counts the caller's own threads too (a spinning ORT pool among them)."""
    from fusegraph.select.device_id import usable_cores

    try:
        per_core = os.getloadavg()[0] / max(usable_cores(), 1)
    except OSError:  # no load average on this platform: taken as quiet
        return "quiet"
    return "busy" if per_core >= BUSY_LOAD else "quiet"


# ---- the verdict table ------------------------------------------------------------------------
class VerdictCache:
    """``onnx-floor.json`` under the cache directory, read once per session and written back
    once (``flush``), keyed by ``content|settings``."""

    def __init__(self, cache_dir: str | None, settings: str, load: str = "") -> None:
        self.path = (Path(cache_dir) if cache_dir else cache_root()) / FILE
        self.settings = settings
        self.load = load  # stamped on every verdict measured under this table that lacks a class
        self.enabled = cache_enabled()
        self._table: dict[str, Any] | None = None
        self._dirty: dict[str, Any] = {}

    def _key(self, content: str) -> str:
        return hashlib.sha256(f"{content}|{self.settings}".encode()).hexdigest()

    def lookup(self, content: str) -> Verdict | None:
        if not self.enabled:
            return None
        if self._table is None:
            self._table = read_table(self.path)
        key = self._key(content)
        return Verdict.from_json(self._dirty.get(key, self._table.get(key)))

    def record(self, content: str, verdict: Verdict) -> None:
        if self.enabled and verdict.source == "measured":
            if self.load and not verdict.load:
                verdict = dataclasses.replace(verdict, load=self.load)
            self._dirty[self._key(content)] = verdict.to_json()

    def flush(self) -> None:
        if not self._dirty:
            return
        dirty = dict(self._dirty)
        try:  # under the table's lock: another session may write its verdicts meanwhile
            update_table(self.path, lambda table: table.update(dirty))
            self._dirty = {}
        except OSError as exc:
            log.info("could not record floor verdicts in %s: %s", self.path, exc)


# ---- sample data ---------------------------------------------------------------------------
def sample_inputs(og: OnnxGraph, names: Iterable[str], seed: int = 0) -> dict[str, np.ndarray]:
    """Random activations for the floor's trial runs: standard normal floats, zeros for
    integers (usually indices) and False for booleans; None when a type is unknown."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for n in names:
        info = og.types.get(n)
        if info is None or not info.elem or info.shape is None:
            raise KeyError(n)
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(info.elem))
        shape = tuple(int(d) for d in info.shape)
        if dtype.kind == "f":
            out[n] = rng.standard_normal(shape).astype(dtype)
        else:
            out[n] = np.zeros(shape, dtype)
    return out


def agreement(got: Mapping[str, Any], want: Mapping[str, Any]) -> float:
    """Worst relative error over the outputs (inf where NaN/inf patterns differ)."""
    worst = 0.0
    for k, w in want.items():
        g = np.asarray(got[k], np.float64) if np.asarray(got[k]).dtype.kind in "fiub" else None
        w64 = np.asarray(w, np.float64) if np.asarray(w).dtype.kind in "fiub" else None
        if g is None or w64 is None:
            continue
        if g.shape != w64.shape or not np.array_equal(np.isfinite(g), np.isfinite(w64)):
            return float("inf")
        fin = np.isfinite(w64)
        den = max(float(np.linalg.norm(w64[fin])), 1e-30)
        worst = max(worst, float(np.linalg.norm(g[fin] - w64[fin])) / den)
    return worst
