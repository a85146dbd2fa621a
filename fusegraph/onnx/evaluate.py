"""The background evaluation's child (``python -m fusegraph.onnx.evaluate``): opens the model
with the floor inline, as a session of ``floor_mode=inline`` would (at ``--shapes`` for a
model with dynamic dimensions), so that every unit's and the whole model's verdicts land in
the cache, then records the verdict the parent and later sessions read under the model's
identity (``background.Source``). Its parent holds it while the caller's session runs
(``background.Gate``); ``--gate`` names the counter of those holds, which its timing loops
read (``floor.PAUSES``). See ``background.py``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import mmap
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fusegraph.onnx import background, floor
from fusegraph.onnx.options import PROVIDER, ProviderOptions
from fusegraph.onnx.session import InferenceSession, session_handle
from fusegraph.select.device_id import device_id

log = logging.getLogger("fusegraph.onnx")

CHILD_LIMIT_S = 1800  # the child's time ceiling (its compiles are bounded on their own too)
CHILD_NICE = 10  # the caller's inference comes first on a shared machine


def evaluate(model: str, opts: ProviderOptions, shapes: Mapping[str, Sequence[int]] | None = None) -> floor.Verdict:
    """The whole model's verdict: keep (fusegraph's plan runs part of it), another
    whole-model runner (``runner``), or ONNX Runtime; with every runner candidate's line.
    At ``shapes`` (a model with dynamic dimensions): fusegraph's plan at those shapes or
    ONNX Runtime (whole-model runners are measured for static models only)."""
    sess = InferenceSession(model, providers=[(PROVIDER, opts.as_strings()), "CPUExecutionProvider"])
    if shapes is not None:
        sess._plan_for({k: tuple(int(d) for d in v) for k, v in shapes.items()})
    runners = sess._runners
    if runners is not None and runners.runner and sess._direct is not None:  # another whole-model runner won
        return dataclasses.replace(runners, source="measured")
    plan = sess._last
    if plan is None:
        return floor.Verdict(False, source="measured", why="the model's input shapes are dynamic")
    whole = plan.floor_whole
    fg_ms = whole.fusegraph_ms if whole is not None else None
    ort_ms = whole.ort_ms if whole is not None else None
    lines = runners.candidates if runners is not None else ()
    if plan.whole_on_ort:
        why = whole.why if whole is not None and whole.why else "no fusegraph subgraph was kept"
        return floor.Verdict(False, fg_ms, ort_ms, "measured", why, candidates=lines)
    return floor.Verdict(True, fg_ms, ort_ms, "measured", plan.report().summary(), candidates=lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fusegraph.onnx.evaluate")
    p.add_argument("--model", required=True)
    p.add_argument("--options", required=True, help="the provider options, JSON")
    p.add_argument("--content", required=True, help="the model's identity (background.Source.content)")
    p.add_argument("--lock", required=True, help="removed when the verdict is recorded")
    p.add_argument("--remove-model", action="store_true", help="the model file is the parent's copy of its bytes")
    p.add_argument("--shapes", help="the input shapes to evaluate at, JSON (a model with dynamic dimensions)")
    p.add_argument("--gate", help="the counter of the parent's holds (background.Gate)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    with contextlib.suppress(OSError):
        os.nice(CHILD_NICE)
    opts = ProviderOptions.parse(json.loads(args.options))
    cache = floor.cache_for(opts, device_id(session_handle(opts)))
    counter = _count_holds(args.gate) if args.gate else None

    def out_of_time(signum: int, frame: Any) -> None:
        raise TimeoutError(f"the background evaluation ran past its {CHILD_LIMIT_S} s ceiling")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(CHILD_LIMIT_S)
    t0 = time.perf_counter()
    try:
        verdict = evaluate(args.model, opts, json.loads(args.shapes) if args.shapes else None)
    except BaseException as exc:  # any failure is a verdict for ONNX Runtime
        log.exception("background evaluation failed")
        verdict = floor.Verdict(False, source="measured",
                                why=f"the background evaluation failed: {type(exc).__name__}: {str(exc)[:300]}")
    finally:
        signal.alarm(0)
    held = floor.PAUSES() if counter is not None else 0
    took = f"evaluated in the background in {time.perf_counter() - t0:.1f} s" + (
        f" (held {held} times while the caller's session ran)" if held else "")
    why = "; ".join(p for p in (verdict.why, took) if p)
    cache.record(args.content, dataclasses.replace(verdict, source="measured", why=why))
    cache.flush()
    log.info("verdict: %s", verdict.describe())
    if args.remove_model:
        Path(args.model).unlink(missing_ok=True)
    if counter is not None:
        counter.close()
        Path(args.gate).unlink(missing_ok=True)
    Path(args.lock).unlink(missing_ok=True)
    return 0


def _count_holds(path: str) -> mmap.mmap | None:
    """The gate file mapped, its count read by the floor's timing loops (``floor.PAUSES``)."""
    try:
        with open(path, "rb") as fh:
            mapped = mmap.mmap(fh.fileno(), background.COUNTER.size, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        log.info("no gate counter (%s): timed calls the parent held are not told apart", exc)
        return None
    floor.PAUSES.read = lambda: int(background.COUNTER.unpack_from(mapped)[0])
    return mapped


if __name__ == "__main__":
    sys.exit(main())
