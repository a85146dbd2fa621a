"""cuDNN's SDPA plans by heuristic mode (A, the default, and B) against PyTorch eager's
scaled_dot_product_attention, across sequence lengths, head dims and causal/full, one shape
at a time: the evidence behind the ``gpu.attention_long`` rule (select/heuristics.py).

    python benchmarks/bench_cudnn_sdpa_modes.py      # needs a CUDA GPU and cuDNN's frontend

f16 I/O, f32 compute; CUDA-event medians of 5 rounds x 20 calls, the three contenders
interleaved (each round starts at the next one). Prints one JSON line per shape: medians in
ms, B/A, and the cuDNN engine names the two modes chose.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import fusegraph as fg
from fusegraph import DataType as DT
from fusegraph.engines.base import EngineConfig
from fusegraph.engines.registry import REGISTRY

SHAPES = [(b, 16, s, d, causal)
          for b, s in ((32, 512), (16, 1024), (8, 2048), (2, 4096), (1, 8192))
          for d in (64, 128) for causal in (True, False)]


def medians(fns: dict[str, Callable[[], Any]], rounds: int = 5, per_round: int = 20) -> dict[str, float]:
    for f in fns.values():  # warm-up: cuDNN's first launch, eager's kernel selection
        f()
        f()
    torch.cuda.synchronize()
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(per_round)]
            for e0, e1 in evs:
                e0.record()
                fns[name]()
                e1.record()
            torch.cuda.synchronize()
            times[name] += [e0.elapsed_time(e1) for e0, e1 in evs]
    return {k: round(statistics.median(v), 4) for k, v in times.items()}


def one_shape(b: int, h: int, s: int, d: int, causal: bool) -> dict[str, Any]:
    engine, gpu = REGISTRY.get("cudnn"), fg.Handle("cuda:0")
    g = fg.Graph(f"sdpa_b{b}h{h}s{s}d{d}_{'causal' if causal else 'full'}", io_data_type=DT.HALF,
                 intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    q, k, v = (g.tensor(n, [b, h, s, d]) for n in "qkv")
    g.sdpa(q, k, v, causal=causal).set_output(True)
    g.validate()
    dev = {n: torch.randn(b, h, s, d, device="cuda", dtype=torch.float16) for n in "qkv"}
    row: dict[str, Any] = {"shape": [b, h, s, d, causal], "flops": 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)}
    try:
        plan_a = engine.build(g, gpu, EngineConfig("cudnn"))
        plan_b = engine.build(g, gpu, EngineConfig("cudnn", (("heur_mode", "b"),)))
    except Exception as exc:  # a shape cuDNN refuses: say so, go on
        return {**row, "error": f"{type(exc).__name__}: {exc}"[:200]}
    ms = medians({
        "A": lambda: plan_a.execute(dev),
        "B": lambda: plan_b.execute(dev),
        "eager": lambda: F.scaled_dot_product_attention(dev["q"], dev["k"], dev["v"], is_causal=causal),
    })
    return {**row, "ms": ms, "B_over_A": round(ms["B"] / ms["A"], 3),
            "plans": [getattr(plan_a, "plan_name", ""), getattr(plan_b, "plan_name", "")]}


def main() -> int:
    print(json.dumps({"gpu": torch.cuda.get_device_name(0)}))
    for shape in SHAPES:
        print(json.dumps(one_shape(*shape)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
