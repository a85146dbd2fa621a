"""`fusegraph cache info|list|clear|limit`: everything fusegraph keeps in its cache directory
(``FUSEGRAPH_CACHE_DIR``, else the user cache directory): the IREE engine's compiled
modules and every other table and store, each with its size.

``clear`` removes only what fusegraph itself writes there (the parts in ``PARTS``), never
anything else found in the directory, and keeps the size-limit setting (``limits.json``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Part:
    """One thing fusegraph writes under the cache directory (a file or a directory)."""

    name: str  # what --only takes
    path: str  # relative to the cache directory; the owner's constant (tests/test_cli_cache.py checks)
    what: str


PARTS: tuple[Part, ...] = (
    Part("iree", "iree", "IREE engine: compiled modules (LRU, size-limited with the other artifacts)"),
    Part("failures", "failures", "IREE engine: kept compile-failure reproducers"),
    Part("tuning", "tuning", "autotune: the tuning database"),
    Part("onnx-choices", "onnx-choices.json", "ONNX provider: autotuned choices per subgraph"),
    Part("onnx-floor", "onnx-floor.json", "ONNX provider: floor verdicts (fusegraph vs ONNX Runtime)"),
    Part("onnx-tier", "onnx-tier", "ONNX provider: torch-mlir tier modules"),
    Part("onnx-background", "onnx-background", "ONNX provider: background evaluations (locks, child logs)"),
    Part("onnx-checked", "onnx-checked.json", "ONNX provider: model files already checked (path, size, mtime)"),
    Part("onnx-specialized", "onnx-specialized",
         "ONNX provider: specialized graphs (shapes inferred, constants folded) per model and input shapes"),
    Part("openvino", "openvino", "ONNX provider: OpenVINO's compiled models (the openvino whole-model runner)"),
    Part("onednn-graph", "onednn-graph-verdicts.json", "torch engine: oneDNN Graph probe verdicts"),
    Part("torch-aoti", "torch-aoti", "torch engine: AOTInductor packages"),
    Part("cudnn", "cudnn", "cuDNN engine: serialized execution plans"),
    Part("registry", "registry", "engine plugin scan"),
    Part("bench-models", "bench-models", "benchmarks/bench_models.py: exported ONNX models"),
    Part("regions", "regions-verdicts.json", "region choice: which side won each region (fusegraph.regions)"),
)
SETTINGS = ("limits.json",)  # kept by clear: the user's size limit


def register(sub: Any) -> None:
    p = sub.add_parser("cache", help="inspect or clear fusegraph's cache directory")
    csub = p.add_subparsers(dest="cache_command", required=True)
    info = csub.add_parser("info", help="where the cache is, and the size of each part")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(fn=_info)
    lst = csub.add_parser(
        "list", help="every part of the cache with its size, then one line per compiled IREE module"
    )
    lst.add_argument("--verify", action="store_true", help="also check every IREE entry's checksums")
    lst.add_argument("--json", action="store_true", help="print the parts and the IREE manifests as JSON")
    lst.set_defaults(fn=_list)
    names = [q.name for q in PARTS]
    clr = csub.add_parser("clear", help="remove everything fusegraph cached (the size limit stays)")
    clr.add_argument("--keep-failures", action="store_true", help="keep <cache>/failures/")
    clr.add_argument("--only", action="append", choices=names, metavar="PART",
                     help=f"clear only this part (repeatable): {', '.join(names)}")
    clr.set_defaults(fn=_clear)
    lim = csub.add_parser(
        "limit", help="show or set the size limit of everything compiled into the cache (IREE modules, cuDNN "
        "plans, AOTInductor packages, tier modules, OpenVINO models; least recently used evicted first)"
    )
    lim.add_argument("size", nargs="?", help="e.g. 500M, 2G, 100000 (bytes) or 'default'")
    lim.add_argument("--yes", action="store_true",
                     help="a limit below what the compiled artifacts use now evicts them at once: say yes to it")
    lim.set_defaults(fn=_limit)


def _root() -> Path:
    from fusegraph.runtime.cache_dir import cache_root

    return cache_root()


def _lock_of(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


def _usage(path: Path) -> tuple[int, int]:
    """(files, bytes) under ``path`` (a file or a directory; 0, 0 when absent)."""
    if path.is_file():
        return 1, path.stat().st_size
    files = size = 0
    if path.is_dir():
        for p in path.rglob("*"):
            try:
                if p.is_file() and not p.name.endswith(".lock"):
                    files += 1
                    size += p.stat().st_size
            except OSError:  # removed meanwhile
                continue
    return files, size


def part_usage(root: Path | None = None) -> list[dict[str, Any]]:
    """One row per part: name, path, what, files, bytes; then anything else found there."""
    root = root or _root()
    rows = []
    for q in PARTS:
        files, size = _usage(root / q.path)
        rows.append({"name": q.name, "path": str(root / q.path), "what": q.what, "files": files, "bytes": size})
    known = {q.path for q in PARTS} | set(SETTINGS)
    known |= {_lock_of(Path(n)).name for n in known}
    if root.is_dir():
        for p in sorted(root.iterdir()):
            if p.name not in known:
                files, size = _usage(p)
                rows.append({"name": "(other)", "path": str(p), "what": "not fusegraph's: never cleared",
                             "files": files, "bytes": size})
    return rows


def _print_parts(rows: list[dict[str, Any]]) -> None:
    print(f"{'part':14s} {'files':>6s} {'size':>10s}  what")
    for r in rows:
        print(f"{r['name']:14s} {r['files']:6d} {_human(r['bytes']):>10s}  {r['what']}"
              + (f" ({r['path']})" if r["name"] == "(other)" else ""))
    total = sum(r["bytes"] for r in rows if r["name"] != "(other)")
    print(f"{'total':14s} {sum(r['files'] for r in rows if r['name'] != '(other)'):6d} {_human(total):>10s}")


def _human(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _cache() -> Any:
    from fusegraph.engines.iree.cache import ModuleCache

    return ModuleCache()


def _info(args: argparse.Namespace) -> int:
    info = _cache().info()
    parts = part_usage()
    if args.json:
        print(json.dumps({**info, "parts": parts}, indent=1))
        return 0
    state = "enabled" if info["enabled"] else "disabled (FUSEGRAPH_CACHE=0)"
    print(f"cache directory : {info['root']} ({state})")
    print(f"entries         : {info['entries']} ({info['bytes'] / 1e6:.2f} MB)")
    print(f"size limit      : {info['max_bytes'] / 1e6:.2f} MB for every compiled artifact; "
          f"{_artifacts_line(Path(info['root']))} (least recently used evicted)")
    print(f"kept failures   : {info['failures']} (under {info['root']}/failures)")
    print(f"everything      : {_human(sum(r['bytes'] for r in parts if r['name'] != '(other)'))} in "
          f"{sum(r['files'] for r in parts if r['name'] != '(other)')} files (`fusegraph cache list`)")
    return 0


def _list(args: argparse.Namespace) -> int:
    cache = _cache()
    entries = cache.list_entries()
    parts = part_usage()
    if args.json:
        print(json.dumps({"root": str(cache.root), "parts": parts, "iree_entries": entries}, indent=1, default=str))
        return 0
    print(f"cache directory {cache.root}")
    _print_parts(parts)
    print()
    if not entries:
        print(f"no entries (compiled IREE modules) in {cache.entries_root}")
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
    root = cache.root
    wanted = [q for q in PARTS if (args.only is None or q.name in args.only)
              and not (args.keep_failures and q.name == "failures")]
    before = {q.name: _usage(root / q.path) for q in wanted}
    n_entries = 0
    if any(q.name == "iree" for q in wanted):
        n_entries = cache.clear(failures=False)  # also forgets this process's in-memory modules
    removed = []
    for q in wanted:
        path = root / q.path
        files, size = before[q.name]
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink(missing_ok=True)
        _lock_of(path).unlink(missing_ok=True)
        if files or q.name == "iree":
            removed.append((q, files, size))
    for q, files, size in removed:
        extra = f" ({n_entries} entr{'y' if n_entries == 1 else 'ies'})" if q.name == "iree" else ""
        print(f"removed {q.name:14s} {files:6d} files {_human(size):>10s}{extra}")
    iree = (f"removed {n_entries} entr{'y' if n_entries == 1 else 'ies'} from {cache.entries_root}; "
            if any(q.name == "iree" for q in wanted) else "")
    print(f"{iree}{_human(sum(r[2] for r in removed))} in all from {root}")
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
            new = None if args.size.strip().lower() == "default" else parse_size(args.size)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            print(f"fusegraph cache limit: {exc}", file=sys.stderr)
            return 2
        if new is not None and not args.yes:
            from fusegraph.runtime import cache_limit

            used = sum(cache_limit.usage(cache.root).values())
            if used > new:  # eviction cannot be undone: it is asked for, not done in passing
                print(f"fusegraph cache limit: {args.size} is below what the compiled artifacts use now "
                      f"({used / 1e6:.2f} MB): setting it evicts "
                      f"{'every one of them' if new == 0 else 'the least recently used until they fit'}; "
                      "pass --yes to do it", file=sys.stderr)
                return 2
        try:
            cache.set_limit(new)
        except ValueError as exc:
            print(f"fusegraph cache limit: {exc}", file=sys.stderr)
            return 2
    info = cache.info()
    print(f"size limit {info['max_bytes'] / 1e6:.2f} MB; {_artifacts_line(cache.root)}")
    return 0


def _artifacts_line(root: Path) -> str:
    from fusegraph.runtime import cache_limit

    use = cache_limit.usage(root)
    each = ", ".join(f"{k} {_human(v)}" for k, v in use.items() if v)
    return f"compiled artifacts use {sum(use.values()) / 1e6:.2f} MB" + (f" ({each})" if each else "")


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"
