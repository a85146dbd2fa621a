"""The reference's two answers for a computed tensor that another node reads (a graph output
or a virtual tensor): exact (kept in float64 for its reader) and materialized (rounded to
its declared dtype first, as an engine that stores it and reads it back computes), and the
check that accepts either (select/autotune.py's Answers, which the fuzzer and autotuning
use)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import fusegraph as fg
from fusegraph.dtypes import DataType
from fusegraph.reference.executor import reads_a_rounded_value, run_reference
from fusegraph.reference.inputs import random_inputs
from fusegraph.select.autotune import Answers, compare, tolerance


def test_materialize_rounds_what_a_node_reads(rng: np.random.Generator) -> None:
    g = fg.Graph("m", io_data_type=DataType.BFLOAT16, intermediate_data_type=DataType.FLOAT, compute_data_type=DataType.FLOAT)
    x = g.tensor("x", [4, 8])
    y = g.tanh(x).set_name("y").set_output(True)
    g.reduction(y, fg.ReductionMode.SUM, axes=[1]).set_name("s").set_output(True)
    g.validate()
    assert reads_a_rounded_value(g)
    xs = random_inputs(g, rng)["x"]
    exact = run_reference(g, {"x": xs})
    mat = run_reference(g, {"x": xs}, materialize=True)
    t = np.tanh(xs.astype(np.float64))
    np.testing.assert_array_equal(exact["y"], t)
    np.testing.assert_array_equal(mat["y"], t.astype(ml_dtypes.bfloat16).astype(np.float64))  # rounded where it is read
    np.testing.assert_allclose(exact["s"], t.sum(axis=1, keepdims=True), rtol=1e-12)
    np.testing.assert_allclose(mat["s"], t.astype(ml_dtypes.bfloat16).astype(np.float64).sum(axis=1, keepdims=True), rtol=1e-12)
    lone = fg.Graph("lone", io_data_type=DataType.BFLOAT16)
    lone.tanh(lone.tensor("x", [4])).set_output(True)
    assert not reads_a_rounded_value(lone.validate())


def _layernorm_then_average() -> fg.Graph:
    """The fuzzer's seed 301596537 (2026-11-26, 9,901-graph run): a bfloat16 layernorm
    (training) output, also averaged over all 27 of its values."""
    g = fg.Graph("fuzz", io_data_type=DataType.BFLOAT16, intermediate_data_type=DataType.FLOAT, compute_data_type=DataType.FLOAT)
    x = g.tensor("in1", [3, 3, 3], [3, 1, 9])
    scale = g.tensor("in2", [1, 3, 3])
    bias = g.tensor("in3", [3, 3])
    y, _, _ = g.layernorm(x, scale, bias, 1e-5, phase=fg.NormFwdPhase.TRAINING)
    y.set_output(True)
    g.reduction(y, fg.ReductionMode.AVG, axes=[0, 1, 2]).set_output(True)
    return g.validate()


@pytest.mark.parametrize("engine", ["iree", "torch"])
def test_fuzz_layernorm_output_read_by_an_average_errs_by_its_rounding(engine: str) -> None:
    """Not a bug: the 27 stored bfloat16 values of y sum to ~0 (mean |y| 0.79, their average
    -0.0040), so the average of the *stored* y and the exact average of y differ by 4% --
    the rounding of y (2^-9 relative each) over a cancellation of ~195x. IREE and torch both
    average the stored values, as the graph says (y is a bfloat16 tensor); they match the
    materialized answer and miss the exact one."""
    g = _layernorm_then_average()
    inputs = random_inputs(g, np.random.default_rng(301596537))
    got = g.execute(dict(inputs), engine=engine)
    answers = Answers(g, inputs, cast=True)
    tol = tolerance(g)
    exact_err, _ = compare(g, got, answers.exact)
    assert exact_err > tol  # the conditioning, against the exact answer
    err, why = answers.error(got, tol)
    assert err <= tol, why


def _bf16_dgrad_then_batchnorm() -> fg.Graph:
    """The fuzzer's seed 1374815 (2026-11-26, a 21,949-graph torch run): a dgrad whose result
    is a virtual tensor declared bfloat16, normalized by a batch norm whose mean is read out."""
    g = fg.Graph("fuzz", io_data_type=DataType.BFLOAT16, intermediate_data_type=DataType.FLOAT,
                 compute_data_type=DataType.FLOAT)
    dx = g.conv_dgrad(g.tensor("dy", [1, 1, 5, 6]), g.tensor("w", [1, 1, 1, 3]), padding=[0, 0])
    dx.set_dim([1, 1, 5, 8]).set_data_type(DataType.BFLOAT16)
    y, mean, inv_var = g.batchnorm(dx, g.tensor("s", [1]), g.tensor("b", [1]), epsilon=1e-3)
    for t, name in ((y, "y"), (mean, "mean"), (inv_var, "inv_var")):
        t.set_name(name).set_output(True)
    return g.validate()


def test_materialize_rounds_a_virtual_tensor_to_its_declared_type(rng: np.random.Generator) -> None:
    g = _bf16_dgrad_then_batchnorm()
    dx = next(t for t in g.tensors if t.producer is not None and t.is_virtual)
    assert dx.dtype == DataType.BFLOAT16 and reads_a_rounded_value(g)
    inputs = random_inputs(g, rng)
    exact = run_reference(g, dict(inputs))
    mat = run_reference(g, dict(inputs), materialize=True)
    assert not np.array_equal(exact["mean"], mat["mean"])  # the rounding of dx shows in its mean


def test_torch_rounding_a_bf16_virtual_tensor_matches_an_answer() -> None:
    """Not a bug: torch stores dx as the bfloat16 the graph declares, and the batch norm's mean
    of 40 such values cancels (rel err up to 0.95 against the exact answer over 30 seeds);
    every seed matches the materialized answer."""
    g = _bf16_dgrad_then_batchnorm()
    tol = tolerance(g)
    worst_exact = 0.0
    for seed in [1374815, *range(30)]:
        inputs = random_inputs(g, np.random.default_rng(seed))
        got = g.execute(dict(inputs), engine="torch")
        answers = Answers(g, inputs, cast=True)
        worst_exact = max(worst_exact, compare(g, got, answers.exact)[0])
        err, why = answers.error(got, tol)
        assert err <= tol, f"seed {seed}: {why}"
    assert worst_exact > tol  # the conditioning is real: the exact answer alone would fail
