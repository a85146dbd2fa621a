"""Two graph outputs computing one commutative op with its operands in either order,
f(x, t) and f(t, x): iree-compile 3.13 failed these valid graphs on int32 ("'linalg.generic'
op write affecting operations on global resources are restricted to workgroup distributed
contexts"; fuzz seed 2 of the 10,134-graph run K on commit aa0b8c5: t = x + y, then max(x, t)
and max(t, x), x and y int32 [5,5]). The emitter now gives every commutative binary op its
operands in one order (FusionGuards.swap_commutative), so IREE folds the twins into one value,
as it did for the same node written twice. Compared with the float64 reference (exact for
these integers); torch runs the same graphs as a control."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import fusegraph as fg
from fusegraph.dtypes import DataType
from fusegraph.reference.inputs import random_inputs
from fusegraph.select.autotune import compare, tolerance


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FUSEGRAPH_CACHE", raising=False)


def _graph(op: str, dtype: DataType, order: str) -> fg.Graph:
    g = fg.Graph(f"twins_{op}", io_data_type=dtype)
    x, y = g.tensor("x", [5, 5]), g.tensor("y", [5, 5])
    t = g.add(x, y)
    f = {"max": g.max, "min": g.min, "add": g.add, "mul": g.mul}[op]
    a = f(x, t)
    b = f(t, x) if order == "swapped" else f(x, t)
    a.set_name("a").set_output(True)
    b.set_name("b").set_output(True)
    return g.validate()


@pytest.mark.parametrize("order", ["swapped", "same"])
@pytest.mark.parametrize("dtype", [DataType.INT32, DataType.FLOAT], ids=["i32", "f32"])
@pytest.mark.parametrize("op", ["max", "min", "add", "mul"])
@pytest.mark.parametrize("engine", ["iree", "torch"])
def test_fuzz_commutative_twins(engine: str, op: str, dtype: DataType, order: str, rng: np.random.Generator) -> None:
    g = _graph(op, dtype, order)
    inputs = random_inputs(g, rng)
    ref = g.execute(dict(inputs), engine="reference")
    got = g.execute(dict(inputs), engine=engine)
    err, why = compare(g, got, ref)
    assert err <= tolerance(g), f"{engine}: rel err {err:.3g} > {tolerance(g):g} {why}"
    np.testing.assert_array_equal(np.asarray(got["a"]), np.asarray(got["b"]))  # one value, two outputs
