"""The `fusegraph` command line; each subcommand lives in ``fusegraph/commands/<name>.py``
and exposes ``register(subparsers)`` setting ``fn`` on its parser.

Exit status, the same for every subcommand: 0 done; 2 a command line that cannot be acted
on as written -- a malformed or unknown option, a missing or unreadable or corrupt input
file, an unknown engine, a device that is not there, a graph that does not validate; 1 the
work began and failed -- a compile or execution error, no engine able to run the graph, a
check or verification that found a mismatch. Either ends in one line on stderr; ``-v`` adds
the traceback. A closed pipe (``fusegraph demo | head -1``) ends quietly.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback

# One line per subcommand module, in the order `fusegraph --help` lists them.
COMMANDS = ["demo", "engines", "tune", "cache", "run", "bench"]


def build_parser() -> argparse.ArgumentParser:
    from fusegraph import __version__

    p = argparse.ArgumentParser(prog="fusegraph", description="Fused deep-learning graphs, JIT-compiled.")
    p.add_argument("--version", action="version", version=f"fusegraph {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="more logging (-vv for debug); tracebacks on errors")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines, errors only in the log")
    sub = p.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"fusegraph.commands.{name}").register(sub)
    return p


def _quiet_pipe() -> int:
    """The reader went away (``| head``): stop writing, without a traceback at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logger = logging.getLogger("fusegraph")
    before = logger.level
    if args.quiet:  # also turns the progress lines off (fusegraph/runtime/progress.py)
        logger.setLevel(logging.ERROR)
    try:
        return _dispatch(args)
    finally:  # main() called in-process (tests, embedding programs) leaves the level as it was
        logger.setLevel(before)


def _dispatch(args: argparse.Namespace) -> int:
    from fusegraph.errors import FusegraphError

    try:
        status = int(args.fn(args))
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        return _quiet_pipe()
    except KeyboardInterrupt:
        print("fusegraph: interrupted", file=sys.stderr)
        return 130
    except SystemExit as exc:  # a subcommand's one-line refusal of its arguments
        if not isinstance(exc.code, str):
            raise
        print(exc.code, file=sys.stderr)
        return USAGE
    except (FusegraphError, OSError, ValueError, KeyError) as exc:
        if args.verbose:
            traceback.print_exc()
        kind = "" if isinstance(exc, FusegraphError) else f"{type(exc).__name__}: "
        text = str(exc)
        prefix = f"fusegraph {args.command}: "
        print(text if text.startswith(prefix) else f"{prefix}error: {kind}{text}", file=sys.stderr)
        return exit_status(exc)


USAGE = 2  # argparse's own status for a malformed command line
FAILED = 1


def exit_status(exc: BaseException) -> int:
    """2 for what the user asked being unusable as written, 1 for work that failed."""
    from fusegraph.errors import CompileError, ExecutionError, UnsupportedError

    return FAILED if isinstance(exc, (CompileError, ExecutionError, UnsupportedError)) else USAGE


if __name__ == "__main__":
    sys.exit(main())
