"""`fusegraph tune show | clear | path`: the tuning database autotuning writes."""

from __future__ import annotations

import argparse
import datetime
from typing import Any


def register(sub: Any) -> None:
    t = sub.add_parser("tune", help="show or clear autotuning results (the tuning database)")
    tsub = t.add_subparsers(dest="tune_command", required=True)
    show = tsub.add_parser("show", help="chosen configs and every measured alternative")
    show.add_argument("--graph-key", default=None, help="only this graph (a key prefix is enough)")
    show.set_defaults(fn=_show)
    clear = tsub.add_parser("clear", help="remove entries (all, or one graph's)")
    clear.add_argument("--graph-key", default=None, help="only this graph (a key prefix is enough)")
    clear.set_defaults(fn=_clear)
    path = tsub.add_parser("path", help="print the database's file path")
    path.set_defaults(fn=_path)


def _show(args: argparse.Namespace) -> int:
    from fusegraph.engines.registry import active_registry
    from fusegraph.select.autotune import format_entry
    from fusegraph.select.tuning_db import default_db, engine_versions

    db = default_db()
    current = engine_versions(active_registry().available_engines())
    entries = [e for e in db.entries() if args.graph_key is None or e.graph_key.startswith(args.graph_key)]
    if not entries:
        if args.graph_key is not None:  # a key the user named is not there: an error, on stderr
            raise SystemExit(f"fusegraph tune show: --graph-key {args.graph_key!r}: no tuning entry in {db.path}")
        print(f"no tuning entries in {db.path}")
        return 0
    for e in sorted(entries, key=lambda e: (e.graph_name, e.device)):
        when = datetime.datetime.fromtimestamp(e.created).strftime("%Y-%m-%d %H:%M")
        stale = [k for k in set(e.versions) | set(current) if e.versions.get(k) != current.get(k)]
        state = "current" if not stale else "STALE (changed: " + ", ".join(sorted(stale)) + ")"
        print(f"{format_entry(e)}\n   tuned {when}, {state}\n")
    return 0


def _clear(args: argparse.Namespace) -> int:
    from fusegraph.select.tuning_db import default_db

    db = default_db()
    n = db.clear(args.graph_key)
    print(f"removed {n} tuning entr{'y' if n == 1 else 'ies'} from {db.path}")
    return 0


def _path(args: argparse.Namespace) -> int:
    from fusegraph.select.tuning_db import default_db

    print(default_db().path)
    return 0
