"""Named regression tests for what the graph fuzzer (tests/test_fuzz_graphs.py) found.

Each is the fuzzer's shrunk example, compared with the float64 reference. Bugs in files
outside the reliability area are strict xfails naming the bug; when one is fixed the xfail
turns into a failure, and the mark comes off.
"""

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


def _agrees(g: fg.Graph, engine: str, rng: np.random.Generator) -> None:
    g.validate()
    inputs = random_inputs(g, rng)
    ref = g.execute(dict(inputs), engine="reference")
    got = g.execute(dict(inputs), engine=engine)
    err, why = compare(g, got, ref)
    assert err <= tolerance(g), f"{engine}: rel err {err:.3g} > {tolerance(g):g} {why}"


@pytest.mark.xfail(
    strict=True,
    reason=(
        "IREE engine (engines/iree emit/compile/plan): a graph with an f64 output computed by any "
        "op but identity (abs, neg, add, exp, relu...) builds, then fails at run time with "
        "ExecutionError 'hal.buffer_view.create OUT_OF_RANGE; buffer view byte length 24 exceeds "
        "backing buffer byte length 12': the emitted MLIR casts f64->f32->f64 correctly, so the "
        "compiled module allocates its f64 result at f32 size (IREE's f64->f32 demotion of the "
        "torch input, --iree-input-demote-f64-to-f32, appears to shrink the storage but not the "
        "declared view type). Found by the fuzzer (io_data_type=DOUBLE, one abs)."
    ),
)
def test_fuzz_iree_f64_output_of_a_computed_op(rng: np.random.Generator) -> None:
    g = fg.Graph(name="fuzz_f64_abs")
    x = g.tensor("x", [3], data_type=DataType.DOUBLE)
    g.abs(x).set_data_type(DataType.DOUBLE).set_output(True)
    _agrees(g, "iree", rng)


def aligned_read_only(values: np.ndarray, alignment: int = 4096) -> np.ndarray:
    """A read-only C-contiguous copy of ``values`` whose data pointer is ``alignment``-aligned."""
    raw = np.empty(values.nbytes + alignment, np.uint8)
    off = (-raw.ctypes.data) % alignment
    arr = raw[off : off + values.nbytes].view(values.dtype).reshape(values.shape)
    arr[...] = values
    arr.flags.writeable = False
    return arr


@pytest.mark.xfail(
    strict=True,
    reason=(
        "IREE engine (runtime/iree_hal.py HalRuntime.upload, called by engines/iree/plan.py "
        "_host_input): a READ-ONLY input array whose data pointer is IMPORT_ALIGNMENT-aligned is "
        "aliased through allocator.import_host_allocation, which refuses read-only memory with a "
        "raw ValueError 'buffer source array is read-only' (not a fusegraph error). Any read-only "
        "input qualifies (np.frombuffer of bytes, a read-only memmap, a broadcast view); the "
        "fuzzer met it as an input broadcast on every axis (strides [0, 0, 0]: a 1-element "
        "read-only view), so it fails only when the element happens to be aligned. Fix: alias "
        "only writeable arrays (or copy read-only ones)."
    ),
)
def test_fuzz_iree_read_only_aligned_input(rng: np.random.Generator) -> None:
    g = fg.Graph(name="fuzz_read_only", io_data_type=DataType.FLOAT)
    x = g.tensor("x", [3, 4], [0, 0])  # the fuzzer's case: one element broadcast everywhere
    g.neg(x).set_name("y").set_output(True)
    g.validate()
    one = aligned_read_only(rng.standard_normal(1).astype(np.float32))
    x_arr = np.broadcast_to(one.reshape(1, 1), (3, 4))
    got = g.execute({"x": x_arr}, engine="iree")["y"]
    np.testing.assert_array_equal(got, -x_arr)


def test_fuzz_torch_input_broadcast_on_every_axis(rng: np.random.Generator) -> None:
    """The same graph on the torch engine (it passes; kept beside the IREE xfail)."""
    g = fg.Graph(name="fuzz_all_broadcast", io_data_type=DataType.FLOAT)
    x = g.tensor("x", [3, 4], [0, 0])
    g.neg(x).set_name("y").set_output(True)
    _agrees(g, "torch", rng)


@pytest.mark.xfail(
    strict=True,
    reason=(
        "IREE engine (engines/iree/lower_pool.py): pooling with a rectangular window (window "
        "[2, 3] with stride [1, 2], or with stride [2, 2] and padding 1) emits a "
        "linalg.generic whose window operand (tensor<2x3>) disagrees with its indexing maps, and "
        "iree-compile rejects it ('inferred input/output operand #1 has shape's dimension #1 to "
        "be 4, but found 3'): CompileError for a valid graph. Square windows compile; [2, 3] "
        "with stride [1, 1] compiles too. Found by the fuzzer (pool_max and pool_avg_exclude_pad in larger graphs)."
    ),
)
@pytest.mark.parametrize(
    ("mode", "window", "stride", "padding"),
    [("max", [2, 3], [1, 2], [0, 0]), ("avg_exclude_pad", [2, 3], [2, 2], [1, 1])],
    ids=["max_2x3_s1x2", "avg_exclude_pad_2x3_s2_p1"],
)
def test_fuzz_iree_pooling_rectangular_window(
    mode: str, window: list[int], stride: list[int], padding: list[int], rng: np.random.Generator
) -> None:
    g = fg.Graph(name="fuzz_pool_rect", io_data_type=DataType.FLOAT)
    x = g.tensor("x", [1, 2, 3, 4] if mode == "max" else [1, 3, 1, 3])
    g.pooling(x, fg.PoolingMode(mode), window=window, stride=stride, padding=padding).set_name("y").set_output(True)
    _agrees(g, "iree", rng)


@pytest.mark.parametrize("engine", ["torch", "reference"])
def test_fuzz_pooling_rectangular_window_other_engines(engine: str, rng: np.random.Generator) -> None:
    g = fg.Graph(name="fuzz_pool_rect", io_data_type=DataType.FLOAT)
    x = g.tensor("x", [1, 2, 3, 4])
    g.pooling(x, fg.PoolingMode.MAX, window=[2, 3], stride=[1, 2]).set_name("y").set_output(True)
    _agrees(g, engine, rng)
