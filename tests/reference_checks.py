"""The check every fuzz regression test makes: a graph on an engine against the float64
reference on fresh random inputs, under the per-op tolerances autotuning uses."""

from __future__ import annotations

import numpy as np

import fusegraph as fg
from fusegraph.reference.inputs import random_inputs
from fusegraph.select.autotune import compare, tolerance


def agrees_with_reference(g: fg.Graph, engine: str, rng: np.random.Generator) -> None:
    g.validate()
    inputs = random_inputs(g, rng)
    ref = g.execute(dict(inputs), engine="reference")
    got = g.execute(dict(inputs), engine=engine)
    err, why = compare(g, got, ref)
    assert err <= tolerance(g), f"{engine}: rel err {err:.3g} > {tolerance(g):g} {why}"
