"""Engine registry: built-in engines plus plugins from the ``fusegraph.engines`` entry points.

A plugin package declares, in its metadata::

    [project.entry-points."fusegraph.engines"]
    myengine = "my_package.module:MyEngine"

    [project.entry-points."fusegraph.heuristics"]
    myrules = "my_package.module:MyHeuristic"

The object named is an Engine (or Heuristic) class or factory taking no arguments, or an
instance. A module that fails to import, or an object that does not implement the
protocol, never breaks fusegraph: the engine is listed as broken, with the reason.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from fusegraph.engines.base import Engine, EngineInfo, Support
from fusegraph.engines.heuristic import Heuristic
from fusegraph.errors import UnsupportedError

log = logging.getLogger("fusegraph.engines")

ENTRY_POINT_GROUP = "fusegraph.engines"
HEURISTICS_GROUP = "fusegraph.heuristics"

# name -> "module:attr" of the built-in engines, in registry order (the order `fusegraph
# engines` lists them and FALLBACK mode tries them; the heuristics decide real preference).
BUILTIN: dict[str, str] = {
    "iree": "fusegraph.engines.iree:IreeEngine",
    "torch": "fusegraph.engines.torch.engine:TorchEngine",
    "cudnn": "fusegraph.engines.cudnn:CudnnEngine",
    "triton": "fusegraph.engines.triton:TritonEngine",
    "reference": "fusegraph.engines.reference:ReferenceEngine",
}


class Registry:
    """Engines and heuristic plugins, each loaded on first use; plugins join the built-ins.

    Lazy on purpose (issue 10): ``get(name)`` imports that engine's module only, and no
    engine module imports its library (torch, iree.compiler, SciPy) until a plan is built
    or run, so building on one engine never pays for another. Listing everything
    (``names``, ``engines``, ``info``, ``available_engines``) imports every engine module.
    """

    def __init__(self, builtin: dict[str, str] | None = None, discover: bool = True) -> None:
        self._builtin = dict(BUILTIN if builtin is None else builtin)
        self._discover = discover
        # name -> (loader, origin) of engines declared but not loaded yet, in registry order
        self._pending: dict[str, tuple[Callable[[], Any], str]] = {}
        self._order: list[str] = []  # declared names in registry order (loaded ones keep it)
        self._engines: dict[str, Engine] = {}
        self._origins: dict[str, str] = {}
        self._broken: dict[str, str] = {}
        self._heuristic_eps: list[metadata.EntryPoint] = []
        self._heuristics: list[Heuristic] = []
        self._heuristics_loaded = False
        self._broken_heuristics: dict[str, str] = {}
        self._declared = False
        self._lock = threading.RLock()  # loading is not thread-safe by itself (imports, dicts)

    def register(self, engine: Engine, origin: str = "runtime") -> None:
        """Adds (or replaces) an engine by its name; used by tests and embedding programs."""
        self._declare()
        self._pending.pop(engine.name, None)
        self._broken.pop(engine.name, None)
        self._put(engine, origin)

    def unregister(self, name: str) -> None:
        self._declare()
        self._pending.pop(name, None)
        self._engines.pop(name, None)
        self._origins.pop(name, None)
        if name in self._order:
            self._order.remove(name)

    def register_heuristic(self, heuristic: Heuristic) -> None:
        self._load_heuristics()
        self._heuristics.append(heuristic)

    def unregister_heuristic(self, name: str) -> None:
        self._load_heuristics()
        self._heuristics = [h for h in self._heuristics if h.name != name]

    # ---- declaring (cheap: no engine module is imported) ------------------------------------
    def _declare(self) -> None:
        with self._lock:
            if self._declared:
                return
            self._declared = True
            for name, target in self._builtin.items():
                self._pending[name] = (functools.partial(_resolve, target), "built-in")
                self._order.append(name)
            if not self._discover:
                return
            eps = plugin_entry_points()
            for ep in eps.select(group=ENTRY_POINT_GROUP):
                if ep.name in self._pending:
                    log.warning("engine plugin '%s' (%s) shadows an engine of that name", ep.name, ep.value)
                else:
                    self._order.append(ep.name)
                self._pending[ep.name] = (ep.load, f"plugin {ep.value}")
            self._heuristic_eps = list(eps.select(group=HEURISTICS_GROUP))

    # ---- loading ------------------------------------------------------------------------------
    def _load_one(self, name: str) -> None:
        with self._lock:
            entry = self._pending.pop(name, None)
            if entry is not None:
                self._try(name, *entry)

    def _load(self) -> None:
        """Loads every declared engine (listing them all needs their objects)."""
        with self._lock:
            self._declare()
            for name in list(self._pending):
                self._load_one(name)

    def _put(self, engine: Engine, origin: str) -> None:
        if engine.name not in self._order:
            self._order.append(engine.name)
        self._engines[engine.name] = engine
        self._origins[engine.name] = origin

    def _try(self, name: str, load: Callable[[], Any], origin: str) -> None:
        try:
            engine = _instantiate(load())
            missing = _missing_members(engine)
            if missing:
                raise TypeError(
                    f"{type(engine).__name__} does not implement the Engine protocol (no {', '.join(missing)})"
                )
            if engine.name != name:
                log.info("engine registered as '%s' calls itself '%s'", name, engine.name)
            self._put(engine, origin)
            self._broken.pop(engine.name, None)
        except Exception as exc:  # a broken plugin must not break fusegraph
            log.info("engine '%s' could not be loaded: %s", name, exc)
            self._broken[name] = f"{origin}: failed to load: {type(exc).__name__}: {exc}"

    def _load_heuristics(self) -> None:
        with self._lock:
            self._declare()
            if self._heuristics_loaded:
                return
            self._heuristics_loaded = True
            for ep in self._heuristic_eps:
                self._try_heuristic(ep)

    def _try_heuristic(self, ep: metadata.EntryPoint) -> None:
        try:
            h = _instantiate(ep.load())
            if not isinstance(h, Heuristic):
                raise TypeError(f"{type(h).__name__} does not implement the Heuristic protocol")
            self._heuristics.append(h)
        except Exception as exc:
            log.warning("heuristic plugin '%s' could not be loaded: %s", ep.name, exc)
            self._broken_heuristics[ep.name] = f"plugin {ep.value}: failed to load: {exc}"

    def _loaded(self) -> list[Engine]:
        return [self._engines[n] for n in self._order if n in self._engines]

    # ---- queries --------------------------------------------------------------------------------
    def names(self) -> list[str]:
        self._load()
        return [e.name for e in self._loaded()]

    def get(self, name: str) -> Engine:
        """The engine called ``name``, loading its module (only its) on first use."""
        self._declare()
        self._load_one(name)
        if name not in self._engines and self._pending:
            self._load()  # a plugin may call itself differently from its entry point
        if name not in self._engines:
            why = self._broken.get(name)
            raise UnsupportedError(
                f"no engine named '{name}'" + (f" ({why})" if why else f"; known: {self.names()}")
            )
        return self._engines[name]

    def engines(self) -> list[Engine]:
        self._load()
        return self._loaded()

    def available_engines(self) -> list[Engine]:
        """Engines that can run here at all (library installed, device present...)."""
        return [e for e in self.engines() if _available(e)]

    def broken(self) -> dict[str, str]:
        """Engines that failed to load: name -> reason."""
        self._load()
        return dict(self._broken)

    def heuristics(self) -> list[Heuristic]:
        """Heuristic plugins, in discovery order (the built-in rules are not listed here)."""
        self._load_heuristics()
        return list(self._heuristics)

    def broken_heuristics(self) -> dict[str, str]:
        self._load_heuristics()
        return dict(self._broken_heuristics)

    def origin(self, name: str) -> str:
        self._load()
        return self._origins.get(name, "?")

    def info(self) -> list[EngineInfo]:
        self._load()
        rows = [
            EngineInfo(e.name, str(e.version), _available(e), self._origins.get(e.name, "?"))
            for e in self._loaded()
        ]
        rows += [EngineInfo(n, "?", Support.no(why), "broken") for n, why in self._broken.items()]
        return rows


_ENGINE_MEMBERS = ("name", "version", "available", "supports", "knobs", "build")


def _missing_members(obj: Any) -> list[str]:
    """The Engine protocol's members ``obj`` lacks, found without calling anything:
    ``isinstance(obj, Engine)`` reads ``version``, which may import the engine's library."""
    missing = []
    for member in _ENGINE_MEMBERS:
        try:
            inspect.getattr_static(obj, member)
        except AttributeError:
            missing.append(member)
    return missing


_SECTIONS = (f"[{ENTRY_POINT_GROUP}]", f"[{HEURISTICS_GROUP}]")
SCAN_SCHEMA = 2
SCAN_ENTRIES = 16  # search paths remembered (each script's directory starts its own)


def plugin_entry_points() -> metadata.EntryPoints:
    """The entry points of distributions that declare fusegraph plugins.

    ``importlib.metadata.entry_points()`` parses the metadata of every installed
    distribution (10-30 ms here, most of a cached build); :func:`_scan` reads each one's
    entry_points.txt as text instead (~2 ms of CPU for ~150 distributions), with the same
    rule for duplicates (the first distribution of a name on sys.path wins). Its outcome,
    which distributions declare plugins, is kept in the cache directory
    (``registry/plugin_scan.json``, per search path) and reused while nothing it depends on
    has changed:
    sys.path, the modification time of each of its directories (an installer adds or
    removes a distribution's metadata directory there), and every entry_points.txt that an
    egg-info holds (``setup.py develop`` rewrites those in place) or that named a group."""
    path = _scan_path()
    plugins = _cached_scan(path) if path is not None else None
    if plugins is None:
        plugins, watched = _scan()
        if path is not None:
            _store_scan(path, plugins, watched)
    found: list[metadata.EntryPoint] = []
    for d in plugins:
        found.extend(metadata.PathDistribution(Path(d)).entry_points)
    return metadata.EntryPoints(ep for ep in found if ep.group in (ENTRY_POINT_GROUP, HEURISTICS_GROUP))


def _search_path() -> list[str]:
    return [os.path.abspath(entry or ".") for entry in sys.path]


def _scan() -> tuple[list[str], dict[str, list[int] | None]]:
    """The metadata directories of distributions that declare fusegraph plugins, in
    sys.path order, and the signatures (taken before reading) of the paths whose change
    would change that answer."""
    seen: set[str] = set()
    plugins: list[str] = []
    watched: dict[str, list[int] | None] = {}
    for entry in _search_path():
        watched[entry] = _signature(entry)
        try:
            listing = os.scandir(entry)
        except OSError:  # not a directory (a zip, a missing path): no plugin is looked for there
            continue
        with listing:
            dirs = sorted((d for d in listing if d.name.endswith((".dist-info", ".egg-info"))), key=lambda d: d.name)
        for d in dirs:
            name = re.sub(r"[-_.]+", "_", d.name.rsplit(".", 1)[0].split("-", 1)[0]).lower()
            if name in seen:
                continue
            seen.add(name)
            eps = os.path.join(d.path, "entry_points.txt")
            sig = _signature(eps)
            if d.name.endswith(".egg-info"):
                watched[eps] = sig
            try:
                with open(eps, encoding="utf-8") as f:
                    text = f.read()
            except OSError:
                continue
            if any(section in text for section in _SECTIONS):
                plugins.append(d.path)
                watched[eps] = sig
    return plugins, watched


def _signature(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_mtime_ns, st.st_size]


def _scan_path() -> Path | None:
    from fusegraph.runtime.cache_dir import cache_enabled, cache_root

    return cache_root() / "registry" / "plugin_scan.json" if cache_enabled() else None


def _scan_key(search_path: list[str]) -> str:
    return "\n".join(search_path)


def _cached_scan(path: Path) -> list[str] | None:
    """The stored scan's plugin directories, or None when it is missing or out of date."""
    from fusegraph.runtime.cache_dir import read_table

    doc = read_table(path)
    scans = doc.get("scans")
    if doc.get("schema") != SCAN_SCHEMA or not isinstance(scans, dict):
        return None
    scan = scans.get(_scan_key(_search_path()))
    if not isinstance(scan, dict):
        return None
    watched = scan.get("watched")
    plugins = scan.get("plugins")
    if not isinstance(watched, dict) or not isinstance(plugins, list):
        return None
    if any(_signature(p) != sig for p, sig in watched.items()):
        return None
    return [str(d) for d in plugins]


def _store_scan(path: Path, plugins: list[str], watched: dict[str, list[int] | None]) -> None:
    from fusegraph.runtime.cache_dir import read_table

    # A path changed in the last seconds may change again within its file system's
    # timestamp granularity without its signature changing: such a scan is not kept.
    recent = time.time_ns() - 2_000_000_000
    if any(sig is not None and sig[0] > recent for sig in watched.values()):
        return
    doc = read_table(path)
    scans = doc.get("scans") if doc.get("schema") == SCAN_SCHEMA else None
    scans = dict(scans) if isinstance(scans, dict) else {}
    key = _scan_key(_search_path())
    scans.pop(key, None)
    scans[key] = {"watched": watched, "plugins": plugins}  # last: the most recent
    while len(scans) > SCAN_ENTRIES:
        scans.pop(next(iter(scans)))
    doc = {"schema": SCAN_SCHEMA, "scans": scans}
    # Renamed into place but not fsynced (an fsync costs ~10 ms): a table lost or torn by a
    # crash reads as empty, and the next process scans again.
    tmp = path.with_name(f".{path.name}-{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(json.dumps(doc, separators=(",", ":")).encode())
        os.replace(tmp, path)
    except OSError as exc:  # an unwritable cache costs the next process a scan, nothing more
        log.debug("could not store the plugin scan at %s: %s", path, exc)
        with contextlib.suppress(OSError):
            tmp.unlink()


def _instantiate(obj: Any) -> Any:
    """A class or a zero-argument factory is called; an instance is taken as is."""
    if isinstance(obj, type):
        return obj()
    if callable(obj) and not hasattr(obj, "name"):
        return obj()
    return obj


def _available(e: Engine) -> Support:
    try:
        return e.available()
    except Exception as exc:
        return Support.no(f"availability check failed: {exc}")


def _resolve(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


REGISTRY = Registry()


_ACTIVE: list[Registry] = [REGISTRY]


def active_registry() -> Registry:
    """The registry selection uses when none is passed (REGISTRY unless inside ``using``)."""
    return _ACTIVE[-1]


@contextlib.contextmanager
def using(registry: Registry) -> Iterator[Registry]:
    """Makes ``registry`` the active one for the block (tests, embedding programs)."""
    _ACTIVE.append(registry)
    try:
        yield registry
    finally:
        _ACTIVE.remove(registry)
