"""torch.compile(backend="fusegraph") under PyTorch's own DistributedDataParallel (or FSDP2's
fully_shard): the same few training steps under eager, Inductor and fusegraph, each wrapped
the same way, losses compared with eager's and step times printed side by side (every
variant in one process group; after each variant's warm-up steps alone, their steps
interleaved; medians). No distributed code of fusegraph's own: DDP's optimizer splits the
graph at bucket boundaries and hands each piece to the backend.

    torchrun --nproc-per-node 2 benchmarks/bench_torch_ddp.py              # 2 GPUs, DDP
    torchrun --nproc-per-node 2 benchmarks/bench_torch_ddp.py --fsdp       # FSDP2
    torchrun --nproc-per-node 2 benchmarks/bench_torch_ddp.py --cpu --quick   # gloo, agreement only
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from torch_models import GPT

from fusegraph.torch.compile_backend import fusegraph_backend


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 20; --quick: 5)")
    ap.add_argument("--compile-blocks", action="store_true",
                    help="compile each transformer block alone (module.compile), as FSDP2 recipes do, instead "
                         "of the wrapped model")
    ap.add_argument("--layers", type=int, default=None, help="the GPT-style model's layers (default 4; --quick: 2)")
    ap.add_argument("--warm-steps", type=int, default=None,
                    help="untimed steps each variant runs alone first, as a training loop would: compiles, and "
                         "fusegraph's choice among a DDP split's pieces on whole steps (default 20; --quick: 0)")
    ap.add_argument("--variants", default="eager,inductor,fusegraph,fusegraph-floor",
                    help="of eager, dynamo-eager (torch.compile's backend 'eager'), inductor, fusegraph (floor "
                         "off: every region claimed), fusegraph-floor (the default backend)")
    ap.add_argument("--accumulate", type=int, default=1,
                    help="micro-batches per optimizer step (gradient accumulation): DDP's no_sync, or FSDP2's "
                         "set_requires_gradient_sync(False), until the last")
    ap.add_argument("--bucket-cap-mb", type=float, default=None,
                    help="DDP's bucket size, where its graph split cuts (default: DDP's own; --quick: 1, the least DDP allows, "
                         "so the quick model is split too)")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo" if args.cpu else "nccl")
    device = torch.device("cpu") if args.cpu else torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    d, heads, layers, vocab, b, s = (64, 4, 2, 2048, 2, 16) if args.quick else (768, 12, 4, 8192, 8, 1024)
    layers = args.layers if args.layers is not None else layers
    torch.manual_seed(0)
    base = GPT(d, heads, layers, vocab).to(device)
    g = torch.Generator().manual_seed(rank + 1)
    warm = args.warm_steps if args.warm_steps is not None else (0 if args.quick else 20)
    steps = warm + (args.steps if args.steps is not None else (5 if args.quick else 20))
    micro = max(1, args.accumulate)
    data = [[(torch.randint(0, vocab, (b, s), generator=g).to(device),
              torch.randint(0, vocab, (b * s,), generator=g).to(device)) for _ in range(micro)] for _ in range(steps)]
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else (
        lambda: torch.autocast("cpu", enabled=False))
    variants = args.variants.split(",")
    runs: dict[str, tuple[Any, torch.optim.Optimizer, Any]] = {}
    torch._dynamo.reset()
    for variant in variants:  # every variant built first, then their steps interleaved
        model = copy.deepcopy(base)
        if args.fsdp:
            from torch.distributed.fsdp import fully_shard

            for blk in model.blocks:
                fully_shard(blk)
            wrapped: Any = fully_shard(model)
        else:
            cap = args.bucket_cap_mb if args.bucket_cap_mb is not None else (1.0 if args.quick else None)
            wrapped = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None,
                **({"bucket_cap_mb": cap} if cap is not None else {}))
        backend: Any = {"inductor": "inductor",
                        "dynamo-eager": "eager",  # Dynamo's graphs (and DDP's split) run as they are
                        "fusegraph": partial(fusegraph_backend, options={"floor": False}),  # every region claimed
                        "fusegraph-floor": fusegraph_backend,  # the default: measured, on each rank
                        }.get(variant)
        if backend is not None and args.compile_blocks:  # each block compiled alone, its wrapper left as it is
            for blk in model.blocks:
                blk.compile(backend=backend)
        elif backend is not None:
            wrapped = torch.compile(wrapped, backend=backend)
        runs[variant] = (wrapped, torch.optim.SGD(model.parameters(), lr=0.05), sync_of(model if args.fsdp else
                                                                                        getattr(wrapped, "_orig_mod", wrapped)))
    results: dict[str, tuple[list[float], list[float]]] = {v: ([], []) for v in variants}
    # first each variant's warm steps alone, as its own loop would run them (a choice fusegraph
    # makes on the loop's steps must not time other variants' steps in between); then the
    # variants take turns, each step in a rotated order (every rank the same order: their
    # collectives must meet). The same data in the same order for every variant.
    order = [[v] for v in variants for _ in range(warm)]
    order += [variants[i % len(variants):] + variants[:i % len(variants)] for i in range(steps - warm)]
    at = dict.fromkeys(variants, 0)
    for turn in order:
        for variant in turn:
            batches = data[at[variant]]
            at[variant] += 1
            wrapped, opt, sync = runs[variant]
            losses, times = results[variant]
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = torch.zeros(())
            for i, (ids, y) in enumerate(batches):  # the gradients reduced across ranks at the last only
                with sync(i == len(batches) - 1), amp():
                    loss = F.cross_entropy(wrapped(ids).flatten(0, -2).float(), y) / len(batches)
                with sync(i == len(batches) - 1):
                    loss.backward()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
            losses.append(float(loss.detach()) * len(batches))  # the last micro-batch's loss
    ok = True
    if rank == 0:
        ref = results.get("eager", next(iter(results.values())))[0]
        tol = 3e-2 if device.type == "cuda" else 1e-4
        for variant, (losses, times) in results.items():
            worst = max(abs(a - r) / max(abs(r), 1e-6) for a, r in zip(losses, ref, strict=True))
            ok = ok and worst <= tol
            timed = times[warm:] if warm else (times[2:] if len(times) > 4 else times)
            print(f"{variant:<10} losses {' '.join(f'{x:.4f}' for x in losses[:5])}  worst rel {worst:.1e}  "
                  f"step {statistics.median(timed):8.2f} ms (median of {len(timed)})")
    dist.destroy_process_group()
    return 0 if ok else 1


def sync_of(module: Any) -> Any:
    """A context factory: ``sync(True)`` lets the wrapper reduce gradients across ranks in the
    backward run under it, ``sync(False)`` holds them back (DDP's ``no_sync``; FSDP2's
    ``set_requires_gradient_sync``), as gradient accumulation does."""
    from contextlib import contextmanager, nullcontext

    @contextmanager
    def sync(on: bool) -> Any:
        if hasattr(module, "set_requires_gradient_sync"):  # FSDP2
            module.set_requires_gradient_sync(on)
            yield
        else:
            with nullcontext() if on else module.no_sync():
                yield

    return sync


if __name__ == "__main__":
    raise SystemExit(main())
