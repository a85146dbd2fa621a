"""Checks the subcommands share: a requested engine or device is looked at before any work,
and a wrong one ends in one line naming the argument (``SystemExit``, exit status 1)."""

from __future__ import annotations

import argparse


def nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = nonnegative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def check_engine(command: str, name: str | None, *, option: str = "--engine") -> None:
    """An engine the registry knows (available here or not: its own refusal says why)."""
    if name is None:
        return
    from fusegraph.engines.registry import active_registry

    names = active_registry().names()
    if name not in names:
        raise SystemExit(f"fusegraph {command}: {option} {name!r}: unknown engine (known: {', '.join(names)})")


def check_device(command: str, spec: str, *, option: str = "--device") -> None:
    """A device string fusegraph can parse."""
    from fusegraph.runtime.handle import parse_device

    try:
        parse_device(spec)
    except ValueError as exc:
        raise SystemExit(f"fusegraph {command}: {option} {spec!r}: {exc}") from None


def device_problem(spec: str) -> str | None:
    """Why no fusegraph engine can use the device (None when one can), probed on a tiny
    graph; the engines' reasons on one line."""
    import fusegraph as fg
    from fusegraph.engines.registry import active_registry

    h = fg.Handle(spec)
    if not h.device.is_gpu:
        return None
    g = fg.Graph("device_probe", io_data_type=fg.DataType.FLOAT)
    g.relu(g.tensor("x", [1, 8])).set_output(True)
    g.validate()
    reasons = []
    for e in active_registry().available_engines():
        sup = e.supports(g, h)
        if sup:
            return None
        reasons.append(f"{e.name}: {' '.join(str(sup.reason).split())}")
    return "; ".join(dict.fromkeys(reasons)) or "no engine is available"
