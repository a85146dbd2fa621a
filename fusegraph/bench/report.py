"""What the driver prints and writes: a table per case, CSV (one row per case and
contender, a fixed set of columns), JSON (everything, with the environment) and a chart.

Speed-ups read as "times as fast as": ``x1.30 vs eager`` means the row takes 1/1.30 of
eager's median time. The fraction of the device's peak is given where the peak is known
(NVIDIA data-center GPUs, dense f16 / bf16 tensor-core FLOP/s and HBM bandwidth).
"""

from __future__ import annotations

import csv
import json
import math
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fusegraph.bench.flags import BASELINES
from fusegraph.bench.runner import CaseResult, Row
from fusegraph.dtypes import DataType

NOISY = 0.25  # interquartile range over median of the rounds above which a row is flagged
FORMAT = "fusegraph.bench"
VERSION = 1
CSV_FIELDS = (
    "case", "family", "device", "dtype", "contender", "kind", "engine", "config", "status", "reason",
    "median_ms", "min_ms", "rounds", "calls_per_round", "spread", "warmup_calls", "first_call_ms", "steady",
    "tflops", "gbps", "peak_fraction", *(f"speedup_vs_{b}" for b in BASELINES), "rel_error", "picked", "command",
)

# Dense tensor-core f16/bf16 TFLOP/s and memory GB/s of the data-center parts (vendor sheets).
PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989.4, 4800.0),
    ("H100 PCIe", 756.0, 2000.0),
    ("H100 NVL", 835.0, 3900.0),
    ("H100", 989.4, 3350.0),
    ("A100-SXM4-80GB", 312.0, 2039.0),
    ("A100", 312.0, 1555.0),
    ("L40S", 362.0, 864.0),
)


def peak(device_name: str, dtype: DataType) -> tuple[float | None, float | None]:
    """(TFLOP/s for the dtype or None, GB/s or None) of a known device."""
    for key, tflops, gbps in PEAKS:
        if key in device_name:
            return (tflops if dtype in (DataType.HALF, DataType.BFLOAT16) else None), gbps
    return None, None


def row_metrics(res: CaseResult, r: Row) -> dict[str, Any]:
    """The CSV/JSON fields of one row."""
    c = res.case
    t = r.timing
    out: dict[str, Any] = {
        "case": c.name, "family": c.family, "device": res.device_name, "dtype": str(c.dtype), "contender": r.contender,
        "kind": r.kind, "engine": r.engine, "config": r.config, "status": r.status, "reason": r.reason,
        "rel_error": r.rel_error, "picked": r.picked, "command": c.command,
    }
    if t is None:
        return out
    tflops = c.flops / (t.median_ms * 1e-3) / 1e12 if c.flops and t.median_ms > 0 else None
    gbps = c.bytes / (t.median_ms * 1e-3) / 1e9 if c.bytes and t.median_ms > 0 else None
    pk_flops, pk_bw = peak(res.device_name, c.dtype)
    frac = None
    if tflops is not None and pk_flops:
        frac = tflops / pk_flops
    elif tflops is None and gbps is not None and pk_bw:
        frac = gbps / pk_bw
    out.update({
        "median_ms": t.median_ms, "min_ms": t.min_ms, "rounds": t.rounds, "calls_per_round": t.per_round,
        "spread": t.spread, "warmup_calls": t.warmup_calls, "first_call_ms": t.first_call_ms, "steady": t.steady,
        "tflops": tflops, "gbps": gbps, "peak_fraction": frac,
    })
    for name, ms in res.baseline_ms().items():
        out[f"speedup_vs_{name}"] = ms / t.median_ms if t.median_ms > 0 else None
    return out


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def table(res: CaseResult) -> str:
    c = res.case
    work = []
    if c.flops:
        work.append(f"{c.flops / 1e9:.3g} GFLOP")
    if c.bytes:
        work.append(f"{c.bytes / 1e6:.3g} MB moved")
    load = "" if res.device.startswith("cuda") else f"; {res.load}" if res.load else ""
    lines = [f"{c.name}  ({res.device_name}; {', '.join(work) or 'no work model'}; {res.elapsed_s:.1f}s{load})"]
    bases = list(res.baseline_ms())
    show_peak = any(v is not None for v in peak(res.device_name, c.dtype))
    head = f"  {'contender':<20s} {'engine / config':<34s} {'median ms':>10s} {'min ms':>9s} {'n':>6s} "
    head += f"{'TFLOP/s' if c.flops else 'GB/s':>8s}" + (f" {'%peak':>6s}" if show_peak else "")
    head += "".join(f" {'vs ' + b:>10s}" for b in bases)
    head += "  verify" if any(r.rel_error is not None for r in res.rows) else ""
    lines.append(head)
    for r in res.rows:
        if r.status in ("refused", "failed") and r.timing is None:
            continue
        m = row_metrics(res, r)
        mark = "*" if r.picked else " "
        cfg = r.config if len(r.config) <= 34 else r.config[:31] + "..."
        rate = m.get("tflops") if c.flops else m.get("gbps")
        frac = m.get("peak_fraction")
        line = (f" {mark}{r.contender:<20s} {cfg:<34s} {_fmt(m.get('median_ms'), '10.4f')} {_fmt(m.get('min_ms'), '9.4f')}"
                f" {(r.timing.rounds * r.timing.per_round) if r.timing else 0:>6d} {_fmt(rate, '8.3f')}")
        if show_peak:
            line += f" {_fmt(None if frac is None else 100 * frac, '5.1f')}{'%' if frac is not None else ' '}"
        for b in bases:
            s = m.get(f"speedup_vs_{b}")
            line += f" {('x' + format(s, '.2f')) if s is not None else '-':>10s}"
        if r.rel_error is not None:
            line += f"  {'ok' if r.status != 'mismatch' else 'MISMATCH'} {r.rel_error:.1e}"
        if r.timing is not None and r.timing.spread > NOISY:
            line += f"  noisy (+-{100 * r.timing.spread / 2:.0f}%)"
        lines.append(line)
    for r in res.rows:
        if r.status in ("refused", "failed") and r.timing is None:
            lines.append(f"   {r.status}: {r.contender}: {r.reason}")
    if any(r.timing is not None and r.timing.spread > NOISY for r in res.rows):
        lines.append("   note: noisy: the row's samples spread by more than 25% (interquartile range over median; a "
                     "busy machine); the min column and more rounds (-i N, --budget S) say more")
    for note in res.notes:
        lines.append(f"   note: {note}")
    return "\n".join(lines)


def write_csv(path: str, results: Sequence[CaseResult]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(CSV_FIELDS), extrasaction="ignore")
        w.writeheader()
        for res in results:
            for r in res.rows:
                m = row_metrics(res, r)
                w.writerow({k: ("" if m.get(k) is None else m[k]) for k in CSV_FIELDS})


def environment() -> dict[str, Any]:
    from importlib import metadata

    from fusegraph import __version__

    env: dict[str, Any] = {"fusegraph": __version__, "python": platform.python_version(), "machine": platform.machine()}
    for dist in ("torch", "onnxruntime", "iree-base-runtime", "nvidia-cudnn-frontend"):
        try:
            env[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env[dist] = None
    return env


def to_json(results: Sequence[CaseResult], argv: Sequence[str]) -> dict[str, Any]:
    cases = []
    for res in results:
        c = res.case
        rows = []
        for r in res.rows:
            m = row_metrics(res, r)
            m["samples_ms"] = list(r.timing.samples) if r.timing is not None else []
            rows.append({k: v for k, v in m.items() if k not in ("case", "family", "device", "dtype", "command")})
        cases.append({"name": c.name, "family": c.family, "command": c.command, "device": res.device_name, "load": res.load,
                      "dtype": str(c.dtype), "flops": c.flops, "bytes": c.bytes, "elapsed_s": res.elapsed_s,
                      "notes": res.notes, "failed": res.failed, "rows": rows})
    return {"format": FORMAT, "version": VERSION, "argv": list(argv), "environment": environment(), "cases": cases}


def write_json(path: str, results: Sequence[CaseResult], argv: Sequence[str]) -> None:
    Path(path).write_text(json.dumps(_finite(to_json(results, argv)), indent=1, allow_nan=False, default=str),
                          encoding="utf-8")


def _finite(v: Any) -> Any:
    """Strict JSON: a non-finite number (an infinite error of a NaN output) as its name."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def ratios_for_plot(results: Sequence[CaseResult]) -> list[tuple[str, float, str]]:
    """(case, fastest baseline's median / fusegraph's pick's median, baseline name) per case
    that has both: above 1, fusegraph's pick is faster."""
    out = []
    for res in results:
        base = res.baseline_ms()
        pick = next((r for r in res.rows if r.picked and r.timing is not None), None)
        if pick is None:
            pick = min((r for r in res.rows if r.kind == "fusegraph" and r.timing is not None),
                       key=lambda r: r.timing.median_ms if r.timing else math.inf, default=None)
        if base and pick is not None and pick.timing is not None:
            name = min(base, key=lambda k: base[k])
            out.append((res.case.name, base[name] / pick.timing.median_ms, name))
    return out


def write_plot(path: str, results: Sequence[CaseResult]) -> None:
    """Raises RuntimeError (with what to do) where matplotlib is missing or nothing compares."""
    rows = ratios_for_plot(results)
    if not rows:
        raise RuntimeError("nothing to plot: no case has both a fusegraph time and a baseline's (--compare ...)")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib (pip install 'fusegraph[bench]')") from None
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1.4))
    ys = list(range(len(rows)))
    ax.barh(ys, [r[1] for r in rows], color=["tab:green" if r[1] >= 1 else "tab:red" for r in rows])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(ys, [f"{r[0][:48]} (vs {r[2]})" for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("fastest baseline's median / fusegraph's pick's median  (>1: fusegraph faster)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
