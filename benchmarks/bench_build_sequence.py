"""A long sequence of small graph builds on the default engine, with memory tracking: the
hunt for issue 16's runaway (a ~350-graph port of a peer's test suite -- convolutions,
int8/bf16 matmul mixes, slices, attention -- twice in seven runs grew to 24 GB resident and
was killed by the kernel; which build ran away was not known).

    python benchmarks/bench_build_sequence.py                       # 350 graphs, seed 0
    prlimit --as=$((8<<30)) python benchmarks/bench_build_sequence.py --seed 3 --log /tmp/seq3.jsonl
    python benchmarks/bench_build_sequence.py --only 17,42 -v        # replay some graphs
    python benchmarks/bench_build_sequence.py --list | head          # what would be built

Graphs are drawn deterministically from ``--seed`` (graph i depends only on seed and i, so
``--only`` replays it exactly). Each is built with ``g.build()`` (default selection: the
engine the heuristics pick, the next one if that fails) and executed once with
``g.execute()`` on random inputs, checked against the float64 reference engine. Everything
runs with a fresh cache directory.

Per graph, one JSON line (flushed and fsynced before and after the build, so a process the
kernel kills leaves the graph that was building as the last ``start`` line): the engine and
knobs picked, build and execute seconds, RSS before and after, this graph's peak RSS (the
kernel's VmHWM, reset before each graph through /proc/self/clear_refs), the peak RSS of
the whole process tree (this process plus children such as a bounded ``iree-compile`` or a
oneDNN Graph probe, sampled every 50 ms), and the worst child's peak (RUSAGE_CHILDREN).

A watchdog thread stops the run when the process tree passes ``--watch-mib``: it writes
every thread's Python stack (which build, in which library) and the graph's JSON next to
the log, kills the children and exits with status 3 -- the runaway caught with its culprit,
instead of the machine taken down.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import math
import os
import re
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PAGE = os.sysconf("SC_PAGE_SIZE")
FAMILIES = ("conv", "matmul", "attention", "slice", "misc")
WEIGHTS = (0.34, 0.30, 0.16, 0.12, 0.08)


# ---- memory -------------------------------------------------------------------------------------
def status_kib(pid: int | str = "self") -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(("VmRSS", "VmHWM")):
                    k, v = line.split(":")
                    out[k] = int(v.split()[0])
    except OSError:
        pass
    return out


def reset_peak() -> bool:
    """Resets this process's VmHWM to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _children_of() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def descendants(pid: int) -> list[int]:
    tree, out, todo = _children_of(), [], [pid]
    while todo:
        for c in tree.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def tree_rss_kib(pid: int) -> tuple[int, int, int]:
    """(RSS of ``pid`` plus its descendants, the largest descendant's RSS, its pid) in KiB.
    A child caught between fork and exec counts the pages it shares with us twice."""
    own = status_kib(pid).get("VmRSS", 0)
    kids = [(status_kib(c).get("VmRSS", 0), c) for c in descendants(pid)]
    top = max(kids, default=(0, 0))
    return own + sum(k for k, _ in kids), top[0], top[1]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:300]
    except OSError:
        return "?"


class Watch:
    """Samples the process tree's RSS; past ``limit_kib`` it dumps the stacks and stops."""

    def __init__(self, limit_kib: int, dump: Path, current: Callable[[], dict[str, Any]]) -> None:
        self.limit_kib, self.dump, self.current = limit_kib, dump, current
        self.peak_tree = self.peak_child = 0
        self.peak_child_cmd = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def reset(self) -> None:
        self.peak_tree = self.peak_child = 0
        self.peak_child_cmd = ""

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        pid = os.getpid()
        while not self._stop.wait(0.05):
            total, child, cpid = tree_rss_kib(pid)
            self.peak_tree = max(self.peak_tree, total)
            if child > self.peak_child:
                self.peak_child, self.peak_child_cmd = child, cmdline(cpid)
            if self.limit_kib and total > self.limit_kib:
                self._runaway(total)

    def _runaway(self, total_kib: int) -> None:
        cur = self.current()
        with open(self.dump, "w") as fh:
            fh.write(f"RUNAWAY: process tree at {total_kib / 1024:.0f} MiB (watch limit "
                     f"{self.limit_kib / 1024:.0f} MiB) while building graph {cur.get('index')} "
                     f"{cur.get('name')}\n{cur.get('desc')}\n\nchildren:\n")
            for c in descendants(os.getpid()):
                fh.write(f"  {c} {status_kib(c).get('VmRSS', 0) / 1024:.0f} MiB  {cmdline(c)}\n")
            fh.write("\nPython stacks:\n")
            fh.flush()
            faulthandler.dump_traceback(fh, all_threads=True)
            fh.write("\ngraph JSON:\n" + str(cur.get("json", "")) + "\n")
        print(f"RUNAWAY caught: graph {cur.get('index')} {cur.get('name')}; details in {self.dump}",
              file=sys.stderr, flush=True)
        for c in descendants(os.getpid()):
            with contextlib.suppress(OSError):
                os.kill(c, signal.SIGKILL)
        os._exit(3)


# ---- the graphs ------------------------------------------------------------------------------
@dataclass
class Drawn:
    index: int
    family: str
    desc: str
    graph: Any  # fusegraph.Graph, or None when the drawn graph does not validate
    error: str = ""


def _dt(name: str) -> Any:
    import fusegraph as fg

    return {
        "f32": fg.DataType.FLOAT, "f16": fg.DataType.HALF, "bf16": fg.DataType.BFLOAT16,
        "i8": fg.DataType.INT8, "i32": fg.DataType.INT32,
    }[name]


def _conv(rng: np.random.Generator, i: int) -> tuple[str, Any]:
    import fusegraph as fg

    io = str(rng.choice(["f32", "f16", "bf16"], p=[0.5, 0.3, 0.2]))
    nsp = int(rng.choice([1, 2, 3], p=[0.15, 0.75, 0.10]))
    n = int(rng.integers(1, 5))
    groups = int(rng.choice([1, 1, 1, 2, 4]))
    c = groups * int(rng.integers(1, 17))
    k = groups * int(rng.integers(1, 17))
    spatial = [int(rng.integers(3, 33 if nsp < 3 else 9)) for _ in range(nsp)]
    ksz = [int(min(rng.choice([1, 3, 3, 5]), s)) for s in spatial]
    stride = [int(rng.choice([1, 1, 2])) for _ in range(nsp)]
    dil = [int(rng.choice([1, 1, 1, 2])) if ks * 2 <= s else 1 for ks, s in zip(ksz, spatial, strict=True)]
    pad = [int(rng.integers(0, ks // 2 + 1)) for ks in ksz]
    kind = str(rng.choice(["fprop", "fprop", "fprop", "dgrad", "wgrad"]))
    channels_last = bool(rng.random() < 0.7)
    epilogue = str(rng.choice(["none", "bias_relu", "bias", "gelu"]))
    lay = {1: ("NCW", "NWC"), 2: ("NCHW", "NHWC"), 3: ("NCDHW", "NDHWC")}[nsp][int(channels_last)]
    dt = _dt(io)
    g = fg.Graph(f"seq{i}_conv_{kind}", io_data_type=dt, intermediate_data_type=fg.DataType.FLOAT,
                 compute_data_type=fg.DataType.FLOAT)
    out_sp = [(s + 2 * p - d * (ks - 1) - 1) // st + 1
              for s, p, d, ks, st in zip(spatial, pad, dil, ksz, stride, strict=True)]
    xd, wd, yd = [n, c, *spatial], [k, c // groups, *ksz], [n, k, *out_sp]
    if kind == "fprop":
        x = g.tensor("x", xd, fg.strides_for(xd, lay))
        w = g.tensor("w", wd, fg.strides_for(wd, lay))
        y = g.conv_fprop(x, w, padding=pad, stride=stride, dilation=dil)
        if epilogue in ("bias", "bias_relu"):
            b = g.tensor("b", [1, k, *[1] * nsp])
            y = g.bias(y, b)
        if epilogue == "bias_relu":
            y = g.relu(y)
        elif epilogue == "gelu":
            y = g.gelu(y)
    elif kind == "dgrad":
        dy = g.tensor("dy", yd, fg.strides_for(yd, lay))
        w = g.tensor("w", wd, fg.strides_for(wd, lay))
        y = g.conv_dgrad(dy, w, padding=pad, stride=stride, dilation=dil)
        y.set_dim(xd).set_stride(fg.strides_for(xd, lay))
    else:
        x = g.tensor("x", xd, fg.strides_for(xd, lay))
        dy = g.tensor("dy", yd, fg.strides_for(yd, lay))
        y = g.conv_wgrad(x, dy, padding=pad, stride=stride, dilation=dil)
        y.set_dim(wd).set_stride(fg.strides_for(wd, lay))
    y.set_name("y").set_output(True)
    desc = (f"conv {kind} {nsp}-D {io} {lay} x{xd} w{wd} pad{pad} stride{stride} dil{dil} "
            f"groups={groups} epilogue={epilogue if kind == 'fprop' else '-'}")
    return desc, g


MATMUL_MIXES = (  # (a, b, out, compute), cast: how the narrower operand reaches the compute type
    ("i8", "bf16", "bf16", "f32"), ("bf16", "i8", "bf16", "f32"), ("i8", "bf16", "f32", "f32"),
    ("i8", "f16", "f16", "f32"), ("bf16", "bf16", "bf16", "f32"), ("f16", "f16", "f16", "f32"),
    ("f32", "f32", "f32", "f32"), ("i8", "i8", "i32", "i32"), ("i8", "f32", "f32", "f32"),
)


def _matmul(rng: np.random.Generator, i: int) -> tuple[str, Any]:
    import fusegraph as fg

    a_t, b_t, o_t, c_t = MATMUL_MIXES[int(rng.integers(len(MATMUL_MIXES)))]
    batch = [int(x) for x in rng.choice([1, 2, 4, 8, 16], size=int(rng.integers(0, 3)))]
    m, n, k = (int(rng.choice([1, 3, 8, 16, 32, 64, 128])) for _ in range(3))
    slice_where = str(rng.choice(["none", "a_k", "a_m", "c_n", "b_n"]))
    # cuDNN's mixed sample casts the narrow operand with an identity node; a graph with two
    # operand types and no cast is invalid, so "direct" only where the types agree
    cast = "direct" if a_t == b_t else "identity"
    epilogue = str(rng.choice(["none", "none", "bias", "gelu", "relu"]))
    g = fg.Graph(f"seq{i}_matmul_{a_t}x{b_t}", io_data_type=_dt(o_t), intermediate_data_type=_dt(c_t),
                 compute_data_type=_dt(c_t))
    ka = 2 * k if slice_where == "a_k" else k
    ma = 2 * m if slice_where == "a_m" else m
    nb = 2 * n if slice_where == "b_n" else n
    a = g.tensor("a", [*batch, ma, ka], data_type=_dt(a_t))
    b = g.tensor("b", [*batch, k, nb], data_type=_dt(b_t))
    r = len(batch)
    if slice_where == "a_k":
        a = g.slice(a, [k], [2 * k], axes=[r + 1])
    elif slice_where == "a_m":
        a = g.slice(a, [0], [2 * m], steps=[2], axes=[r])
    elif slice_where == "b_n":
        b = g.slice(b, [n // 2], [n // 2 + n], axes=[r + 1])
    if cast == "identity":  # the narrow operands cast to the other's float type first (cuDNN's mixed sample)
        want = next((t for t in (a_t, b_t) if t in ("bf16", "f16", "f32")), c_t)
        if a_t != want:
            a = g.identity(a)
            a.set_data_type(_dt(want))
        if b_t != want:
            b = g.identity(b)
            b.set_data_type(_dt(want))
    c = g.matmul(a, b)
    n_out = n
    if slice_where == "c_n":
        c.set_dim([*batch, m, n])
        n_out = max(1, n // 2)
        c = g.slice(c, [0], [n_out], axes=[r + 1])
    if epilogue == "bias" and o_t != "i32":
        c = g.bias(c, g.tensor("bias", [*[1] * r, 1, n_out]))
    elif epilogue in ("gelu", "relu") and o_t != "i32":
        c = g.gelu(c) if epilogue == "gelu" else g.relu(c)
    c.set_name("c").set_data_type(_dt(o_t)).set_output(True)
    desc = (f"matmul {a_t}x{b_t}->{o_t} (compute {c_t}) batch{batch} m{m} n{n} k{k} "
            f"slice={slice_where} cast={cast} epilogue={epilogue}")
    return desc, g


def _attention(rng: np.random.Generator, i: int) -> tuple[str, Any]:
    import fusegraph as fg

    io = str(rng.choice(["f32", "f16", "bf16"], p=[0.3, 0.4, 0.3]))
    b = int(rng.integers(1, 3))
    hk = int(rng.choice([1, 2, 4]))
    h = hk * int(rng.choice([1, 1, 2, 4]))
    sq = int(rng.choice([1, 7, 16, 64, 128]))
    skv = sq if rng.random() < 0.7 else int(rng.choice([8, 32, 77]))
    d = int(rng.choice([16, 32, 64]))
    causal = bool(rng.random() < 0.4)
    masked = bool(rng.random() < 0.2)
    g = fg.Graph(f"seq{i}_sdpa", io_data_type=_dt(io), intermediate_data_type=fg.DataType.FLOAT,
                 compute_data_type=fg.DataType.FLOAT)
    q = g.tensor("q", [b, h, sq, d])
    k = g.tensor("k", [b, hk, skv, d])
    v = g.tensor("v", [b, hk, skv, d])
    mask = g.tensor("mask", [1, 1, sq, skv]) if masked else None
    o = g.sdpa(q, k, v, attn_scale=float(d) ** -0.5, causal=causal, mask=mask)
    o.set_name("o").set_output(True)
    return f"sdpa {io} b{b} h{h} hk{hk} sq{sq} skv{skv} d{d} causal={causal} mask={masked}", g


def _slice(rng: np.random.Generator, i: int) -> tuple[str, Any]:
    import fusegraph as fg

    io = str(rng.choice(["f32", "f16", "bf16", "i8"], p=[0.4, 0.2, 0.2, 0.2]))
    rank = int(rng.integers(2, 5))
    dims = [int(rng.integers(1, 33)) for _ in range(rank)]
    g = fg.Graph(f"seq{i}_slice", io_data_type=_dt(io), compute_data_type=fg.DataType.FLOAT)
    x = g.tensor("x", dims)
    axes = sorted({int(a) for a in rng.integers(0, rank, size=int(rng.integers(1, rank + 1)))})
    starts = [int(rng.integers(0, dims[a])) for a in axes]
    ends = [int(rng.integers(s + 1, dims[a] + 1)) for s, a in zip(starts, axes, strict=True)]
    steps = [int(rng.choice([1, 1, 2, 3])) for _ in axes]
    y = g.slice(x, starts, ends, steps=steps, axes=axes)
    tail = str(rng.choice(["none", "relu", "concat", "mul"])) if io != "i8" else "none"
    if tail == "relu":
        y = g.relu(y)
    elif tail == "mul":
        y = g.mul(y, y)
    elif tail == "concat":
        y = g.concatenate([y, y], axis=int(axes[0]))
    y.set_name("y").set_output(True)
    return f"slice {io} x{dims} axes{axes} starts{starts} ends{ends} steps{steps} then {tail}", g


def _misc(rng: np.random.Generator, i: int) -> tuple[str, Any]:
    import fusegraph as fg

    io = str(rng.choice(["f32", "f16", "bf16"]))
    kind = str(rng.choice(["layernorm", "rmsnorm", "softmax", "pointwise", "pool"]))
    n, c, hw = int(rng.integers(1, 5)), int(rng.integers(1, 65)), int(rng.integers(2, 17))
    g = fg.Graph(f"seq{i}_{kind}", io_data_type=_dt(io), intermediate_data_type=fg.DataType.FLOAT,
                 compute_data_type=fg.DataType.FLOAT)
    if kind == "pool":
        x = g.tensor("x", [n, c, hw, hw], fg.strides_for([n, c, hw, hw], "NHWC"))
        win = min(hw, int(rng.choice([2, 3])))
        y = g.pooling(x, fg.PoolingMode.MAX, window=[win, win], stride=[win, win])
    elif kind in ("layernorm", "rmsnorm"):
        x = g.tensor("x", [n, c, hw])
        s = g.tensor("s", [1, c, hw])
        if kind == "layernorm":
            y, _, _ = g.layernorm(x, s, g.tensor("bb", [1, c, hw]), epsilon=1e-5)
        else:
            y, _ = g.rmsnorm(x, s, epsilon=1e-5)
    elif kind == "softmax":
        y = g.softmax(g.tensor("x", [n, c, hw]), axis=-1)
    else:
        x = g.tensor("x", [n, c, hw])
        y = g.tanh(g.add(g.mul(x, g.tensor("s", [1, c, 1])), g.sigmoid(x)))
    y.set_name("y").set_output(True)
    return f"{kind} {io} n{n} c{c} hw{hw}", g


DRAW = {"conv": _conv, "matmul": _matmul, "attention": _attention, "slice": _slice, "misc": _misc}


def draw(seed: int, index: int) -> Drawn:
    """Graph ``index`` of the sequence for ``seed`` (depends on nothing else)."""
    rng = np.random.default_rng([seed, index])
    family = str(rng.choice(FAMILIES, p=WEIGHTS))
    try:
        desc, g = DRAW[family](rng, index)
    except Exception as exc:  # a drawn graph the builder refuses: counted, not built
        return Drawn(index, family, f"{family} (builder refused)", None, f"{type(exc).__name__}: {exc}")
    try:
        g.validate()
    except Exception as exc:
        return Drawn(index, family, desc, None, f"{type(exc).__name__}: {exc}")
    return Drawn(index, family, desc, g)


# ---- the run -------------------------------------------------------------------------------------
class Log:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = open(path, "a")  # noqa: SIM115 -- held for the run, fsynced per record

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, default=str) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())


def parse_config(text: str) -> Any:
    """``iree:ukernels=none,opt_level=O3`` -> EngineConfig (values: bool, int, float, else str)."""
    from fusegraph.engines.base import EngineConfig

    engine, _, rest = text.partition(":")
    knobs = []
    for kv in filter(None, rest.split(",")):
        k, _, v = kv.partition("=")
        value: Any = {"true": True, "false": False}.get(v.lower(), v)
        if isinstance(value, str):
            for cast in (int, float):
                try:
                    value = cast(v)
                    break
                except ValueError:
                    pass
        knobs.append((k.strip(), value))
    return EngineConfig(engine.strip(), tuple(sorted(knobs)))


def run_one(
    d: Drawn, log: Log, watch: Watch, current: dict[str, Any], check: bool, input_seed: int, config: Any = None
) -> dict[str, Any]:
    from fusegraph.reference.executor import run_reference
    from fusegraph.reference.inputs import random_inputs
    from fusegraph.select.autotune import compare, tolerance

    rec: dict[str, Any] = {"index": d.index, "family": d.family, "name": d.graph.name, "desc": d.desc}
    current.update(index=d.index, name=d.graph.name, desc=d.desc, json=d.graph.to_json())
    log.write({"event": "start", **rec})
    before = status_kib()
    child_before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    reset_peak()
    watch.reset()
    t0 = time.perf_counter()
    try:
        plan = None
        if config is not None:
            try:
                plan = d.graph.build(config=config)
            except Exception as exc:  # refused or failed: recorded, then the default selection
                rec["config_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                rec["config_s"] = round(time.perf_counter() - t0, 3)
                d.graph.plans.clear()
        if plan is None:
            plan = d.graph.build()
        rec["engine"] = plan.engine
        rec["config"] = str(plan.config)
        rec["build_s"] = round(time.perf_counter() - t0, 3)
        inputs = random_inputs(d.graph, np.random.default_rng([input_seed, d.index]))
        t1 = time.perf_counter()
        out = d.graph.execute(inputs)
        rec["execute_s"] = round(time.perf_counter() - t1, 4)
        if check:
            ref = run_reference(d.graph, inputs)
            err, why = compare(d.graph, out, ref)
            tol = tolerance(d.graph)
            rec["rel_error"] = err if math.isfinite(err) else str(err)
            rec["status"] = "ok" if err <= tol else f"MISMATCH {why or f'{err:.2e} > {tol:.0e}'}"
        else:
            rec["status"] = "ok"
        del plan, out
    except Exception as exc:
        rec["build_s"] = rec.get("build_s", round(time.perf_counter() - t0, 3))
        rec["status"] = f"error {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    after = status_kib()
    child_after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    rec.update(
        rss_before_mib=round(before.get("VmRSS", 0) / 1024, 1),
        rss_after_mib=round(after.get("VmRSS", 0) / 1024, 1),
        peak_mib=round(after.get("VmHWM", 0) / 1024, 1),
        tree_peak_mib=round(watch.peak_tree / 1024, 1),
        child_peak_mib=round(watch.peak_child / 1024, 1),
        child_peak_cmd=watch.peak_child_cmd[:120] or None,
        children_maxrss_mib=round(child_after / 1024, 1) if child_after > child_before else None,
    )
    d.graph.plans.clear()
    log.write({"event": "done", **rec})
    return rec


def summarize(records: list[dict[str, Any]], wall: float) -> str:
    by_engine: dict[str, int] = {}
    for r in records:
        by_engine[str(r.get("engine", "-"))] = by_engine.get(str(r.get("engine", "-")), 0) + 1
    bad = [r for r in records if r["status"] != "ok"]
    slow = sorted(records, key=lambda r: -float(r.get("build_s", 0)))[:5]
    big = sorted(records, key=lambda r: -float(r.get("tree_peak_mib", 0)))[:5]
    lines = [
        f"{len(records)} graphs built in {wall:.0f} s; engines: "
        + ", ".join(f"{k} {v}" for k, v in sorted(by_engine.items())),
        f"RSS {records[0]['rss_before_mib']:.0f} -> {records[-1]['rss_after_mib']:.0f} MiB; "
        f"largest per-graph peak {max(r['peak_mib'] for r in records):.0f} MiB; "
        f"largest process-tree peak {max(r['tree_peak_mib'] for r in records):.0f} MiB",
        f"not ok: {len(bad)}",
        *(f"  [{r['index']}] {r['desc']}: {r['status']}" for r in bad[:20]),
        "slowest builds:",
        *(f"  [{r['index']}] {r.get('build_s', 0):7.2f} s  {r.get('engine', '-'):9s} {r['desc']}" for r in slow),
        "largest process-tree peaks:",
        *(f"  [{r['index']}] {r['tree_peak_mib']:7.0f} MiB  {r.get('engine', '-'):9s} {r['desc']}" for r in big),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graphs", type=int, default=350)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None, help="comma-separated graph indices to (re)run")
    ap.add_argument("--start", type=int, default=0, help="first graph index")
    ap.add_argument("--family", default=None, choices=FAMILIES, help="only graphs of this family")
    ap.add_argument("--config", default=None, metavar="ENGINE:KEY=VALUE,...",
                    help="build with this engine config first (e.g. iree:ukernels=none), the default "
                         "selection where it is refused or fails")
    ap.add_argument("--exclude", default=None, metavar="REGEX",
                    help="skip graphs whose description matches (e.g. a known crash, to go on hunting)")
    ap.add_argument("--log", default=None, help="JSON-lines log (default: a temp file)")
    ap.add_argument("--watch-mib", type=int, default=6144,
                    help="stop, with stacks, when the process tree passes this RSS (0: never)")
    ap.add_argument("--input-seed", type=int, default=1, help="seed of the random input values")
    ap.add_argument("--no-check", action="store_true", help="skip the comparison with the reference")
    ap.add_argument("--list", action="store_true", help="print the drawn graphs and exit")
    ap.add_argument("--keep-cache", action="store_true", help="keep the fresh cache directory (reproducers...)")
    ap.add_argument("-v", "--verbose", action="store_true", help="a line per graph")
    args = ap.parse_args(argv)

    indices = ([int(x) for x in args.only.split(",")] if args.only
               else list(range(args.start, args.start + args.graphs)))
    if args.list:
        for i in indices:
            d = draw(args.seed, i)
            print(f"[{i}] {d.desc}" + (f"  INVALID: {d.error}" if d.error else ""))
        return 0
    faulthandler.enable()  # a crash in native code leaves the Python stack: which build, which library
    config = parse_config(args.config) if args.config else None
    cache = tempfile.mkdtemp(prefix="fusegraph-seq-")
    os.environ["FUSEGRAPH_CACHE_DIR"] = cache
    log_path = Path(args.log or tempfile.mktemp(prefix="fusegraph-seq-", suffix=".jsonl"))
    log = Log(log_path)
    current: dict[str, Any] = {}
    watch = Watch(args.watch_mib * 1024, log_path.with_suffix(".runaway.txt"), lambda: dict(current))
    watch.start()
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = "none" if soft == resource.RLIM_INFINITY else f"{soft / 2**30:.1f} GiB"
    env = {k: v for k, v in os.environ.items() if k.startswith("FUSEGRAPH_")}
    print(f"seed {args.seed}, {len(indices)} graphs; cache {cache}; log {log_path}; address-space limit "
          f"{limit}; watch {args.watch_mib} MiB; env {env}", flush=True)
    log.write({"event": "run", "seed": args.seed, "graphs": len(indices), "cache": cache, "as_limit": limit,
               "env": env, "argv": sys.argv})
    records, invalid = [], []
    t0 = time.perf_counter()
    for i in indices:
        d = draw(args.seed, i)
        if (args.exclude and re.search(args.exclude, d.desc)) or (args.family and d.family != args.family):
            log.write({"event": "excluded", "index": i, "desc": d.desc})
            continue
        if d.graph is None:
            invalid.append(d)
            log.write({"event": "invalid", "index": i, "desc": d.desc, "error": d.error})
            continue
        rec = run_one(d, log, watch, current, check=not args.no_check, input_seed=args.input_seed,
                      config=config)
        records.append(rec)
        if args.verbose or rec["status"] != "ok":
            print(f"[{i:3d}] {rec.get('engine', '-'):9s} build {rec.get('build_s', 0):6.2f} s  "
                  f"peak {rec['peak_mib']:6.0f} MiB tree {rec['tree_peak_mib']:6.0f} MiB  "
                  f"{rec['status'][:60]:12s} {d.desc}", flush=True)
        elif len(records) % 25 == 0:
            print(f"  {len(records)} graphs, {time.perf_counter() - t0:.0f} s, RSS {rec['rss_after_mib']:.0f} MiB",
                  flush=True)
    watch.stop()
    wall = time.perf_counter() - t0
    if records:
        text = summarize(records, wall)
        print(text)
        log.write({"event": "summary", "text": text, "invalid": len(invalid)})
    if invalid:
        print(f"{len(invalid)} drawn graphs did not validate (not built):")
        for d in invalid[:10]:
            print(f"  [{d.index}] {d.desc}: {d.error[:200]}")
    if args.keep_cache:
        print(f"cache kept: {cache}")
    else:
        shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MemoryError:
        traceback.print_exc()
        sys.exit(4)
