"""Compile time across a user's runs: ``torch.compile(model)`` (Inductor) against
``torch.compile(model, backend="fusegraph")`` for one training step, each run a new process,
as a script run again and again would be. Issue 23 asks for a compile no longer than
Inductor's; what either side takes depends on what its earlier runs left in the caches, so
each side gets cache directories of its own, empty at its first run:

    inductor  run 1 (cold) .. run N          Inductor's caches A
    fusegraph run 1 (cold) .. run N          Inductor's caches B, fusegraph's cache C
    switch    run 1 .. run N                 A (after Inductor's runs), a fresh fusegraph cache D

``switch`` is a user who ran ``torch.compile(model)`` before and now names the backend:
Inductor's own compile of a graph under the backend should read what Inductor saved. A
run's compile time runs from the ``torch.compile`` call to the end of the first training step
(forward, loss, backward, SGD; bf16 autocast on a GPU), the compiles in it; each run then
trains ``--steps`` in all, as a script's loop would (the backend may decide on them). The
ratio column divides each fusegraph run by Inductor's run
of the same number (cold by cold, warm by warm). fusegraph's runs also print their phases
(fusegraph/torch/phases.py).

    python benchmarks/bench_compile_time.py --models gpt2,llama            # CUDA if present
    python benchmarks/bench_compile_time.py --device cpu --size tiny --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
CHAINS = ("inductor", "fusegraph", "switch")


def child(model: str, variant: str, device_name: str, size: str, steps: int) -> dict[str, Any]:
    """One run: the model built, compiled and trained ``steps`` steps; the seconds the first
    took. The rest are the script's loop: where the backend weighs close sides on the loop's
    own steps (loop_trial.py), its verdict is stored only once they decide, so a run of one
    step would leave the next run to check the graph again."""
    import torch

    sys.path.insert(0, str(HERE))
    import torch_models as tm

    from fusegraph.torch.phases import compile_phases

    device = torch.device(device_name)
    case = tm.case(model, size)
    net, inputs, target = case.on(device)
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    def step(fn: Any) -> Any:
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = case.loss(fn(*inputs), target)
        loss.backward()
        opt.step()
        return loss

    with compile_phases() as phases:
        # from the torch.compile call: each backend imports what it needs somewhere in between
        t0 = time.perf_counter()
        fn = torch.compile(net, dynamic=False) if variant == "inductor" else torch.compile(
            net, backend="fusegraph", dynamic=False)
        loss = step(fn)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    for _ in range(steps - 1):
        loss = step(fn)
    return {"seconds": seconds, "phases": phases, "loss": float(loss.detach())}


def run_chain(chain: str, model: str, args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    env = dict(os.environ)
    inductor_cache = root / ("B" if chain == "fusegraph" else "A")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache)
    env["FUSEGRAPH_CACHE_DIR"] = str(root / ("C" if chain == "fusegraph" else "D"))
    variant = "inductor" if chain == "inductor" else "fusegraph"
    out = []
    for i in range(args.runs):
        cmd = [sys.executable, __file__, "--child", model, variant, "--device", args.device, "--size", args.size,
               "--steps", str(args.steps)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{chain} run {i + 1} of {model} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        got = json.loads(lines[-1])
        out.append(got)
        phases = ", ".join(f"{k} {v:.1f}" for k, v in got["phases"].items())
        print(f"  {model} {chain} run {i + 1}: {got['seconds']:.1f} s" + (f" ({phases})" if phases else ""), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2,llama")
    ap.add_argument("--runs", type=int, default=3, help="runs per chain (processes)")
    ap.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    ap.add_argument("--size", choices=("full", "tiny"), default=None, help="default: full on a GPU, tiny on the CPU")
    ap.add_argument("--chains", default=",".join(CHAINS), help=f"of {', '.join(CHAINS)}")
    ap.add_argument("--steps", type=int, default=20,
                    help="training steps per run (the first timed): the loop on which the backend may weigh sides")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.size = args.size or ("full" if args.device.startswith("cuda") else "tiny")
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.device, args.size, args.steps)))
        return 0
    if args.runs < 1 or args.steps < 1:
        ap.error("--runs and --steps must be >= 1")
    chains = [c for c in args.chains.split(",") if c]
    unknown = [c for c in chains if c not in CHAINS]
    if unknown:
        ap.error(f"unknown chains {unknown}: of {', '.join(CHAINS)}")
    if "switch" in chains and "inductor" not in chains:
        ap.error("the switch chain reads the inductor chain's caches: name both")
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}

    def save() -> None:  # after every chain: a run stopped by a time limit keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps({"device": args.device, "size": args.size, "runs": results},
                                                  indent=1))

    for model in filter(None, args.models.split(",")):
        results[model] = {}
        with tempfile.TemporaryDirectory(prefix="fusegraph-compile-time-") as tmp:
            for c in chains:
                results[model][c] = run_chain(c, model, args, Path(tmp))
                save()
    print(f"\ncompile time (s) of the first training step, {args.device}, {args.size} models; "
          "ratio: fusegraph / Inductor, run for run")
    print(f"{'model':<10} {'run':>3} " + " ".join(f"{c:>10}" for c in chains) + "  ratios")
    for model, by_chain in results.items():
        for i in range(args.runs):
            secs = {c: by_chain[c][i]["seconds"] for c in chains}
            ratios = [f"{c} {secs[c] / secs['inductor']:.2f}x" for c in chains if c != "inductor" and "inductor" in secs]
            print(f"{model:<10} {i + 1:>3} " + " ".join(f"{secs[c]:>10.1f}" for c in chains) + "  " + ", ".join(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
