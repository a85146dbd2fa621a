"""The long fuzz run, many processes at once: ``python tests/fuzz_farm.py --help``.

Each worker is ``pytest -m fuzz tests/test_fuzz_graphs.py -k "long and ENGINE"`` with its own
hypothesis seed, recording every graph (FUSEGRAPH_FUZZ_KEEP_GOING) instead of stopping at the
first finding. A worker killed by a signal (an engine that took the process down) leaves the
graph it was running, which goes to ``crashes.jsonl`` with the signal; the worker is started
again with a new seed until the time is up. At the end the counts per engine are printed
(and written to ``summary.json``): graphs drawn, refused, run, correct, wrong numbers,
raised (typed fusegraph errors and untyped ones apart), CUDA errors (a worker whose context
one poisoned exits and is started afresh) and processes killed.

Example (the GPU machine, 14 workers for 8 minutes)::

    python tests/fuzz_farm.py --device cuda:0 --workers cudnn=6,triton=4,torch=4 --minutes 8 --out fuzz-out
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass
class Worker:
    engine: str
    index: int
    generation: int
    seed: int
    proc: subprocess.Popen[bytes]
    keep: Path


def start(engine: str, index: int, generation: int, args: argparse.Namespace, out: Path) -> Worker:
    seed = args.seed + 1000 * index + 100_000 * generation + hash(engine) % 997
    keep = out / f"{engine}-{index}-{generation}.jsonl"
    env = {**os.environ, "FUSEGRAPH_FUZZ_KEEP_GOING": str(keep), "FUSEGRAPH_FUZZ_EXAMPLES": str(args.examples),
           "PYTHONFAULTHANDLER": "1"}
    if args.device:
        env["FUSEGRAPH_FUZZ_DEVICE"] = args.device
    cmd = [sys.executable, "-m", "pytest", "-m", "fuzz", str(HERE / "test_fuzz_graphs.py"), "-k", f"long and {engine}",
           f"--hypothesis-seed={seed}", "-q", "-s", "-p", "no:cacheprovider"]
    log = open(out / f"{engine}-{index}-{generation}.out", "wb")  # noqa: SIM115 -- the worker's, closed by the OS
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=HERE.parent)
    return Worker(engine, index, generation, seed, proc, keep)


def summarize(out: Path, deaths: Counter[str]) -> dict[str, dict[str, int]]:
    table: dict[str, Counter[str]] = {}
    for log in sorted(out.glob("*.jsonl.log")):
        for line in log.read_text().splitlines():
            parts = line.split(" ")
            if len(parts) < 2:
                continue
            c = table.setdefault(parts[0], Counter())
            c["drawn"] += 1
            c[parts[1]] += 1
    for rec_file in sorted(out.glob("*.jsonl")):
        for line in rec_file.read_text().splitlines():
            rec = json.loads(line)
            c = table.setdefault(rec.get("engine", "?"), Counter())
            detail = str(rec.get("detail", ""))
            if "invalid_graph" in rec:
                c["invalid graphs"] += 1
            elif "CUDA error" in detail:
                c["CUDA errors"] += 1
            elif detail.startswith("raised untyped"):
                c["raised untyped"] += 1
            elif detail.startswith("raised"):
                c["raised typed"] += 1
            else:
                c["wrong numbers"] += 1
    result = {}
    for engine, c in sorted(table.items()):
        ran = c["ok"] + c["mismatch"]
        result[engine] = {"drawn": c["drawn"], "refused": c["unsupported"], "ran": ran, "correct": c["ok"],
                          "wrong numbers": c["wrong numbers"], "raised typed": c["raised typed"],
                          "raised untyped": c["raised untyped"], "CUDA errors": c["CUDA errors"],
                          "invalid graphs": c["invalid graphs"],
                          "processes killed": deaths[engine]}
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda:0 fuzzes the GPU engines there (default: the CPU engines)")
    ap.add_argument("--workers", default="torch=2", help="ENGINE=N,... processes per engine")
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--examples", type=int, default=1_000_000, help="graphs per worker (the time usually ends it first)")
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    ap.add_argument("--out", default="fuzz-out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = [(e, int(n)) for e, n in (w.split("=") for w in args.workers.split(","))]
    workers = [start(e, i, 0, args, out) for e, n in plan for i in range(n)]
    deaths: Counter[str] = Counter()
    deadline = time.monotonic() + 60 * args.minutes
    while time.monotonic() < deadline:
        time.sleep(2)
        for k, w in enumerate(workers):
            rc = w.proc.poll()
            if rc is None:
                continue
            if rc < 0:  # killed by a signal: the graph it was running is a finding
                deaths[w.engine] += 1
                current = Path(str(w.keep) + ".current.json")
                rec = json.loads(current.read_text()) if current.exists() else {"engine": w.engine}
                rec.update(signal=signal.Signals(-rc).name, worker=f"{w.engine}-{w.index}-{w.generation}")
                with open(out / "crashes.jsonl", "a") as fh:
                    fh.write(json.dumps(rec) + "\n")
            workers[k] = start(w.engine, w.index, w.generation + 1, args, out)
    for w in workers:
        w.proc.send_signal(signal.SIGTERM)
    for w in workers:
        try:
            w.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            w.proc.kill()
    result = summarize(out, deaths)
    (out / "summary.json").write_text(json.dumps(result, indent=1))
    cols = ["drawn", "refused", "ran", "correct", "wrong numbers", "raised typed", "raised untyped", "CUDA errors",
            "processes killed"]
    print("| engine | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for engine, row in result.items():
        print(f"| {engine} | " + " | ".join(str(row[c]) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
