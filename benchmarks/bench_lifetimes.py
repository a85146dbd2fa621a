"""Lifetimes: does fusegraph leak over many build/execute/release cycles, is one plan safe to
execute from several threads, and does the interpreter exit cleanly with live objects?

    python benchmarks/bench_lifetimes.py                      # 10,000 cycles per CPU engine
    python benchmarks/bench_lifetimes.py --cycles 2000 --engines iree
    python benchmarks/bench_lifetimes.py --device cuda:0    # every available GPU engine

1. Cycles: each builds a fresh Graph (conv + bias + relu and a layernorm, NHWC, f32) -- the
   same graph every cycle, so after the first an IREE build is a module-cache hit; with
   ``--distinct`` a graph of its own each cycle, so every build compiles and loads a module --
   builds its plan on the engine, executes it on fresh random inputs (checked against the float64
   reference every 500 cycles), and drops everything. Host RSS (/proc/self/statm) and open
   file descriptors (/proc/self/fd) are sampled; "flat" means the fds did not grow and RSS
   grew by less than 2% (+16 MiB slack) between the first 10% of cycles and the end.
   The CPU engines hold no device memory apart from host RSS. With ``--device cuda:0`` the
   inputs are staged on the GPU each cycle (``plan.stage``) and the GPU's memory is sampled
   too: torch's allocated and reserved bytes, and the device's used bytes
   (``cudaMemGetInfo``, which also sees cuDNN's and the driver's own allocations, CUDA graphs
   included); each engine gets the cycle graph it runs whole (the cudnn engine conv + bias
   + relu, triton the layernorm, torch both).
2. Threads: one plan, 8 threads, 200 executes each on their own inputs, every result checked.
3. Exit: a child process builds plans on every engine, creates Buffers, runs once and exits
   without releasing anything; its exit status and stderr are reported.

Everything runs with a temporary cache directory.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from typing import Any

import numpy as np

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE / 2**20


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def make_graph(seed: int, distinct: bool = False) -> Any:
    """The cycle's graph: the same one every time (a build after the first is a cache hit,
    which is what an application rebuilding its graphs does), or with ``distinct`` a new
    output-channel count per cycle, so that every build compiles (IREE) and loads a new module."""
    import fusegraph as fg

    g = fg.Graph(name="lifetime", io_data_type=fg.DataType.FLOAT)
    n, c, h, w, k = 2, 8, 8, 8, (16 + seed % 100_000 if distinct else 16)
    x = g.tensor("x", [n, c, h, w], fg.strides_for([n, c, h, w], "NHWC"))
    wt = g.tensor("w", [k, c, 3, 3], fg.strides_for([k, c, 3, 3], "KRSC"))
    b = g.tensor("b", [1, k, 1, 1])
    y = g.relu(g.bias(g.conv_fprop(x, wt, padding=[1, 1]), b))
    s = g.tensor("s", [1, k, h, w])
    bb = g.tensor("bb", [1, k, h, w])
    out, _, _ = g.layernorm(y, s, bb, epsilon=1e-5)
    out.set_name("y").set_output(True)
    return g.validate()


def gpu_graph(engine: str, seed: int, distinct: bool = False) -> Any:
    """The cycle graph for a GPU engine: the whole of ``make_graph`` where the engine runs
    it (torch), else the part it does (cudnn: conv + bias + relu; triton: the layernorm)."""
    import fusegraph as fg

    if engine == "torch":
        return make_graph(seed, distinct)
    g = fg.Graph(name="lifetime", io_data_type=fg.DataType.FLOAT)
    n, c, h, w, k = 2, 8, 8, 8, (16 + seed % 100_000 if distinct else 16)
    if engine == "triton":
        x = g.tensor("x", [n * h * w, k + c])
        s, bb = g.tensor("s", [1, k + c]), g.tensor("bb", [1, k + c])
        out, _, _ = g.layernorm(x, s, bb, epsilon=1e-5)
    else:
        x = g.tensor("x", [n, c, h, w], fg.strides_for([n, c, h, w], "NHWC"))
        wt = g.tensor("w", [k, c, 3, 3], fg.strides_for([k, c, 3, 3], "KRSC"))
        b = g.tensor("b", [1, k, 1, 1])
        out = g.relu(g.bias(g.conv_fprop(x, wt, padding=[1, 1]), b))
    out.set_name("y").set_output(True)
    return g.validate()


def gpu_mib() -> tuple[float, float, float]:
    """torch's allocated and reserved MiB and the device's used MiB."""
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return (torch.cuda.memory_allocated() / 2**20, torch.cuda.memory_reserved() / 2**20,
            (total - free) / 2**20)


def cycles(engine: str, count: int, distinct: bool = False, device: str = "cpu") -> dict[str, Any]:
    from tqdm import tqdm

    from fusegraph.reference.inputs import random_inputs

    gpu = device != "cpu"
    rng = np.random.default_rng(0)
    samples: list[tuple[int, float, int]] = []
    gpu_samples: list[tuple[int, float, float, float]] = []
    worst = 0.0
    t0 = time.perf_counter()
    for i in tqdm(range(count), desc=f"{engine} cycles", mininterval=5, file=sys.stderr):
        g = gpu_graph(engine, i, distinct) if gpu else make_graph(i, distinct)
        plan = g.build(device, engine=engine)
        ins = random_inputs(g, rng)
        out = plan.execute(plan.stage(ins) if gpu else ins)
        if i % 500 == 0:
            ref = g.execute(dict(ins), engine="reference")["y"]
            y = out["y"].cpu().numpy() if gpu else out["y"]
            got = np.asarray(y, np.float64)
            worst = max(worst, float(np.linalg.norm(got - ref) / np.linalg.norm(ref)))
        del g, plan, ins, out
        if i % max(count // 50, 1) == 0 or i == count - 1:
            gc.collect()
            samples.append((i, rss_mib(), open_fds()))
            if gpu:
                gpu_samples.append((i, *gpu_mib()))
    elapsed = time.perf_counter() - t0
    early = [s for s in samples if s[0] <= count // 10] or samples[:1]
    base_rss, base_fd = max(s[1] for s in early), max(s[2] for s in early)
    end_rss, end_fd = samples[-1][1], samples[-1][2]
    flat = end_fd <= base_fd and end_rss <= base_rss * 1.02 + 16
    result = {
        "engine": engine, "cycles": count, "seconds": elapsed, "rss_start": samples[0][1],
        "rss_after_10pct": base_rss, "rss_end": end_rss, "rss_max": max(s[1] for s in samples),
        "fd_start": samples[0][2], "fd_after_10pct": base_fd, "fd_end": end_fd, "flat": flat,
        "max_rel_err": worst, "samples": samples,
    }
    if gpu:
        early_gpu = [s for s in gpu_samples if s[0] <= count // 10] or gpu_samples[:1]
        base_used = max(s[3] for s in early_gpu)
        end_used = gpu_samples[-1][3]
        # The device's used bytes grow in 2 MiB pages: flat means within 8 MiB of cycle 10%.
        result.update(gpu_samples=gpu_samples, gpu_used_after_10pct=base_used, gpu_used_end=end_used,
                      flat=flat and end_used <= base_used + 8)
    return result


def threads(engine: str, n_threads: int = 8, per_thread: int = 200, device: str = "cpu") -> dict[str, Any]:
    """On a GPU each thread runs on a stream of its own (the calls share the plan)."""
    from fusegraph.reference.inputs import random_inputs

    gpu = device != "cpu"
    g = gpu_graph(engine, 0) if gpu else make_graph(0)
    plan = g.build(device, engine=engine)
    rng = np.random.default_rng(1)
    cases = []
    for _ in range(n_threads):
        ins = random_inputs(g, rng)
        cases.append((plan.stage(ins) if gpu else ins, g.execute(dict(ins), engine="reference")["y"]))
    if gpu:
        import torch

        torch.cuda.synchronize()  # the staging copies ran on the default stream
    errors: list[str] = []
    worst = [0.0]
    lock = threading.Lock()

    def work(t: int) -> None:
        if gpu:
            import torch

            with torch.cuda.stream(torch.cuda.Stream()):
                run(t)
        else:
            run(t)

    def run(t: int) -> None:
        ins, ref = cases[t]
        for _ in range(per_thread):
            try:
                y = plan.execute(ins)["y"]
                got = np.asarray(y.cpu().numpy() if gpu else y, np.float64)
            except Exception as exc:
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
                return
            err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            with lock:
                worst[0] = max(worst[0], err)

    ts = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return {"engine": engine, "threads": n_threads, "executes": n_threads * per_thread,
            "seconds": time.perf_counter() - t0, "errors": errors[:3], "n_errors": len(errors),
            "max_rel_err": worst[0], "correct": not errors and worst[0] < 1e-4}


EXIT_CHILD = """
    import numpy as np
    import fusegraph as fg
    from fusegraph.runtime.buffer import Buffer
    from fusegraph.reference.inputs import random_inputs
    sys.path.insert(0, {bench!r})
    from bench_lifetimes import make_graph
    from bench_lifetimes import gpu_graph
    device = {device!r}
    keep = []
    for engine in {engines!r}:
        g = make_graph(0) if device == "cpu" else gpu_graph(engine, 0)
        plan = g.build(device, engine=engine)
        ins = random_inputs(g, np.random.default_rng(0))
        out = plan.execute(ins if device == "cpu" else plan.stage(ins))
        # on a GPU, device tensors stand for Buffers (fusegraph Buffers there need IREE's CUDA runtime)
        bufs = ([Buffer.from_numpy(a, tensor=g.tensor_by_name(k)) for k, a in ins.items()] if device == "cpu"
                else list(plan.stage(ins).values()))
        keep.append((g, plan, ins, out, bufs))
    if {via_buffers!r}:
        g, plan = keep[-1][0], keep[-1][1]
        keep.append(g.execute({{k: b for k, b in zip(ins, keep[-1][4])}}, handle=device, engine={engines!r}[-1]))
    print("live objects:", len(keep))
"""


def exit_clean(engines: list[str], device: str = "cpu") -> dict[str, Any]:
    bench = os.path.dirname(os.path.abspath(__file__))
    results = {}
    for via_buffers in (False, True):
        code = "import sys\n" + textwrap.dedent(EXIT_CHILD).format(bench=bench, engines=engines, via_buffers=via_buffers,
                                                                   device=device)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        results["buffers executed" if via_buffers else "plans + buffers alive"] = {
            "rc": proc.returncode, "stderr": proc.stderr.strip()[-500:],
            "clean": proc.returncode == 0 and "Traceback" not in proc.stderr and "Error" not in proc.stderr,
        }
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=10_000)
    ap.add_argument("--engines", nargs="*", default=None, help="default: every available CPU engine")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda:N for the GPU engines")
    ap.add_argument("--distinct", action="store_true",
                    help="a new graph (new cache key) every cycle: every IREE build compiles and loads a module")
    args = ap.parse_args()
    os.environ.setdefault("FUSEGRAPH_CACHE_DIR", tempfile.mkdtemp(prefix="fusegraph-lifetimes-"))
    from fusegraph.engines.registry import REGISTRY

    mine = ("reference", "torch", "iree") if args.device == "cpu" else ("cudnn", "triton", "torch")
    engines = args.engines or [e.name for e in REGISTRY.available_engines() if e.name in mine]
    print(f"engines: {engines}; cache: {os.environ['FUSEGRAPH_CACHE_DIR']}")
    print("\n== build/execute/release cycles ==")
    print(f"{'engine':10s} {'cycles':>7s} {'s':>7s} {'RSS start':>10s} {'@10%':>8s} {'end':>8s} {'max':>8s} "
          f"{'fd start':>9s} {'@10%':>5s} {'end':>5s} {'flat':>5s} {'max err':>8s}")
    for e in engines:
        r = cycles(e, args.cycles, args.distinct, args.device)
        print(f"{e:10s} {r['cycles']:7d} {r['seconds']:7.1f} {r['rss_start']:9.1f}M {r['rss_after_10pct']:7.1f}M "
              f"{r['rss_end']:7.1f}M {r['rss_max']:7.1f}M {r['fd_start']:9d} {r['fd_after_10pct']:5d} {r['fd_end']:5d} "
              f"{'yes' if r['flat'] else 'NO':>5s} {r['max_rel_err']:8.1e}", flush=True)
        print("           RSS along the way (cycle: MiB): "
              + ", ".join(f"{i}: {m:.1f}" for i, m, _ in [*r["samples"][::5], r["samples"][-1]]), flush=True)
        if "gpu_samples" in r:
            print(f"           GPU MiB (cycle: torch allocated / reserved / device used), @10% used "
                  f"{r['gpu_used_after_10pct']:.1f}, end {r['gpu_used_end']:.1f}: "
                  + ", ".join(f"{i}: {a:.1f}/{rs:.1f}/{u:.1f}"
                              for i, a, rs, u in [*r["gpu_samples"][::5], r["gpu_samples"][-1]]), flush=True)
    print("\n== one plan, 8 threads x 200 executes ==")
    for e in engines:
        r = threads(e, device=args.device)
        verdict = "correct" if r["correct"] else (f"refused/failed: {r['errors'][0]}" if r["errors"] else "WRONG NUMBERS")
        print(f"{e:10s} {r['executes']} executes in {r['seconds']:.2f} s, max rel err {r['max_rel_err']:.1e}: {verdict}", flush=True)
    print("\n== interpreter exit with live plans and Buffers ==")
    for case, r in exit_clean(engines, args.device).items():
        print(f"{case:24s} rc {r['rc']}, {'clean' if r['clean'] else 'NOT CLEAN: ' + r['stderr']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
