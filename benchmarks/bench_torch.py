"""One training step (forward + loss + backward + SGD step) and inference latency under
``torch.compile(backend="fusegraph")`` against PyTorch eager and Inductor, side by side in
one process: every variant warmed up and compiled first (compile time reported), then timed
interleaved by fusegraph's one timing routine (select/timing.py: warm-up to a steady state,
rotating rounds, medians). bf16 autocast on a GPU, float32 on the CPU.

    python benchmarks/bench_torch.py                       # GPU: the default models
    python benchmarks/bench_torch.py --models convnet --json out.json
    python benchmarks/bench_torch.py --quick               # CPU, tiny: agreement only (CI)

Models are defined here (no downloads): ``convnet`` (conv + bias + ReLU blocks,
channels-last), ``gpt`` (a GPT-2-style pre-norm decoder: causal attention, GELU MLP).
Variants: ``eager``, ``inductor`` (torch.compile's default), ``fusegraph`` (floor on: each
region measured against Inductor), ``fusegraph-claim`` (floor off: every region claimed).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fusegraph.select.timing import time_candidates
from fusegraph.torch.compile_backend import fusegraph_backend
from fusegraph.torch.explainer import explain


class ConvNet(nn.Module):
    def __init__(self, width: int = 64, blocks: int = 4, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1, stride=2)
        self.blocks = nn.ModuleList(nn.Conv2d(width, width, 3, padding=1) for _ in range(blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        for conv in self.blocks:
            x = F.relu(conv(x)) + x
        return self.head(x.mean((2, 3)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, d: int = 768, heads: int = 12, layers: int = 4, vocab: int = 8192) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def _case(name: str, device: torch.device, quick: bool) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if name == "convnet":
        model: nn.Module = ConvNet(16 if quick else 64, 2 if quick else 4, 10 if quick else 1000)
        b, hw, classes = (2, 16, 10) if quick else (64, 112, 1000)
        x = torch.randn(b, 3, hw, hw, generator=g).to(device, memory_format=torch.channels_last)
        y = torch.randint(0, classes, (b,), generator=g).to(device)
        model = model.to(device, memory_format=torch.channels_last)
        return model, x, y
    if name == "gpt":
        d, heads, layers, vocab, b, s = (32, 4, 1, 64, 2, 16) if quick else (768, 12, 4, 8192, 8, 1024)
        model = GPT(d, heads, layers, vocab).to(device)
        x = torch.randint(0, vocab, (b, s), generator=g).to(device)
        y = torch.randint(0, vocab, (b * s,), generator=g).to(device)
        return model, x, y
    raise SystemExit(f"unknown model {name!r} (convnet, gpt)")


def _compiler(variant: str) -> Callable[[nn.Module], Any]:
    if variant == "eager":
        return lambda m: m
    if variant == "inductor":
        return lambda m: torch.compile(m)
    options = {"floor": variant == "fusegraph"}
    return lambda m: torch.compile(m, backend=partial(fusegraph_backend, options=options))


def _step(model: nn.Module, fn: Any, opt: Any, x: torch.Tensor, y: torch.Tensor, amp: Any) -> Callable[[], float]:
    def step() -> Any:
        opt.zero_grad(set_to_none=True)
        with amp():
            out = fn(x)
            loss = F.cross_entropy(out.flatten(0, -2).float(), y)
        loss.backward()
        opt.step()
        return loss

    return step


def bench(name: str, variants: list[str], device: torch.device, quick: bool, budget_s: float) -> dict[str, Any]:
    base, x, y = _case(name, device, quick)
    gpu = device.type == "cuda"
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if gpu else (lambda: torch.autocast("cpu", enabled=False))
    sync = (lambda: torch.cuda.synchronize(device)) if gpu else None
    steps: dict[str, Callable[[], Any]] = {}
    infer: dict[str, Callable[[], Any]] = {}
    result: dict[str, Any] = {"model": name, "device": str(device), "variants": {}}
    first_loss: dict[str, float] = {}
    for v in variants:
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        fn = _compiler(v)(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        step = _step(model, fn, opt, x, y, amp)
        t0 = time.perf_counter()
        first_loss[v] = float(step().detach())
        if sync:
            sync()
        compile_s = time.perf_counter() - t0
        steps[v] = step

        def run_infer(fn: Any = fn) -> Any:
            with torch.no_grad(), amp():
                return fn(x)

        infer[v] = run_infer
        result["variants"][v] = {"first_step_s": compile_s, "first_loss": first_loss[v]}
    ref = first_loss.get("eager", next(iter(first_loss.values())))
    tol = 3e-2 if gpu else 1e-4
    for v, loss in first_loss.items():
        agree = abs(loss - ref) <= tol * max(abs(ref), 1e-6)
        result["variants"][v]["agrees"] = agree
        if not agree:
            print(f"{name}: {v}'s first loss {loss:.6f} vs eager {ref:.6f} (tolerance {tol})", file=sys.stderr)
    if quick:
        return result
    train = time_candidates(steps, sync=sync, budget_s=budget_s)
    for v, t in train.items():
        result["variants"][v]["train_ms"] = t.median_ms
    with torch.no_grad():
        inf = time_candidates(infer, sync=sync, budget_s=budget_s / 2)
    for v, t in inf.items():
        result["variants"][v]["infer_ms"] = t.median_ms
    if "fusegraph" in variants or "fusegraph-claim" in variants:
        report = explain(copy.deepcopy(base), x, options={"floor": False})
        result["coverage"] = report.coverage
        result["patterns"] = dict(report.patterns())
    return result


def host_cost(device: torch.device) -> dict[str, float]:
    """Microseconds per call of each autograd function at a tiny shape (the kernels take
    next to nothing: what is left is the host's cost), forward and forward + backward,
    beside the torch.nn.functional calls they replace."""
    from fusegraph.torch import functions as fgf

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, requires_grad=True)

    x4, w4, b4 = t(1, 4, 4, 4), t(4, 4, 3, 3), t(4)
    x2, w2, b2 = t(4, 16), t(16, 16), t(16)
    q, k, v = t(1, 2, 8, 8), t(1, 2, 8, 8), t(1, 2, 8, 8)
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "conv_bias_act": lambda: fgf.conv_bias_act(x4, w4, b4, 1, 1, 1, "relu"),
        "torch conv+relu": lambda: F.relu(F.conv2d(x4, w4, b4, 1, 1)),
        "linear_bias_act": lambda: fgf.linear_bias_act(x2, w2, b2, "gelu"),
        "torch linear+gelu": lambda: F.gelu(F.linear(x2, w2, b2)),
        "layer_norm": lambda: fgf.layer_norm(x2, [16], b2, b2),
        "torch layer_norm": lambda: F.layer_norm(x2, [16], b2, b2),
        "attention": lambda: fgf.scaled_dot_product_attention(q, k, v, is_causal=True),
        "torch attention": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    cands: dict[str, Callable[[], object]] = {}
    for name, fn in calls.items():
        cands[f"{name} fwd"] = lambda fn=fn: fn().detach()
        cands[f"{name} fwd+bwd"] = lambda fn=fn: fn().sum().backward()
    return {k: v.median_ms * 1e3 for k, v in time_candidates(cands, sync=sync, budget_s=10).items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="convnet,gpt")
    ap.add_argument("--variants", default="eager,inductor,fusegraph,fusegraph-claim")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget", type=float, default=20.0, help="seconds of timing per model and mode")
    ap.add_argument("--quick", action="store_true", help="tiny models, agreement only (CI)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--host", action="store_true", help="the autograd functions' host cost per call, then exit")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.host:
        for name, us in host_cost(device).items():
            print(f"{name:<28} {us:9.1f} us")
        return 0
    variants = args.variants.split(",")
    results = [bench(m, variants, device, args.quick, args.budget) for m in args.models.split(",")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}")
    for r in results:
        print(f"\n{r['model']}" + (f"  (coverage {r['coverage']:.1%}: {r.get('patterns')})" if "coverage" in r else ""))
        ind = r["variants"].get("inductor", {})
        for v, d in r["variants"].items():
            line = f"  {v:<16} first step {d['first_step_s']:7.1f} s  loss {d['first_loss']:.5f} {'ok' if d['agrees'] else 'DISAGREES'}"
            for mode in ("train_ms", "infer_ms"):
                if mode in d:
                    vs = ind.get(mode)
                    line += f"  {mode[:-3]} {d[mode]:8.3f} ms" + (f" ({vs / d[mode]:.2f}x inductor)" if vs else "")
            print(line)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": name, "torch": torch.__version__, "results": results}, f, indent=1)
    ok = all(d["agrees"] for r in results for d in r["variants"].values())
    geo = [r["variants"][v]["train_ms"] for r in results for v in ("inductor", "fusegraph") if "train_ms" in r["variants"].get(v, {})]
    if len(geo) >= 2 and len(geo) % 2 == 0:
        ratios = [geo[i] / geo[i + 1] for i in range(0, len(geo), 2)]
        print(f"\ntraining step, fusegraph vs inductor geomean: {math.prod(ratios) ** (1 / len(ratios)):.3f}x")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
