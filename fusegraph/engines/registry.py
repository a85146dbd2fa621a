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
import logging
from collections.abc import Callable, Iterator
from importlib import metadata
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
    "torch": "fusegraph.engines.torch:TorchEngine",
    "reference": "fusegraph.engines.reference:ReferenceEngine",
}


class Registry:
    """Loads engines and heuristic plugins on first use; plugins join the built-ins."""

    def __init__(self, builtin: dict[str, str] | None = None, discover: bool = True) -> None:
        self._builtin = dict(BUILTIN if builtin is None else builtin)
        self._discover = discover
        self._engines: dict[str, Engine] = {}
        self._origins: dict[str, str] = {}
        self._broken: dict[str, str] = {}
        self._heuristics: list[Heuristic] = []
        self._broken_heuristics: dict[str, str] = {}
        self._loaded = False

    def register(self, engine: Engine, origin: str = "runtime") -> None:
        """Adds (or replaces) an engine by its name; used by tests and embedding programs."""
        self._load()
        self._broken.pop(engine.name, None)
        self._engines[engine.name] = engine
        self._origins[engine.name] = origin

    def unregister(self, name: str) -> None:
        self._load()
        self._engines.pop(name, None)
        self._origins.pop(name, None)

    def register_heuristic(self, heuristic: Heuristic) -> None:
        self._load()
        self._heuristics.append(heuristic)

    def unregister_heuristic(self, name: str) -> None:
        self._load()
        self._heuristics = [h for h in self._heuristics if h.name != name]

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for name, target in self._builtin.items():
            self._try(name, functools.partial(_resolve, target), "built-in")
        if not self._discover:
            return
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in self._engines:
                log.warning("engine plugin '%s' (%s) shadows an engine of that name", ep.name, ep.value)
            self._try(ep.name, ep.load, f"plugin {ep.value}")
        for ep in metadata.entry_points(group=HEURISTICS_GROUP):
            self._try_heuristic(ep)

    def _try(self, name: str, load: Callable[[], Any], origin: str) -> None:
        try:
            engine = _instantiate(load())
            if not isinstance(engine, Engine):
                raise TypeError(f"{type(engine).__name__} does not implement the Engine protocol")
            if engine.name != name:
                log.info("engine registered as '%s' calls itself '%s'", name, engine.name)
            self._engines[engine.name] = engine
            self._origins[engine.name] = origin
            self._broken.pop(engine.name, None)
        except Exception as exc:  # a broken plugin must not break fusegraph
            log.info("engine '%s' could not be loaded: %s", name, exc)
            self._broken[name] = f"{origin}: failed to load: {type(exc).__name__}: {exc}"

    def _try_heuristic(self, ep: metadata.EntryPoint) -> None:
        try:
            h = _instantiate(ep.load())
            if not isinstance(h, Heuristic):
                raise TypeError(f"{type(h).__name__} does not implement the Heuristic protocol")
            self._heuristics.append(h)
        except Exception as exc:
            log.warning("heuristic plugin '%s' could not be loaded: %s", ep.name, exc)
            self._broken_heuristics[ep.name] = f"plugin {ep.value}: failed to load: {exc}"

    def names(self) -> list[str]:
        self._load()
        return list(self._engines)

    def get(self, name: str) -> Engine:
        self._load()
        if name not in self._engines:
            why = self._broken.get(name)
            raise UnsupportedError(
                f"no engine named '{name}'" + (f" ({why})" if why else f"; known: {self.names()}")
            )
        return self._engines[name]

    def engines(self) -> list[Engine]:
        self._load()
        return list(self._engines.values())

    def available_engines(self) -> list[Engine]:
        """Engines that can run here at all (library installed, device present...)."""
        return [e for e in self.engines() if _available(e)]

    def broken(self) -> dict[str, str]:
        """Engines that failed to load: name -> reason."""
        self._load()
        return dict(self._broken)

    def heuristics(self) -> list[Heuristic]:
        """Heuristic plugins, in discovery order (the built-in rules are not listed here)."""
        self._load()
        return list(self._heuristics)

    def broken_heuristics(self) -> dict[str, str]:
        self._load()
        return dict(self._broken_heuristics)

    def origin(self, name: str) -> str:
        self._load()
        return self._origins.get(name, "?")

    def info(self) -> list[EngineInfo]:
        self._load()
        rows = [
            EngineInfo(e.name, str(e.version), _available(e), self._origins.get(e.name, "?"))
            for e in self._engines.values()
        ]
        rows += [EngineInfo(n, "?", Support.no(why), "broken") for n, why in self._broken.items()]
        return rows


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
