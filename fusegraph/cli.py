"""The `fusegraph` command line; each subcommand lives in ``fusegraph/commands/<name>.py``
and exposes ``register(subparsers)`` setting ``fn`` on its parser."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# One line per subcommand module, in the order `fusegraph --help` lists them.
COMMANDS = ["demo", "engines", "tune", "cache", "run"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fusegraph", description="Fused deep-learning graphs, JIT-compiled.")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = p.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"fusegraph.commands.{name}").register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
