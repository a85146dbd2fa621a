"""`fusegraph engines`: every engine, its version, and whether it runs here (and why not)."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    e = sub.add_parser("engines", help="list engines, their versions and availability")
    e.set_defaults(fn=_run)


def _run(args: argparse.Namespace) -> int:
    from fusegraph.engines.registry import REGISTRY

    rows = REGISTRY.info()
    width = max(len(r.name) for r in rows)
    for r in rows:
        state = "available" if r.available else f"unavailable: {r.available.reason}"
        print(f"{r.name:{width}s}  {r.version:10s}  {r.origin:10s}  {state}")
    return 0
