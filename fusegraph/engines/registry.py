"""Engine registry: built-in engines plus plugins from the ``fusegraph.engines`` entry points.

A plugin package declares, in its metadata::

    [project.entry-points."fusegraph.engines"]
    myengine = "my_package.module:MyEngine"

The object named is an Engine class (or factory) taking no arguments.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from importlib import metadata
from typing import Any

from fusegraph.engines.base import Engine, EngineInfo, Support
from fusegraph.errors import UnsupportedError

log = logging.getLogger("fusegraph.engines")

ENTRY_POINT_GROUP = "fusegraph.engines"

# name -> "module:attr" of the built-in engines, in default preference order.
BUILTIN: dict[str, str] = {
    "reference": "fusegraph.engines.reference:ReferenceEngine",
}


class Registry:
    """Loads engines on first use; plugins found through entry points join the built-ins."""

    def __init__(self) -> None:
        self._engines: dict[str, Engine] = {}
        self._origins: dict[str, str] = {}
        self._broken: dict[str, str] = {}
        self._loaded = False

    def register(self, engine: Engine, origin: str = "runtime") -> None:
        self._engines[engine.name] = engine
        self._origins[engine.name] = origin

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for name, target in BUILTIN.items():
            self._try(name, lambda t=target: _resolve(t), "built-in")
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in self._engines:
                log.warning("engine plugin '%s' (%s) shadows an engine of that name", ep.name, ep.value)
            self._try(ep.name, ep.load, f"plugin {ep.value}")

    def _try(self, name: str, load: Callable[[], Any], origin: str) -> None:
        try:
            factory = load()
            engine = factory() if isinstance(factory, type) or not isinstance(factory, Engine) else factory
            if not isinstance(engine, Engine):
                raise TypeError(f"{type(engine).__name__} does not implement the Engine protocol")
            self.register(engine, origin)
        except Exception as exc:  # a broken plugin must not break fusegraph
            log.warning("engine '%s' could not be loaded: %s", name, exc)
            self._broken[name] = f"{origin}: failed to load: {exc}"

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

    def info(self) -> list[EngineInfo]:
        self._load()
        rows = [
            EngineInfo(e.name, e.version, _available(e), self._origins.get(e.name, "?"))
            for e in self._engines.values()
        ]
        rows += [EngineInfo(n, "?", Support.no(why), "broken") for n, why in self._broken.items()]
        return rows


def _available(e: Engine) -> Support:
    try:
        return e.available()
    except Exception as exc:
        return Support.no(f"availability check failed: {exc}")


def _resolve(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


REGISTRY = Registry()
