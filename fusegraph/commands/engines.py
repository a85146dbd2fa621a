"""`fusegraph engines`: every engine, its version, and whether it runs here (and why not)."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    e = sub.add_parser("engines", help="list engines, their versions and availability")
    e.add_argument("--device", default=None, help="also say whether each engine can use this device (cpu, cuda:0...)")
    e.set_defaults(fn=_run)


def _run(args: argparse.Namespace) -> int:
    from fusegraph.commands._checks import check_device
    from fusegraph.engines.registry import active_registry

    if args.device:
        check_device("engines", args.device)

    rows = active_registry().info()
    width = max(len(r.name) for r in rows)
    vwidth = max(10, *(len(r.version) for r in rows))
    owidth = max(10, *(len(r.origin) for r in rows))
    for r in rows:
        state = "available" if r.available else f"unavailable: {r.available.reason}"
        print(f"{r.name:{width}s}  {r.version:{vwidth}s}  {r.origin:{owidth}s}  {state}")
    if args.device:
        _device_rows(args.device)
    heur = active_registry().heuristics()
    broken = active_registry().broken_heuristics()
    print(f"heuristics: builtin{''.join(', ' + h.name for h in heur)}")
    for name, why in broken.items():
        print(f"  heuristic {name}: {why}")
    return 0


def _device_rows(spec: str) -> None:
    """Whether each available engine can drive the device (a trivial graph as the probe)."""
    import fusegraph as fg
    from fusegraph.engines.registry import active_registry

    h = fg.Handle(spec)
    g = fg.Graph("probe", io_data_type=fg.DataType.FLOAT)
    x = g.tensor("x", [1, 8])
    g.relu(x).set_output(True)
    g.validate()
    print(f"on {h.device}:")
    for e in active_registry().available_engines():
        s = e.supports(g, h)
        print(f"  {e.name}: {'yes' if s else 'no: ' + s.reason}")
