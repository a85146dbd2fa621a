"""`fusegraph cache info|list|clear|limit`: the IREE engine's compiled-module cache on disk."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("cache", help="inspect or clear the compiled-module cache")
    csub = p.add_subparsers(dest="cache_command", required=True)
    info = csub.add_parser("info", help="where the cache is, how many entries and bytes")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(fn=_info)
    lst = csub.add_parser("list", help="one line per entry: key, graph, target, dispatches, size, age")
    lst.add_argument("--verify", action="store_true", help="also check every entry's checksums")
    lst.add_argument("--json", action="store_true", help="print the manifests as JSON")
    lst.set_defaults(fn=_list)
    clr = csub.add_parser("clear", help="remove every entry (and kept compile-failure reproducers)")
    clr.add_argument("--keep-failures", action="store_true", help="keep <cache>/failures/")
    clr.set_defaults(fn=_clear)
    lim = csub.add_parser(
        "limit", help="show or set the size limit (least recently used entries are evicted)"
    )
    lim.add_argument("size", nargs="?", help="e.g. 500M, 2G, 100000 (bytes) or 'default'")
    lim.set_defaults(fn=_limit)


def _cache() -> Any:
    from fusegraph.engines.iree.cache import ModuleCache

    return ModuleCache()


def _info(args: argparse.Namespace) -> int:
    info = _cache().info()
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    state = "enabled" if info["enabled"] else "disabled (FUSEGRAPH_CACHE=0)"
    print(f"cache directory : {info['root']} ({state})")
    print(f"entries         : {info['entries']} ({info['bytes'] / 1e6:.2f} MB)")
    print(f"size limit      : {info['max_bytes'] / 1e6:.2f} MB (least recently used evicted)")
    print(f"kept failures   : {info['failures']} (under {info['root']}/failures)")
    return 0


def _list(args: argparse.Namespace) -> int:
    cache = _cache()
    entries = cache.list_entries()
    if args.json:
        print(json.dumps(entries, indent=1, default=str))
        return 0
    if not entries:
        print(f"no entries in {cache.entries_root}")
        return 0
    now = time.time()
    print(f"{'key':14s} {'graph':24s} {'target':12s} {'disp':>4s} {'KB':>8s} {'age':>8s}  status")
    bad = 0
    for e in entries:
        meta = e.get("meta", {})
        status = "corrupt manifest" if e.get("corrupt") else "ok"
        if args.verify and status == "ok":
            why = cache.verify(e["key"])
            status = why or "verified"
        bad += status not in ("ok", "verified")
        disp = meta.get("statistics", {}).get("dispatch_count", "?")
        age = _age(now - float(e.get("created", now)))
        print(
            f"{str(e.get('key', '?'))[:12]:14s} {str(meta.get('graph_name', '?'))[:24]:24s} "
            f"{meta.get('target', '?')!s:12s} {disp!s:>4s} {int(e.get('size', 0)) / 1e3:8.1f} {age:>8s}  {status}"
        )
    return 1 if bad else 0


def _clear(args: argparse.Namespace) -> int:
    cache = _cache()
    n = cache.clear(failures=not args.keep_failures)
    print(f"removed {n} entr{'y' if n == 1 else 'ies'} from {cache.entries_root}")
    return 0


_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def parse_size(text: str) -> int:
    """'500M' -> bytes (binary units K, M, G, T; an optional trailing B or iB)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in _UNITS else (t, "")
    try:
        value = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 500M, 2G, 100000)") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a size limit must be a finite number >= 0, not {text!r}")
    if value * _UNITS[unit] >= 2**63:
        raise argparse.ArgumentTypeError(f"a size limit of {text!r} is beyond any disk (at most 8E bytes)")
    return int(value * _UNITS[unit])


def _limit(args: argparse.Namespace) -> int:
    cache = _cache()
    if args.size is not None:
        try:
            cache.set_limit(None if args.size.strip().lower() == "default" else parse_size(args.size))
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise SystemExit(f"fusegraph cache limit: {exc}") from None
    info = cache.info()
    print(f"size limit {info['max_bytes'] / 1e6:.2f} MB; {info['entries']} entries use {info['bytes'] / 1e6:.2f} MB")
    return 0


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"
