"""Variant packs: keys by name or TensorAttr, outputs written in place (any declared layout),
missing outputs returned in their declared layout, and every malformed pack a
VariantPackError naming the tensor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import fusegraph as fg
from fusegraph import DataType, VariantPackError

F16, F32 = DataType.HALF, DataType.FLOAT


def nhwc(arr: np.ndarray) -> np.ndarray:
    """The same logical NCHW array stored channels-last."""
    return np.ascontiguousarray(arr.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


def conv_graph() -> tuple[fg.Graph, dict[str, fg.TensorAttr]]:
    """conv(x NHWC, w) + b -> z (declared NCHW) -> relu -> y (declared NHWC)."""
    g = fg.Graph(name="vp", io_data_type=F32)
    xd, wd = [2, 3, 5, 4], [4, 3, 3, 3]
    x = g.tensor("x", xd, fg.strides_for(xd, "NHWC"))
    w = g.tensor("w", wd)
    b = g.tensor("b", [1, 4, 1, 1])
    z = g.bias(g.conv_fprop(x, w, padding=[1, 1], name="conv"), b, name="bias")
    z.set_name("z").set_output(True).set_stride(fg.strides_for([2, 4, 5, 4], "NCHW"))
    y = g.relu(z, name="relu").set_name("y").set_output(True)
    y.set_stride(fg.strides_for([2, 4, 5, 4], "NHWC"))
    g.validate()
    return g, {"x": x, "w": w, "b": b, "z": z, "y": y}


def expected(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """conv (padding 1) + bias by direct loops over the definition, in float64."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    n, _, h, wd = x64.shape
    k = w64.shape[0]
    xp = np.pad(x64, ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((n, k, h, wd))
    for i in range(h):
        for j in range(wd):
            out[:, :, i, j] = np.einsum("ncrs,kcrs->nk", xp[:, :, i : i + 3, j : j + 3], w64)
    return out + b.astype(np.float64)


def inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "x": nhwc(rng.standard_normal((2, 3, 5, 4)).astype(np.float32)),
        "w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
        "b": rng.standard_normal((1, 4, 1, 1)).astype(np.float32),
    }


def rel(out: np.ndarray, ref: np.ndarray) -> float:
    assert np.isfinite(out).all()
    return float(np.linalg.norm(out.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))  # all-zero ReLU: exact


def element_strides(a: np.ndarray) -> list[int]:
    return [s // a.itemsize for s in a.strides]


# ---- what a pack may hold --------------------------------------------------------------------------
def test_keys_by_name_and_by_tensor_give_the_same_result(rng: np.random.Generator) -> None:
    g, t = conv_graph()
    arrs = inputs(rng)
    by_name = g.execute(arrs, engine="reference")
    by_attr = g.execute({t[k]: v for k, v in arrs.items()}, engine="reference")
    mixed = g.execute({"x": arrs["x"], t["w"]: arrs["w"], "b": arrs["b"]}, engine="reference")
    assert set(by_name) == {"y", "z"}
    for key in ("y", "z"):
        np.testing.assert_array_equal(by_name[key], by_attr[key])
        np.testing.assert_array_equal(by_name[key], mixed[key])
    ref = expected(arrs["x"], arrs["w"], arrs["b"])
    assert rel(by_name["z"], ref) <= 1e-5
    assert rel(by_name["y"], np.maximum(ref, 0)) <= 1e-5


def test_missing_outputs_come_back_in_their_declared_layout(rng: np.random.Generator) -> None:
    g, t = conv_graph()
    res = g.execute(inputs(rng), engine="reference")
    y, z = res["y"], res["z"]
    assert t["y"].stride == [80, 1, 16, 4]  # NHWC, as declared
    assert element_strides(y) == t["y"].stride
    assert element_strides(z) == t["z"].stride == [80, 20, 4, 1]
    assert y.dtype == np.float32 and z.dtype == np.float32


def test_outputs_in_the_pack_are_written_in_place_nhwc(rng: np.random.Generator) -> None:
    g, t = conv_graph()
    arrs = inputs(rng)
    y = nhwc(np.full((2, 4, 5, 4), np.nan, np.float32))
    z = np.full((2, 4, 5, 4), np.nan, np.float32)
    base_y = y.base
    res = g.execute({**arrs, "y": y, t["z"]: z}, engine="reference")
    assert res == {}
    assert y.base is base_y and element_strides(y) == t["y"].stride
    ref = expected(arrs["x"], arrs["w"], arrs["b"])
    assert rel(z, ref) <= 1e-5
    assert rel(y, np.maximum(ref, 0)) <= 1e-5


def test_only_the_missing_output_is_returned(rng: np.random.Generator) -> None:
    g, _ = conv_graph()
    z = np.empty((2, 4, 5, 4), np.float32)
    res = g.execute({**inputs(rng), "z": z}, engine="reference")
    assert set(res) == {"y"}
    np.testing.assert_array_equal(res["y"], np.maximum(z, 0))


def test_results_are_cast_to_each_output_dtype(rng: np.random.Generator) -> None:
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [3, 4])
    y16 = g.identity(x, name="as_half").set_output(True).set_data_type(F16)
    yi = g.floor(x, name="as_int").set_output(True).set_data_type(np.int32)
    xa = rng.uniform(-5, 5, (3, 4)).astype(np.float32)
    res = g.execute({x: xa}, engine="reference")
    assert res[y16.name].dtype == np.float16 and res[yi.name].dtype == np.int32
    np.testing.assert_array_equal(res[y16.name], xa.astype(np.float16))
    np.testing.assert_array_equal(res[yi.name], np.floor(xa).astype(np.int32))


def test_broadcast_input_accepts_a_stride0_view(rng: np.random.Generator) -> None:
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [4, 3])
    b = g.tensor("b", [4, 3], [0, 1])  # one row, shared by all four
    y = g.add(x, b).set_output(True)
    xa = rng.standard_normal((4, 3)).astype(np.float32)
    row = rng.standard_normal(3).astype(np.float32)
    out = g.execute({x: xa, b: np.broadcast_to(row, (4, 3))}, engine="reference")[y.name]
    np.testing.assert_allclose(out, xa + row, rtol=1e-6)


def test_size_one_axes_may_have_any_stride(rng: np.random.Generator) -> None:
    """A length-1 axis is never stepped over, so its stride cannot matter."""
    g = fg.Graph(io_data_type=F32)
    b = g.tensor("b", [1, 4, 1, 1])
    y = g.neg(b).set_output(True)
    arr = rng.standard_normal((4, 1, 1, 1)).astype(np.float32).transpose(1, 0, 2, 3)  # odd strides
    np.testing.assert_array_equal(g.execute({b: arr}, engine="reference")[y.name], -arr)


def test_an_output_that_feeds_another_node_is_both_returned_and_used(rng: np.random.Generator) -> None:
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [5])
    mid = g.exp(x, name="e").set_output(True)
    out = g.log(mid, name="l").set_output(True)
    xa = rng.uniform(-1, 1, 5).astype(np.float32)
    res = g.execute({x: xa}, engine="reference")
    np.testing.assert_allclose(res[mid.name], np.exp(xa.astype(np.float64)), rtol=1e-6)
    np.testing.assert_allclose(res[out.name], xa, rtol=1e-5, atol=1e-7)


# ---- malformed packs ----------------------------------------------------------------------------------------
def _pack(rng: np.random.Generator) -> tuple[fg.Graph, dict[str, fg.TensorAttr], dict[Any, Any]]:
    g, t = conv_graph()
    return g, t, dict(inputs(rng))


def missing_input(g: fg.Graph, t: dict[str, fg.TensorAttr], p: dict[Any, Any]) -> None:
    del p["w"]


def wrong_shape(g: fg.Graph, t: dict[str, fg.TensorAttr], p: dict[Any, Any]) -> None:
    p["b"] = np.zeros((4,), np.float32)


def wrong_dtype(g: fg.Graph, t: dict[str, fg.TensorAttr], p: dict[Any, Any]) -> None:
    p["w"] = p["w"].astype(np.float64)


def wrong_layout(g: fg.Graph, t: dict[str, fg.TensorAttr], p: dict[Any, Any]) -> None:
    p["x"] = np.ascontiguousarray(p["x"])  # NCHW data for an NHWC tensor


def reversed_strides(g: fg.Graph, t: dict[str, fg.TensorAttr], p: dict[Any, Any]) -> None:
    p["w"] = np.ascontiguousarray(p["w"][::-1])[::-1]  # negative strides


def broadcast_view_for_dense_input(g: fg.Graph, t: dict[str, fg.TensorAttr], p: dict[Any, Any]) -> None:
    p["w"] = np.broadcast_to(p["w"][:1], (4, 3, 3, 3))


def unknown_name(g: fg.Graph, t: dict[str, fg.TensorAttr], p: dict[Any, Any]) -> None:
    p["bias_typo"] = p["b"]


def tensor_of_another_graph(g: fg.Graph, t: dict[str, fg.TensorAttr], p: dict[Any, Any]) -> None:
    other, _ = conv_graph()
    p[other.tensor_by_name("b").set_name("stranger")] = p["b"]


def virtual_tensor(g: fg.Graph, t: dict[str, fg.TensorAttr], p: dict[Any, Any]) -> None:
    p[g.node_by_name("conv").outputs["y"]] = np.zeros((2, 4, 5, 4), np.float32)


def scalar_constant(g: fg.Graph, t: dict[str, fg.TensorAttr], p: dict[Any, Any]) -> None:
    h = fg.Graph(io_data_type=F32)
    x = h.tensor("x", [2])
    s = h.scalar(2.0)
    h.mul(x, s).set_output(True)
    p.clear()
    p.update({"x": np.ones(2, np.float32), s: np.ones(1, np.float32)})
    raise _Swap(h, s.name)


def unused_tensor(g: fg.Graph, t: dict[str, fg.TensorAttr], p: dict[Any, Any]) -> None:
    h = fg.Graph(io_data_type=F32)
    x, spare = h.tensor("x", [2]), h.tensor("spare", [2])
    h.neg(x).set_output(True)
    p.clear()
    p.update({x: np.ones(2, np.float32), spare: np.ones(2, np.float32)})
    raise _Swap(h, "spare")


def read_only_output(g: fg.Graph, t: dict[str, fg.TensorAttr], p: dict[Any, Any]) -> None:
    out = np.zeros((2, 4, 5, 4), np.float32)
    out.flags.writeable = False
    p["z"] = out


def output_wrong_layout(g: fg.Graph, t: dict[str, fg.TensorAttr], p: dict[Any, Any]) -> None:
    p["y"] = np.zeros((2, 4, 5, 4), np.float32)  # y is NHWC


def output_wrong_dtype(g: fg.Graph, t: dict[str, fg.TensorAttr], p: dict[Any, Any]) -> None:
    p["z"] = np.zeros((2, 4, 5, 4), np.float16)


def not_an_array(g: fg.Graph, t: dict[str, fg.TensorAttr], p: dict[Any, Any]) -> None:
    p["b"] = "zeros please"


def nested_list(g: fg.Graph, t: dict[str, fg.TensorAttr], p: dict[Any, Any]) -> None:
    p["b"] = [[[[0.0]]] * 4]


class _Swap(Exception):
    """Used by a mutation that needs a graph of its own: (graph, expected tensor name)."""

    def __init__(self, graph: fg.Graph, name: str) -> None:
        self.graph, self.name = graph, name


PACK_CASES: list[tuple[str, Callable[..., None], str, tuple[str, ...]]] = [
    ("missing_input", missing_input, "w", ("missing",)),
    ("wrong_shape", wrong_shape, "b", ("[4]", "[1, 4, 1, 1]")),
    ("wrong_dtype", wrong_dtype, "w", ("float64", "FLOAT")),
    ("unknown_name", unknown_name, "bias_typo", ("no tensor",)),
    ("tensor_of_another_graph", tensor_of_another_graph, "stranger", ("another graph",)),
    ("virtual_tensor", virtual_tensor, "conv::y", ("virtual",)),
    ("scalar_constant", scalar_constant, "", ("scalar",)),
    ("unused_tensor", unused_tensor, "", ("not read",)),
    ("read_only_output", read_only_output, "z", ("read-only",)),
    ("output_wrong_layout", output_wrong_layout, "y", ("strides",)),
    ("output_wrong_dtype", output_wrong_dtype, "z", ("float16",)),
    ("not_an_array", not_an_array, "b", ("str",)),
    ("nested_list", nested_list, "b", ("list",)),
]


@pytest.mark.parametrize("case", PACK_CASES, ids=[c[0] for c in PACK_CASES])
def test_malformed_pack_raises_variant_pack_error_naming_the_tensor(
    case: tuple[str, Callable[..., None], str, tuple[str, ...]], rng: np.random.Generator
) -> None:
    _, mutate, name, words = case
    g, t, pack = _pack(rng)
    try:
        mutate(g, t, pack)
    except _Swap as swap:
        g, name = swap.graph, swap.name
    with pytest.raises(VariantPackError) as info:
        g.execute(pack, engine="reference")
    msg = str(info.value)
    assert type(info.value) is VariantPackError
    assert info.value.tensor == name and f"'{name}'" in msg, msg
    for w in words:
        assert w in msg, f"{w!r} not in: {msg}"


def test_pack_must_be_a_mapping(rng: np.random.Generator) -> None:
    g, _ = conv_graph()
    with pytest.raises(VariantPackError, match="mapping"):
        g.execute([("x", np.zeros(1))], engine="reference")  # type: ignore[arg-type]


def test_pack_key_of_wrong_type(rng: np.random.Generator) -> None:
    g, _, pack = _pack(rng)
    pack[7] = pack["b"]
    with pytest.raises(VariantPackError, match="int"):
        g.execute(pack, engine="reference")


def test_a_failed_pack_writes_nothing(rng: np.random.Generator) -> None:
    """Checking happens before running: no output is half-written by a rejected pack."""
    g, _, pack = _pack(rng)
    z = np.full((2, 4, 5, 4), 7.0, np.float32)
    pack["z"] = z
    pack["b"] = pack["b"].astype(np.float16)
    with pytest.raises(VariantPackError):
        g.execute(pack, engine="reference")
    assert (z == 7.0).all()


@pytest.mark.parametrize("mutate", [wrong_layout, reversed_strides, broadcast_view_for_dense_input],
                         ids=["other_layout", "negative_strides", "broadcast_view_for_dense"])
def test_input_views_in_another_layout_are_copied_as_declared(
    mutate: Callable[..., None], rng: np.random.Generator
) -> None:
    """Issue 16 (one input contract): an input array of the right dims and dtype in any
    layout is taken, laid out as declared by fusegraph (not refused); outputs stay strict."""
    from fusegraph.graph.layout import empty_strided

    g, t, pack = _pack(rng)
    mutate(g, t, pack)
    declared = {}
    for name, v in pack.items():
        tt = g.tensor_by_name(name)
        if tt in g.inputs():
            d = empty_strided(tt.shape, tt.strides, v.dtype)
            d[...] = v
            declared[name] = d
        else:
            declared[name] = v
    got = g.execute({k: v for k, v in pack.items() if g.tensor_by_name(k) in g.inputs()}, engine="reference")
    want = g.execute({k: v for k, v in declared.items() if g.tensor_by_name(k) in g.inputs()}, engine="reference")
    assert got.keys() == want.keys() and got
    for k in got:
        np.testing.assert_array_equal(got[k], want[k])
