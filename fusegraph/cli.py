"""The `fusegraph` command line."""

from __future__ import annotations

import argparse
import logging
import sys


def _cmd_demo(args: argparse.Namespace) -> int:
    from fusegraph.demo import main

    return main(engine=args.engine, device=args.device)


def _cmd_engines(args: argparse.Namespace) -> int:
    from fusegraph.engines.registry import REGISTRY

    rows = REGISTRY.info()
    width = max(len(r.name) for r in rows)
    for r in rows:
        state = "available" if r.available else f"unavailable: {r.available.reason}"
        print(f"{r.name:{width}s}  {r.version:10s}  {r.origin:10s}  {state}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fusegraph", description="Fused deep-learning graphs, JIT-compiled.")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="build, run and check a fused conv+bias+ReLU graph")
    d.add_argument("--engine", default=None, help="engine name (default: chosen by fusegraph)")
    d.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, hip:N")
    d.set_defaults(fn=_cmd_demo)
    e = sub.add_parser("engines", help="list engines, their versions and availability")
    e.set_defaults(fn=_cmd_engines)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    from fusegraph.errors import FusegraphError

    try:
        return int(args.fn(args))
    except FusegraphError as exc:
        print(f"fusegraph: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
