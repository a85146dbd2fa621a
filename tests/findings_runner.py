"""Runs recorded fuzz findings (tests/data/gpu_fuzz_findings.json) one after another in this
process, printing a line per record as it starts and as it ends, so that the caller
(tests/test_gpu_fuzz_findings.py) learns which record took a process down and carries on
from the next one in a fresh process::

    python tests/findings_runner.py FINDINGS.json FIRST_INDEX DEVICE
"""

from __future__ import annotations

import json
import sys

import numpy as np

import fusegraph as fg
from fusegraph.reference.inputs import random_inputs
from fusegraph.select.autotune import Answers, tolerance


def run_one(rec: dict[str, object], device: str) -> tuple[str, str]:
    g = fg.Graph.from_json(json.dumps(rec["graph"])).validate()
    inputs = random_inputs(g, np.random.default_rng(int(rec["seed"])))  # type: ignore[call-overload]
    answers = Answers(g, inputs, cast=True)
    try:
        got = g.execute(dict(inputs), engine=str(rec["engine"]), handle=device)
    except fg.UnsupportedError as exc:
        return "refused", str(exc)
    except fg.FusegraphError as exc:
        return "raised typed", f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        return "raised untyped", f"{type(exc).__name__}: {exc}"
    tol = tolerance(g)
    err, why = answers.error(got, tol)
    return ("ok", f"rel err {err:.3g}") if err <= tol else ("wrong numbers", f"rel err {err:.3g} > tol {tol:g} {why}")


def main() -> None:
    path, first, device = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with open(path) as fh:
        records = json.load(fh)
    for i in range(first, len(records)):
        print(f"START {i}", flush=True)
        status, detail = run_one(records[i], device)
        print("DONE " + json.dumps({"index": i, "status": status, "detail": detail[:400]}), flush=True)


if __name__ == "__main__":
    main()
