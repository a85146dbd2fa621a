"""A model's first session on the CPU against ONNX Runtime alone (issue 24 item 7).

A model fusegraph has no verdict for opens on ONNX Runtime while a background child builds
and times fusegraph's plan (``fusegraph/onnx/background.py``). This measures what that
costs the caller: per model, in a process of its own, with a cold cache directory, a
fusegraph session (shipped defaults: ``floor_mode=background``) and a plain
``onnxruntime.InferenceSession`` (default options: what the caller would have had) are run
N times each, interleaved call by call (the order alternating), each call after a pause of
``--gap`` seconds (a caller that is not running back to back: the child gets the gaps).
ONNX Runtime's calls are the baseline without the child: the child is held (stopped)
through each of their pauses and calls, so none of its work lands on them, while the
fusegraph session's calls get whatever the child did in the gap before them (and, with
``--no-pause``, the child running beside them, as before the gate). The ratio is the
median of the fusegraph session's call times over the median of ONNX Runtime's (also
printed: the ratio of their 25th percentiles and the median of the per-pair ratios, less
moved by a neighbour's bursts). With ``--burst B --idle S``, every B pairs the first call
(either side) follows S seconds of idle, in which the session lets the child work: the
fusegraph session's call after it meets whatever the child left in the caches, ONNX
Runtime's (the child held through its idle) does not.

    python benchmarks/bench_first_session.py                      # the default models
    python benchmarks/bench_first_session.py --models resnet18,hf_bert --runs 40 --gap 0.05
    python benchmarks/bench_first_session.py --burst 5 --idle 1   # bursts of 5 pairs, 1 s idle before each
    python benchmarks/bench_first_session.py --no-pause           # the child not held (the old behaviour)
    python benchmarks/bench_first_session.py --new-shapes light:squeezenet --batches 1,2,4,8

Models come from ``benchmarks/bench_models.py`` (torchvision / timm / transformers with
random weights, exported once and cached). Prints per model: both medians, the ratio, the
child's CPU seconds during the measurement (its own threads), the others' share of the
CPU (``/proc/stat``: everything but this process and the child) and the load average.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

# light:<name>: the onnx wheel's light_<name>.onnx architectures with random weights
# (fusegraph.onnx.weights); other names: benchmarks/bench_models.py's corpus (torchvision,
# timm and transformers models need those libraries; the torch.nn ones need torch only).
DEFAULT_MODELS = ("light:resnet50,light:squeezenet,light:shufflenet,light:densenet121,light:inception_v1,"
                  "light:inception_v2,nn_lstm_tagger,nn_gru_tagger,nn_encoder_256,nn_se_mobile")


def _quantile(xs: list[float], q: float) -> float:
    return float(np.quantile(np.asarray(xs), q))


def _jiffies_total() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def _jiffies_of(pid: int | str) -> int:
    """utime + stime of a process (all its threads), 0 where it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    rest = stat[stat.rindex(")") + 2:].split()
    return int(rest[11]) + int(rest[12])


def measure(path: str, runs: int, gap: float, pause: bool, burst: int = 0, idle: float = 0.0) -> dict[str, Any]:
    import onnxruntime as ort

    import fusegraph.onnx as fgo
    from fusegraph.onnx import background

    background.PAUSE_CHILD = pause
    cache = tempfile.mkdtemp(prefix="fg-first-session-")
    t0 = time.perf_counter()
    fg = fgo.InferenceSession(path, providers=[(fgo.PROVIDER, {"cache_dir": cache}), "CPUExecutionProvider"])
    setup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    alone = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    ort_setup_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    feed: dict[str, np.ndarray] = {}
    for i in alone.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        feed[i.name] = (rng.standard_normal(shape).astype(np.float32) if i.type == "tensor(float)"
                        else np.zeros(shape, np.int64))
    evaluation = fg._direct.evaluation if fg._direct is not None else None
    gate = getattr(evaluation, "gate", None)
    child = evaluation.pid if evaluation is not None else 0

    def hold_child() -> Any:
        """The baseline's slot: the child stopped throughout (its gate, else a signal)."""
        import contextlib

        if gate is not None and gate.enabled:
            return gate.hold()

        @contextlib.contextmanager
        def stopped() -> Any:
            if child:
                os.killpg(child, signal.SIGSTOP)
            try:
                yield
            finally:
                if child:
                    os.killpg(child, signal.SIGCONT)

        return stopped()

    def fg_call(pause: float) -> float:
        time.sleep(pause)  # the child may work here, as the session allows it
        t = time.perf_counter()
        fg.run(None, feed)
        return time.perf_counter() - t

    def ort_call(pause: float) -> float:
        with hold_child():  # ONNX Runtime alone: no work of the child before or during the call
            time.sleep(pause)
            t = time.perf_counter()
            alone.run(None, feed)
            return time.perf_counter() - t

    for _ in range(3):  # first calls of each (ORT's own warm-up)
        fg_call(gap)
        ort_call(gap)
    a: list[float] = []
    b: list[float] = []
    busy0, total0 = _jiffies_total()
    mine0, child0 = _jiffies_of("self"), _jiffies_of(child) if child else 0
    load0 = os.getloadavg()[0]
    for k in range(runs):
        first = idle if burst and k % burst == 0 else gap  # the pause before a burst goes to its first call
        if k % 2 == 0:
            a.append(fg_call(first))
            b.append(ort_call(gap))
        else:
            b.append(ort_call(first))
            a.append(fg_call(gap))
    busy1, total1 = _jiffies_total()
    mine1, child1 = _jiffies_of("self"), _jiffies_of(child) if child else 0
    load1 = os.getloadavg()[0]
    hz = os.sysconf("SC_CLK_TCK")
    others = (busy1 - busy0 - (mine1 - mine0) - (child1 - child0)) / max(total1 - total0, 1)
    state = "none"
    if evaluation is not None:
        state = "finished" if evaluation.done() else "running"
    out = {
        "model": Path(path).name, "runs": runs, "gap_s": gap, "pause": pause, "burst": burst, "idle_s": idle,
        "fusegraph_ms": statistics.median(a) * 1e3, "ort_ms": statistics.median(b) * 1e3,
        "ratio": statistics.median(a) / statistics.median(b),
        "ratio_p25": _quantile(a, 0.25) / _quantile(b, 0.25),
        "paired": statistics.median(x / y for x, y in zip(a, b, strict=True)),
        "child": state, "child_cpu_s": (child1 - child0) / hz, "others_cpu": others,
        "load": [load0, load1], "setup_s": setup_s, "ort_setup_s": ort_setup_s,
        "held": gate.pauses if gate is not None else None,
    }
    if evaluation is not None and evaluation.proc is not None and evaluation.proc.poll() is None:
        if gate is not None:
            gate.close()
        os.killpg(evaluation.pid, signal.SIGCONT)
        os.killpg(evaluation.pid, signal.SIGKILL)  # this benchmark's own child: the next model must not share the CPU with it
        evaluation.proc.wait()
        background._RUNNING.discard(evaluation)
    return out


def _light(name: str, root: Path) -> Path:
    """The onnx wheel's light model ``name`` with random weights, written once under ``root``."""
    import onnx

    from fusegraph.onnx.weights import randomize_weights

    stem = name.removeprefix("light:")
    path = root / f"light_{stem}-random0.onnx"
    if not path.exists():
        src = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / f"light_{stem}.onnx"
        model = randomize_weights(onnx.load(str(src)), np.random.default_rng(0))
        onnx.save(model, str(path))
    return path


def new_shapes(path: str, batches: list[int]) -> dict[str, Any]:
    """A model with a dynamic batch dimension (``path``'s first input and outputs made
    symbolic): per batch size, the first call of a fusegraph session (cold cache, shipped
    defaults) against the first call of ONNX Runtime alone at that size, in one process."""
    import onnx
    import onnxruntime as ort

    import fusegraph.onnx as fgo

    model = onnx.load(path)
    inits = {t.name for t in model.graph.initializer}
    first = [v for v in model.graph.input if v.name not in inits][:1]
    for v in [*first, *model.graph.output]:
        v.type.tensor_type.shape.dim[0].dim_param = "N"
    del model.graph.value_info[:]
    data = model.SerializeToString()
    cache = tempfile.mkdtemp(prefix="fg-new-shapes-")
    fg = fgo.InferenceSession(data, providers=[(fgo.PROVIDER, {"cache_dir": cache}), "CPUExecutionProvider"])
    alone = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    i = alone.get_inputs()[0]
    rng = np.random.default_rng(0)
    rows = []
    for n in batches:
        x = {i.name: rng.standard_normal([n, *i.shape[1:]]).astype(np.float32)}
        t = time.perf_counter()
        alone.run(None, x)
        ort_s = time.perf_counter() - t
        t = time.perf_counter()
        fg.run(None, x)
        fg_s = time.perf_counter() - t
        rows.append({"batch": n, "fusegraph_first_ms": fg_s * 1e3, "ort_first_ms": ort_s * 1e3})
    waited = time.perf_counter()
    fg.wait_for_evaluation(timeout=600)  # every shape's evaluation (the next session's verdicts)
    return {"rows": rows, "evaluations_s": time.perf_counter() - waited}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=DEFAULT_MODELS)
    p.add_argument("--runs", type=int, default=30, help="timed calls per side and model")
    p.add_argument("--gap", type=float, default=0.05, help="seconds of pause before each call")
    p.add_argument("--burst", type=int, default=0, help="pairs of calls per burst (0: no bursts)")
    p.add_argument("--idle", type=float, default=1.0, help="seconds of pause before each burst")
    p.add_argument("--no-pause", action="store_true", help="the child is not held while the session runs")
    p.add_argument("--json", default="bench_first_session.json")
    p.add_argument("--new-shapes", metavar="MODEL", help="instead: first calls at new batch sizes of MODEL "
                   "(a light: or corpus name) with its batch dimension made dynamic")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.runs, args.gap, not args.no_pause, args.burst, args.idle)))
        return 0
    import bench_models

    root = bench_models.export_dir(argparse.Namespace(export_dir=None))
    root.mkdir(parents=True, exist_ok=True)
    if args.new_shapes:
        name = args.new_shapes
        path = _light(name, root) if name.startswith("light:") else bench_models.exported(bench_models.BY_NAME[name], root, 0)[0]
        got = new_shapes(str(path), [int(b) for b in args.batches.split(",")])
        for r in got["rows"]:
            print(f"{name} batch {r['batch']}: first call fusegraph {r['fusegraph_first_ms']:.1f} ms, "
                  f"ONNX Runtime alone {r['ort_first_ms']:.1f} ms")
        print(f"then waited {got['evaluations_s']:.1f} s for the background evaluations")
        return 0
    rows = []
    print(f"{'model':24} {'fusegraph ms':>12} {'ORT ms':>9} {'ratio':>7} {'p25':>6} {'paired':>6} {'child':>9} "
          f"{'child cpu s':>11} {'others':>7} {'load':>10}")
    for name in args.models.split(","):
        try:
            path = _light(name, root) if name.startswith("light:") else bench_models.exported(
                bench_models.BY_NAME[name], root, 0)[0]
        except Exception as exc:
            print(f"{name:24} skipped: export failed: {exc}")
            continue
        cmd = [sys.executable, __file__, "--one", str(path), "--runs", str(args.runs), "--gap", str(args.gap),
               "--burst", str(args.burst), "--idle", str(args.idle)]
        if args.no_pause:
            cmd.append("--no-pause")
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            print(f"{name:24} failed: {done.stderr.strip().splitlines()[-1:]}")
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["model"] = name
        rows.append(row)
        print(f"{name:24} {row['fusegraph_ms']:12.2f} {row['ort_ms']:9.2f} {row['ratio']:7.3f} {row['ratio_p25']:6.3f} "
              f"{row['paired']:6.3f} {row['child']:>9} "
              f"{row['child_cpu_s']:11.1f} {row['others_cpu']:7.0%} {row['load'][0]:4.1f}-{row['load'][1]:4.1f}",
              flush=True)
    if rows:
        geo = math.exp(statistics.fmean(math.log(r["ratio"]) for r in rows))
        worst = max(rows, key=lambda r: r["ratio"])
        print(f"geomean {geo:.3f}x, worst {worst['ratio']:.3f}x ({worst['model']}), "
              f"{sum(r['ratio'] > 1.05 for r in rows)} of {len(rows)} above 1.05x "
              f"({'child held while the session runs' if not args.no_pause else 'child not held'}, gap {args.gap} s"
              + (f", bursts of {args.burst} pairs after {args.idle} s idle" if args.burst else "") + ")")
    Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
