"""The typed errors every layer raises.

Each error says *what* is wrong and *where*: the node and/or tensor at fault are kept as
attributes (for programs) and put into the message (for people).
"""

from __future__ import annotations

from pathlib import Path


class FusegraphError(Exception):
    """Base of every error fusegraph raises on purpose."""

    def __init__(
        self,
        message: str,
        *,
        node: str | None = None,
        tensor: str | None = None,
    ) -> None:
        self.node = node
        self.tensor = tensor
        where = []
        if node is not None:
            where.append(f"node '{node}'")
        if tensor is not None:
            where.append(f"tensor '{tensor}'")
        prefix = (", ".join(where) + ": ") if where else ""
        self.detail = message
        super().__init__(prefix + message)


class ValidationError(FusegraphError):
    """The graph is malformed: shapes, strides, dtypes, names or structure."""


class UnsupportedError(FusegraphError):
    """A valid graph that an engine (or every engine) cannot run; says why."""


class VariantPackError(FusegraphError):
    """The arrays handed to execute() do not match the graph's tensors."""


class CompileError(FusegraphError):
    """A compiler rejected the graph; keeps the diagnostic and the reproducer's path."""

    def __init__(
        self,
        message: str,
        *,
        node: str | None = None,
        tensor: str | None = None,
        diagnostic: str = "",
        reproducer: Path | None = None,
    ) -> None:
        self.diagnostic = diagnostic
        self.reproducer = reproducer
        full = message
        if reproducer is not None:
            full += f"\n  reproducer: {reproducer}"
        if diagnostic:
            full += "\n  diagnostic:\n    " + "\n    ".join(diagnostic.strip().splitlines()[:40])
        super().__init__(full, node=node, tensor=tensor)


class OptionError(FusegraphError, ValueError):
    """An option given to a front door (the ONNX provider's ``provider_options``, the torch
    backend's ``options``) is unknown or out of range; names the option and what it takes.
    A ValueError too, as Python's own bad-argument errors are."""


class ExecutionError(FusegraphError):
    """A compiled plan failed while running."""
