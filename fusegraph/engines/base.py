"""The engine interface: what every engine plugin implements (hipDNN's plugin idea).

An engine says whether it can run a graph on a handle (with a reason when not), lists
its knobs, and builds an ExecutionPlan that runs the graph.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from fusegraph.graph.graph import Graph
    from fusegraph.runtime.handle import Handle


@dataclass(frozen=True)
class Support:
    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok

    @staticmethod
    def yes() -> Support:
        return Support(True, "")

    @staticmethod
    def no(reason: str) -> Support:
        return Support(False, reason)


@dataclass(frozen=True)
class Knob:
    """One tunable setting of an engine: typed, with a default and its allowed values."""

    name: str
    default: Any
    choices: tuple[Any, ...] = ()
    range: tuple[float, float] | None = None
    description: str = ""
    # a knob that changes the numbers (TF32 rounding), not only the speed: tuning never
    # tries its other values; a caller pins them (a faster answer is no answer to a
    # float32 graph that must stay float32)
    numerics: bool = False

    @property
    def type(self) -> type:
        return type(self.default)

    def check(self, value: Any) -> None:
        if self.choices and value not in self.choices:
            raise ValueError(f"knob '{self.name}': {value!r} not in {list(self.choices)}")
        if self.range is not None and not self.range[0] <= value <= self.range[1]:
            raise ValueError(f"knob '{self.name}': {value!r} outside {self.range}")


def knob_values(engine: str, knobs: Sequence[Knob], config: EngineConfig) -> dict[str, Any]:
    """Every knob's value under ``config`` (its default where the config is silent), after
    checking that the config names only these knobs and only allowed values."""
    known = {k.name: k for k in knobs}
    for name, value in config.knobs:
        if name not in known:
            raise ValueError(f"{engine}: no knob '{name}' for this graph/handle (knobs: {sorted(known)})")
        known[name].check(value)
    return {k.name: config.get(k.name, k.default) for k in knobs}


@dataclass(frozen=True)
class EngineConfig:
    """An engine and a setting of its knobs: what a plan is built from and tuned over."""

    engine: str
    knobs: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        # a mapping is the natural way to write knobs; it becomes the hashable pairs
        if isinstance(self.knobs, Mapping):
            object.__setattr__(self, "knobs", tuple(self.knobs.items()))
        elif not all(isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str) for kv in self.knobs):
            raise TypeError(f"EngineConfig('{self.engine}'): knobs must be (name, value) pairs or a mapping, "
                            f"got {self.knobs!r}")

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.knobs).get(name, default)

    def as_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "knobs": dict(self.knobs)}

    def __str__(self) -> str:
        if not self.knobs:
            return self.engine
        return f"{self.engine}[{', '.join(f'{k}={v}' for k, v in self.knobs)}]"


class ExecutionPlan(abc.ABC):
    """A built, runnable graph for one engine, config and handle."""

    # True when execute() takes host (NumPy) inputs in any memory order and lays them out
    # as declared itself -- faster than a NumPy copy; else they must match the declared strides.
    relayouts_host_inputs: bool = False

    def __init__(self, graph: Graph, handle: Handle, config: EngineConfig) -> None:
        self.graph = graph
        self.handle = handle
        self.config = config

    @property
    def engine(self) -> str:
        return self.config.engine

    @property
    def workspace_size(self) -> int:
        return 0

    @abc.abstractmethod
    def execute(self, variant_pack: Mapping[Any, Any]) -> dict[str, Any]:
        """Runs the graph; same contract as Graph.execute."""

    def bind_constants(self, values: Mapping[Any, Any]) -> bool:
        """Declares inputs that keep these values -- the same objects, never written -- in
        every later call (a model's weights), so that the engine may transform them once:
        the torch engine reorders convolution filters into oneDNN's blocked layout here
        instead of on every call.

        Returns whether the plan keeps them. If it does, later packs may leave them out
        (saving the caller a pass over every weight per call; they run with the bound
        value), and a pack holding a different object for one of them runs with that value,
        untransformed. If not (the default, which transforms nothing), callers pass them in
        every pack as before."""
        return False

    def serialize(self) -> bytes | None:
        """Bytes that rebuild this plan elsewhere (None when the engine cannot)."""
        return None

    def persist(self) -> str:
        """Keeps what a later process would otherwise compile again for this plan (the torch
        engine's ``compile=True`` plans: an AOTInductor package in the cache), for a plan
        the caller means to use again; '' where there is nothing to keep, else what was done.
        Not done at build: it costs seconds, worth paying only for a plan that won."""
        return ""

    def describe(self) -> dict[str, Any]:
        return {"engine": self.engine, "config": str(self.config)}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.config} on {self.handle.device}>"


@runtime_checkable
class Engine(Protocol):
    """An engine. Its module, ``available()`` and ``version`` must not import the engine's
    library (torch, cuDNN, iree.compiler...): the registry and the tuning database ask
    every engine, and a build on one engine must not pay for another's (issue 10). Find
    the library (``importlib.util.find_spec``, ``importlib.metadata``) and import it in
    ``supports``/``build``/the plan."""

    name: str  # stable id, e.g. "iree", "reference", "torch"
    version: str  # cheap: part of the tuning database's key

    def available(self) -> Support:
        """Whether this engine can run at all here (library installed, device present...);
        cheap, without importing the library."""
        ...

    def supports(self, graph: Graph, handle: Handle) -> Support:
        """Whether it can run this validated graph on this handle, and if not, why."""
        ...

    def knobs(self, graph: Graph, handle: Handle) -> Sequence[Knob]: ...

    def build(self, graph: Graph, handle: Handle, config: EngineConfig | None = None) -> ExecutionPlan: ...


def distribution_version(name: str) -> str:
    """``importlib.metadata.version(name)``, read from the distribution's header lines
    instead of through the e-mail parser that ``metadata`` loads (importing and running it
    is ~2 ms of a fresh process's build when the tuning database asks every engine's
    libraries). Raises ``importlib.metadata.PackageNotFoundError`` as ``version`` does."""
    from importlib import metadata

    dist = metadata.Distribution.from_name(name)
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or dist.read_text("") or ""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line:
            break  # the header block ends at the first empty line
        if line[:8].lower() == "version:":
            folded = i + 1 < len(lines) and lines[i + 1][:1] in (" ", "\t")
            if not folded:
                return line[8:].lstrip(" \t")
            break
    return str(dist.version)  # anything unusual: the e-mail parser's answer


@dataclass
class EngineInfo:
    name: str
    version: str
    available: Support
    origin: str = "built-in"
    extra: dict[str, Any] = field(default_factory=dict)
