"""`fusegraph run MODEL.onnx`: run an ONNX model through the fusegraph execution provider.

Prints the partition summary (``--report`` for every subgraph and every unclaimed node with
its reason), the error against ONNX Runtime with ``--check``, and the median latency over
``--repeat`` runs after a warm-up; ``--compare ort`` times ONNX Runtime's own CPU session on
the same inputs beside it (select/timing.py: both warmed to a steady state, interleaved,
medians). Inputs are random unless given with ``--input NAME=FILE.npy``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from fusegraph.commands._checks import (
    check_device,
    check_engine,
    device_problem,
    nonnegative_int,
    positive_int,
)


def register(sub: Any) -> None:
    p = sub.add_parser("run", help="run an ONNX model through the fusegraph execution provider")
    p.add_argument("model", help="path of the .onnx model")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                   help="an input from a .npy file (repeatable); others are random")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda:N")
    p.add_argument("--allow-fallback", action="store_true",
                   help="if --device is not usable here, run on the CPU (said once) instead of failing")
    p.add_argument("--engine", default=None, help="engine for claimed subgraphs (default: selection layer)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a FusegraphExecutionProvider option (repeatable), e.g. min_subgraph_size=3")
    p.add_argument("--check", action="store_true", help="compare every output with ONNX Runtime's")
    p.add_argument("--repeat", type=positive_int, default=10, help="timed runs after one warm-up (default 10)")
    p.add_argument("--compare", choices=["ort"], default=None,
                   help="ort: time ONNX Runtime's CPU session on the same inputs, interleaved, and print both")
    p.add_argument("--report", action="store_true", help="print the whole partition report")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the random inputs")
    p.set_defaults(fn=_run)


def _random_inputs(sess: Any, given: dict[str, Any], seed: int) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    feed = dict(given)
    for arg in sess.get_inputs():
        if arg.name in feed:
            continue
        if not arg.type.startswith("tensor("):
            raise SystemExit(f"fusegraph run: input '{arg.name}' is a {arg.type}; pass it with --input")
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in (arg.shape or [])]
        dt = _dtype_of(arg.type)
        if dt.kind == "f":
            feed[arg.name] = rng.standard_normal(shape).astype(dt)
        elif dt.kind == "b":
            feed[arg.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feed[arg.name] = np.zeros(shape, dtype=dt)  # integer inputs are often indices
    return feed


def _dtype_of(type_string: str) -> Any:
    """NumPy dtype of an ONNX Runtime type string such as "tensor(float)"."""
    import numpy as np
    import onnx
    from onnx import helper

    for name, value in onnx.TensorProto.DataType.items():
        if type_string == f"tensor({name.lower()})":
            return np.dtype(helper.tensor_dtype_to_np_dtype(value))
    raise SystemExit(f"fusegraph run: no random data for type {type_string}; pass the input with --input")


def _run(args: argparse.Namespace) -> int:
    import numpy as np
    import onnxruntime as ort

    import fusegraph.onnx as fgo

    if os.path.isdir(args.model):
        raise SystemExit(f"fusegraph run: model {args.model!r}: a directory, not a .onnx file")
    if not os.path.isfile(args.model):
        raise SystemExit(f"fusegraph run: model {args.model!r}: no such file")
    device, device_flag = args.device, "--device"
    for kv in args.option:  # `--option device=cuda:0` asks for a device as much as --device does
        key, sep, value = kv.partition("=")
        if sep and key.strip() == "device":
            if device_flag == "--device" and args.device != "cpu" and value.strip() != args.device:
                raise SystemExit(f"fusegraph run: --device {args.device} and --option {kv} disagree")
            device, device_flag = value.strip(), "--option device"
    check_device("run", device, option=device_flag)
    problem = device_problem(device)
    if problem is not None:
        if not args.allow_fallback:
            raise SystemExit(f"fusegraph run: {device_flag} {device}: not usable here ({problem}); "
                             "pass --allow-fallback to run on the CPU instead")
        print(f"fusegraph run: {device_flag} {device} not usable here; running on the CPU (--allow-fallback)",
              file=sys.stderr)
        device = "cpu"
    check_engine("run", args.engine)
    opts: dict[str, Any] = {}
    if args.engine:
        opts["engine"] = args.engine
    for kv in args.option:
        key, sep, value = kv.partition("=")
        if not sep:
            raise SystemExit(f"fusegraph run: --option wants KEY=VALUE, got {kv!r}")
        if key.strip() == "engine":
            check_engine("run", value.strip(), option="--option engine")
        opts[key.strip()] = value
    opts["device"] = device
    try:
        fgo.ProviderOptions.parse(opts)
    except ValueError as exc:
        raise SystemExit(f"fusegraph run: --option: {exc}") from None
    given = {}
    for kv in args.input:
        name, sep, path = kv.partition("=")
        if not sep:
            raise SystemExit(f"fusegraph run: --input wants NAME=FILE.npy, got {kv!r}")
        try:
            given[name] = np.load(path)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"fusegraph run: --input {kv}: cannot read {path!r} as a .npy file ({exc})") from None
    t0 = time.perf_counter()
    sess = fgo.InferenceSession(args.model, providers=[(fgo.PROVIDER, opts), "CPUExecutionProvider"])
    setup = time.perf_counter() - t0
    feed = _random_inputs(sess, given, args.seed)
    outs = sess.run(None, feed)
    if not sess.wait_for_evaluation(timeout=0):  # floor_mode=background: time the plan that stays
        print("fusegraph run: the model has no floor verdict yet; waiting for its evaluation in the "
              "background (--option floor_mode=inline measures it at session creation)", file=sys.stderr)
        sess.wait_for_evaluation()
        outs = sess.run(None, feed)
    report = sess.partition_report()
    print(report if args.report else f"partition: {report.summary()}")
    print(f"session setup (import, partition, compile; not the background evaluation): {setup:.2f} s")
    times = []
    for _ in range(max(args.repeat, 1)):
        t = time.perf_counter()
        sess.run(None, feed)
        times.append((time.perf_counter() - t) * 1e3)
    print(f"latency: median {statistics.median(times):.3f} ms over {len(times)} runs "
          f"(min {min(times):.3f}, max {max(times):.3f})")
    if args.compare == "ort":
        _compare_ort(args, sess, feed)
    sess.measure_memory = True
    sess.run(None, feed)
    print(f"memory: process peak resident {_peak_rss_mib():.1f} MiB; extra during one warm run "
          f"{sess.last_peak}; intermediates held between subgraphs: {sess.peak_live_bytes / 2**20:.1f} MiB")
    status = 0
    if args.check:
        ref = ort.InferenceSession(args.model, providers=["CPUExecutionProvider"])
        want = ref.run(None, feed)
        for arg, g, w in zip(sess.get_outputs(), outs, want, strict=True):
            g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
            if g64.shape != w64.shape:
                print(f"check {arg.name}: shape {list(g64.shape)} != ONNX Runtime's {list(w64.shape)}")
                status = 1
                continue
            denom = max(float(np.linalg.norm(w64)), 1e-30)
            rel = float(np.linalg.norm(g64 - w64)) / denom
            mx = float(np.abs(g64 - w64).max()) if g64.size else 0.0
            bad = not np.isfinite(rel) or rel > 1e-3 or np.isnan(g64).sum() != np.isnan(w64).sum()
            print(f"check {arg.name}: relative error {rel:.2e}, max abs {mx:.2e} vs ONNX Runtime"
                  + ("  <-- MISMATCH" if bad else ""))
            status |= int(bad)
    return status


def _compare_ort(args: argparse.Namespace, sess: Any, feed: dict[str, Any]) -> None:
    """fusegraph's session and ONNX Runtime's plain CPU session, timed together."""
    import onnxruntime as ort

    from fusegraph.select.timing import ratio, time_candidates

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    plain = ort.InferenceSession(args.model, opts, providers=["CPUExecutionProvider"])
    got = time_candidates(
        {"fusegraph": lambda: sess.run(None, feed), "onnxruntime": lambda: plain.run(None, feed)},
        min_rounds=max(args.repeat, 3), per_round=1,
    )
    fg_t, ort_t = got["fusegraph"], got["onnxruntime"]
    print(f"vs ONNX Runtime (CPU, interleaved, steady state, {fg_t.rounds} rounds): fusegraph {fg_t.median_ms:.3f} ms, "
          f"ONNX Runtime {ort_t.median_ms:.3f} ms: fusegraph takes x{ratio(fg_t, ort_t):.2f} of ONNX Runtime's time")


def _peak_rss_mib() -> float:
    """The process's peak resident set (weights, compiled code and buffers included)."""
    import resource

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib / 1024 if sys.platform != "darwin" else kib / 2**20
