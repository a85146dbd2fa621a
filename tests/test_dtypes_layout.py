"""DataType and its numpy mapping; layouts expressed as strides (strides_for and helpers)."""

from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fusegraph as fg
from fusegraph import DataType
from fusegraph.dtypes import promote
from fusegraph.graph import layout

REQUIRED = {
    "HALF": np.float16,
    "BFLOAT16": ml_dtypes.bfloat16,
    "FLOAT": np.float32,
    "DOUBLE": np.float64,
    "INT8": np.int8,
    "UINT8": np.uint8,
    "INT32": np.int32,
    "INT64": np.int64,
    "BOOLEAN": np.bool_,
}


@pytest.mark.parametrize("name,np_type", REQUIRED.items())
def test_required_members_map_to_numpy(name: str, np_type: type) -> None:
    dt = DataType[name]
    assert dt.numpy == np.dtype(np_type)
    assert dt.itemsize == np.dtype(np_type).itemsize
    # every spelling of the numpy type comes back to the same member
    for spelling in (np_type, np.dtype(np_type), np.dtype(np_type).name, dt, dt.value, name.lower()):
        assert fg.as_data_type(spelling) is dt, spelling


def test_every_member_round_trips_through_numpy() -> None:
    for dt in DataType:
        assert fg.as_data_type(dt.numpy) is dt
        assert fg.as_data_type(np.zeros(1, dt.numpy).dtype) is dt


def test_families() -> None:
    assert {d for d in DataType if d.is_float} >= {DataType.HALF, DataType.BFLOAT16, DataType.FLOAT, DataType.DOUBLE}
    assert not DataType.BOOLEAN.is_float and not DataType.BOOLEAN.is_integer
    assert DataType.UINT8.is_integer and not DataType.UINT8.is_float


@pytest.mark.parametrize("alias,dt", [("fp16", "HALF"), ("f16", "HALF"), ("bf16", "BFLOAT16"), ("fp32", "FLOAT"), ("f64", "DOUBLE"), ("bool", "BOOLEAN")])
def test_string_aliases(alias: str, dt: str) -> None:
    assert fg.as_data_type(alias) is DataType[dt]
    assert fg.as_data_type(alias.upper()) is DataType[dt]


@pytest.mark.parametrize("bad", ["complex64", np.complex64, "not-a-type", object, 3.5])
def test_unknown_types_are_rejected(bad: object) -> None:
    with pytest.raises(TypeError):
        fg.as_data_type(bad)


def test_promotion_within_families() -> None:
    assert promote(DataType.HALF, DataType.FLOAT) is DataType.FLOAT
    assert promote(DataType.HALF, DataType.BFLOAT16) is DataType.FLOAT  # neither holds the other
    assert promote(DataType.INT8, DataType.INT32) is DataType.INT32
    assert promote(DataType.UINT8, DataType.INT8) is DataType.INT16
    for a, b in itertools.product(DataType, repeat=2):
        if a.is_float and b.is_float:
            assert promote(a, b) is promote(b, a)


def test_numpy_dtypes_are_accepted_wherever_a_data_type_is() -> None:
    g = fg.Graph(io_data_type=np.float16, intermediate_data_type=np.dtype("float32"), compute_data_type=np.float32)
    assert (g.io_data_type, g.intermediate_data_type, g.compute_data_type) == (DataType.HALF, DataType.FLOAT, DataType.FLOAT)
    x = g.tensor("x", [1, 2, 4, 4], data_type=np.float16)
    w = g.tensor("w", [2, 2, 3, 3]).set_data_type(np.dtype(np.float16))
    assert x.data_type is DataType.HALF and w.data_type is DataType.HALF
    s = g.scalar(2, data_type=np.float16)
    assert s.data_type is DataType.HALF and s.value == 2.0
    conv = g.conv_fprop(x, w, padding=[1, 1], compute_data_type=np.float32)
    red = g.reduction(conv, fg.ReductionMode.SUM, dim=[1, 2, 4, 4], compute_data_type=np.float32)
    pw = g.pointwise(red, s, mode=fg.PointwiseMode.MUL, compute_data_type=np.float32)
    m = g.matmul(pw, pw, compute_data_type=np.float32)
    pool = g.pooling(m, window=[2, 2], compute_data_type=np.float32)
    out = g.identity(pool).set_output(True).set_data_type(np.float32)
    g.validate()
    assert out.data_type is DataType.FLOAT
    assert g.node_by_name("conv_fprop_0").attrs.compute_data_type is DataType.FLOAT  # type: ignore[union-attr]
    assert g.node_by_name("matmul_0").attrs.compute_data_type is DataType.FLOAT  # type: ignore[union-attr]


# ---- strides_for ------------------------------------------------------------------------------------
# Logical axes from outermost to innermost in memory, written out by hand.
LAYOUTS = {
    "NC": (0, 1),
    "CN": (1, 0),
    "NCH": (0, 1, 2),
    "NCW": (0, 1, 2),
    "NHC": (0, 2, 1),
    "NWC": (0, 2, 1),
    "NCHW": (0, 1, 2, 3),
    "NHWC": (0, 2, 3, 1),
    "NCDHW": (0, 1, 2, 3, 4),
    "NDHWC": (0, 2, 3, 4, 1),
    "KC": (0, 1),
    "KCR": (0, 1, 2),
    "KRC": (0, 2, 1),
    "KCRS": (0, 1, 2, 3),
    "KRSC": (0, 2, 3, 1),
    "KCTRS": (0, 1, 2, 3, 4),
    "KTRSC": (0, 2, 3, 4, 1),
}


def packed_in_order(dims: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous buffer of the permuted dims, read logically."""
    buf = np.empty([dims[a] for a in order], dtype=np.int8)
    view = buf.transpose(np.argsort(order))
    return tuple(int(s) for s in view.strides)


@pytest.mark.parametrize("name,order", LAYOUTS.items())
def test_strides_for_each_layout_name(name: str, order: tuple[int, ...]) -> None:
    dims = (2, 3, 5, 7, 11)[: len(order)]
    expected = packed_in_order(dims, order)
    assert tuple(fg.strides_for(dims, name)) == expected
    assert tuple(fg.strides_for(dims, name.lower())) == expected
    # and a numpy array in that layout matches a tensor declared with those strides
    g = fg.Graph()
    arr = np.empty([dims[a] for a in order], np.float32).transpose(np.argsort(order))
    assert g.tensor_like(arr, "t").stride == list(expected)


def test_row_major_default() -> None:
    assert fg.strides_for([2, 3, 4]) == (12, 4, 1)
    assert fg.strides_for([2, 3, 4], "packed") == (12, 4, 1)
    g = fg.Graph(io_data_type="float")
    assert g.tensor("x", [2, 3, 4]).stride == [12, 4, 1]


@pytest.mark.parametrize("dims,name", [([2, 3, 4], "NHWC"), ([2, 3, 4, 5], "NCH"), ([2, 3, 4, 5], "NHWW"), ([2, 3], "XYZ")])
def test_strides_for_rejects_layouts_that_do_not_fit(dims: list[int], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        fg.strides_for(dims, name)


def test_layout_name_and_is_packed() -> None:
    dims = [2, 3, 4, 5]
    assert layout.layout_name(dims, fg.strides_for(dims, "NHWC")) == "NHWC"
    assert layout.layout_name(dims, fg.strides_for(dims, "NCHW")) == "NCHW"
    assert layout.is_packed(dims, fg.strides_for(dims, "NHWC"))
    assert not layout.is_packed(dims, [120, 20, 5, 1])  # gaps
    assert layout.layout_name(dims, [120, 20, 5, 1]) is None


# ---- overlap detection, against brute force --------------------------------------------------------------
def offsets(dims: list[int], strides: list[int]) -> list[int]:
    axes = [range(d) for d in dims]
    return [sum(i * s for i, s in zip(idx, strides, strict=True)) for idx in itertools.product(*axes)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 13)), min_size=1, max_size=4))
def test_overlapping_axes_never_misses_an_overlap(axes: list[tuple[int, int]]) -> None:
    dims, strides = [d for d, _ in axes], [s for _, s in axes]
    live = [(d, s) for d, s in axes if s != 0]  # zero strides are broadcast, not overlap
    offs = offsets([d for d, _ in live], [s for _, s in live])
    aliased = len(set(offs)) != len(offs)
    pair = layout.overlapping_axes(dims, strides)
    if aliased:
        assert pair is not None, f"{dims} {strides} alias but were accepted"
    if pair is not None:
        a, b = pair
        assert dims[a] > 1 and dims[b] > 1 and strides[a] != 0 and strides[b] != 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=5), st.randoms(use_true_random=False))
def test_every_dense_permutation_is_accepted(dims: list[int], rnd: object) -> None:
    order = list(range(len(dims)))
    rnd.shuffle(order)  # type: ignore[attr-defined]
    strides = packed_in_order(tuple(dims), tuple(order))
    assert layout.overlapping_axes(dims, strides) is None
    assert layout.is_packed(dims, strides)
    offs = offsets(dims, list(strides))
    assert sorted(offs) == list(range(math.prod(dims)))


# ---- physical buffers -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["NCHW", "NHWC", "KRSC"])
def test_physical_round_trip(name: str, rng: np.random.Generator) -> None:
    dims = [2, 3, 4, 5]
    strides = fg.strides_for(dims, name)
    logical = rng.standard_normal(dims)
    arr = layout.empty_strided(dims, strides, np.float64)
    assert [s // 8 for s in arr.strides] == list(strides)
    arr[...] = logical
    phys = layout.to_physical(arr, dims, strides)
    assert phys.flags.c_contiguous
    assert phys.shape == layout.physical_shape(dims, strides)
    np.testing.assert_array_equal(layout.from_physical(phys, dims, strides), logical)


def test_physical_shape_of_broadcast_axes_is_one() -> None:
    dims, strides = [4, 3, 2], [0, 1, 0]
    assert layout.physical_shape(dims, strides) == (3, 1, 1)
    view = np.broadcast_to(np.arange(3.0)[None, :, None], dims)
    phys = layout.to_physical(view, dims, strides)
    assert phys.size == 3 and sorted(phys.reshape(-1)) == [0.0, 1.0, 2.0]
