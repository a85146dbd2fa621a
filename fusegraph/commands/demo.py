"""`fusegraph demo`."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    d = sub.add_parser("demo", help="build, run and check a fused conv+bias+ReLU graph")
    d.add_argument("--engine", default=None, help="engine name (default: chosen by fusegraph)")
    d.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, hip:N")
    d.set_defaults(fn=_run)


def _run(args: argparse.Namespace) -> int:
    from fusegraph.commands._checks import check_device, check_engine, device_problem
    from fusegraph.demo import main

    check_engine("demo", args.engine)
    check_device("demo", args.device)
    problem = device_problem(args.device)
    if problem is not None:
        raise SystemExit(f"fusegraph demo: --device {args.device}: not usable here ({problem})")

    return main(engine=args.engine, device=args.device)
