"""The gather op (ONNX Gather) and its backward (embedding backward): the builder, shape
inference and its typed errors, JSON, the float64 reference against PyTorch (an
independent implementation) on fresh random data -- negative indices and axes other than
0 included --, the torch engine against the reference, and the engines that do not run it
refusing with their reasons."""

from __future__ import annotations

import numpy as np
import pytest

import fusegraph as fg
from fusegraph import DataType as DT
from fusegraph.errors import ExecutionError, ValidationError
from fusegraph.graph.ops import INDEXING, OpKind
from fusegraph.reference.inputs import random_inputs

CPU = fg.Handle("cpu")
TOL = {DT.FLOAT: 1e-5, DT.HALF: 1e-2, DT.BFLOAT16: 2e-2, DT.DOUBLE: 1e-12}


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert g.shape == w.shape, (g.shape, w.shape)
    assert not np.isnan(g).any() and not np.isnan(w).any(), "NaN never passes"
    return float(np.linalg.norm(g - w) / max(float(np.linalg.norm(w)), 1e-30))


def _gather_graph(data: list[int], idx: list[int], axis: int, dt: DT = DT.FLOAT, it: DT = DT.INT64) -> fg.Graph:
    g = fg.Graph("gather")
    y = g.gather(g.tensor("data", data, data_type=dt), g.tensor("ids", idx, data_type=it), axis=axis)
    y.set_output(True)
    return g.validate()


def _backward_graph(dy: list[int], idx: list[int], rows: int, padding_idx: int | None, dt: DT = DT.FLOAT,
                    it: DT = DT.INT64) -> fg.Graph:
    g = fg.Graph("gather_bwd")
    d = g.gather_backward(g.tensor("dy", dy, data_type=dt), g.tensor("ids", idx, data_type=it), rows, padding_idx)
    d.set_output(True)
    return g.validate()


def _ids(rng: np.random.Generator, shape: list[int], rows: int, dtype: type = np.int64) -> np.ndarray:
    """Random indices over [-rows, rows), the first one always negative (wrapping is
    tested every run), repeats likely."""
    ids = rng.integers(-rows, rows, shape).astype(dtype)
    ids.flat[0] = -int(rng.integers(1, rows + 1))
    return ids


# ---- graph API -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("data", "idx", "axis", "want"), [
    ([10, 4], [2, 3], 0, [2, 3, 4]),
    ([5, 6, 7], [4], 1, [5, 4, 7]),
    ([5, 6, 7], [2, 3], -1, [5, 6, 2, 3]),
    ([5, 6, 7], [1], -3, [1, 6, 7]),
    ([9], [3, 2, 2], 0, [3, 2, 2]),
])
def test_output_dims_follow_onnx(data: list[int], idx: list[int], axis: int, want: list[int]) -> None:
    g = _gather_graph(data, idx, axis)
    (y,) = g.outputs()
    assert y.dim == want and y.data_type == DT.FLOAT
    assert g.nodes[0].kind == OpKind.GATHER


def test_backward_dims_and_type() -> None:
    g = _backward_graph([2, 3, 8], [2, 3], 11, 4, DT.HALF)
    (d,) = g.outputs()
    assert d.dim == [11, 8] and d.data_type == DT.HALF


def test_gather_keeps_integer_and_boolean_data() -> None:
    for dt in (DT.INT32, DT.INT64, DT.BOOLEAN, DT.HALF):
        (y,) = _gather_graph([6, 2], [3], 0, dt).outputs()
        assert y.data_type == dt


@pytest.mark.parametrize("it", [DT.FLOAT, DT.INT8, DT.BOOLEAN, DT.HALF])
def test_indices_must_be_int32_or_int64(it: DT) -> None:
    with pytest.raises(ValidationError, match="INT32 or INT64") as err:
        _gather_graph([5, 4], [3], 0, it=it)
    assert err.value.tensor == "ids" and err.value.node == "gather_0"
    with pytest.raises(ValidationError, match="INT32 or INT64") as err:
        _backward_graph([3, 4], [3], 5, None, it=it)
    assert err.value.tensor == "ids"


@pytest.mark.parametrize("axis", [2, -3, 7])
def test_axis_out_of_range(axis: int) -> None:
    with pytest.raises(ValidationError, match=f"axis {axis} is out of range for data of rank 2") as err:
        _gather_graph([5, 4], [3], axis)
    assert err.value.tensor == "data" and err.value.node == "gather_0"


@pytest.mark.parametrize("bad", [1.0, True, "0", None])
def test_non_integer_attributes_are_refused(bad: object) -> None:
    g = fg.Graph("g")
    d, i = g.tensor("d", [5, 4], data_type=DT.FLOAT), g.tensor("i", [3], data_type=DT.INT64)
    with pytest.raises(ValidationError, match="must be an integer"):
        g.gather(d, i, axis=bad)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="must be an integer"):
        g.gather_backward(d, i, num_rows=bad)  # type: ignore[arg-type]


def test_gather_backward_refusals_name_the_culprit() -> None:
    g = fg.Graph("g")
    dy, i = g.tensor("dy", [3, 4], data_type=DT.FLOAT), g.tensor("i", [3], data_type=DT.INT64)
    g.gather_backward(dy, i, 5, axis=1, name="bw").set_output(True)
    with pytest.raises(ValidationError, match="axis 0 only") as err:
        g.validate()
    assert err.value.node == "bw"
    with pytest.raises(ValidationError, match="num_rows must be >= 1"):
        _backward_graph([3, 4], [3], 0, None)
    with pytest.raises(ValidationError, match="padding_idx 5 is out of range for 5 rows"):
        _backward_graph([3, 4], [3], 5, 5)
    with pytest.raises(ValidationError, match=r"must start with the indices' dims \[2, 3\]") as err:
        _backward_graph([3, 2, 4], [2, 3], 5, None)
    assert err.value.tensor == "dy"
    with pytest.raises(ValidationError, match="at least one more"):
        _backward_graph([2, 3], [2, 3], 5, None)
    with pytest.raises(ValidationError, match="dy must be floating-point") as err:
        _backward_graph([3, 4], [3], 5, None, DT.INT32)
    assert err.value.tensor == "dy"


def test_constant_index_out_of_range_is_a_validation_error() -> None:
    g = fg.Graph("g")
    d = g.tensor("d", [5, 4], data_type=DT.FLOAT)
    k = g.scalar(5, DT.INT64)
    g.gather(d, k).set_output(True)
    with pytest.raises(ValidationError, match=r"constant index 5 is out of range.*\[-5, 5\)") as err:
        g.validate()
    assert err.value.tensor == k.name
    g2 = fg.Graph("g2")
    y = g2.gather(g2.tensor("d", [5, 4], data_type=DT.FLOAT), g2.scalar(-5, DT.INT64))
    y.set_output(True)
    g2.validate()
    assert y.dim == [1, 4]


def test_json_round_trip_keeps_the_attributes() -> None:
    g = fg.Graph("g")
    d = g.tensor("d", [5, 6, 4], data_type=DT.FLOAT)
    i = g.tensor("i", [2, 3], data_type=DT.INT32)
    g.gather(d, i, axis=-2).set_output(True)
    g.gather_backward(g.tensor("dy", [2, 3, 7], data_type=DT.HALF), i, 9, padding_idx=-2).set_output(True)
    g.gather_backward(g.tensor("dy2", [2, 3, 7], data_type=DT.FLOAT), i, 9).set_output(True)
    g.validate()
    back = fg.Graph.from_json(g.to_json()).validate()
    assert [n.attrs for n in back.nodes] == [n.attrs for n in g.nodes]
    assert back.key() == g.key()
    assert [t.dim for t in back.outputs()] == [[5, 2, 3, 4], [9, 7], [9, 7]]


# ---- the reference against PyTorch ---------------------------------------------------------------
torch = pytest.importorskip("torch", reason="the reference is checked against PyTorch's indexing and autograd")


@pytest.mark.parametrize(("data", "idx", "axis"), [
    ([13, 8], [4, 5], 0),
    ([6, 9, 5], [7], 1),
    ([4, 5, 6], [2, 3, 2], -1),
    ([3, 4, 5, 2], [6], 2),
])
def test_reference_gather_against_torch(data: list[int], idx: list[int], axis: int, rng: np.random.Generator) -> None:
    g = _gather_graph(data, idx, axis, DT.DOUBLE)
    x = rng.standard_normal(data)
    ids = _ids(rng, idx, data[axis])
    got = g.execute({"data": x, "ids": ids}, engine="reference")[g.outputs()[0].name]
    ax = axis % len(data)
    wrapped = torch.from_numpy(np.where(ids < 0, ids + data[ax], ids))
    want = torch.index_select(torch.from_numpy(x), ax, wrapped.reshape(-1))
    want = want.reshape(*data[:ax], *idx, *data[ax + 1:]).numpy()
    assert np.array_equal(got, want)


@pytest.mark.parametrize("padding_idx", [None, 3, -1])
def test_reference_gather_backward_against_torch_autograd(padding_idx: int | None, rng: np.random.Generator) -> None:
    rows, dim, idx = 17, 6, [5, 7]
    ids = rng.integers(0, rows, idx)  # torch's embedding takes no negative index
    ids[0, :3] = ids[1, 0]  # repeats sum
    if padding_idx is not None:
        ids[1, 1] = padding_idx % rows
    dy = rng.standard_normal((*idx, dim))
    g = _backward_graph([*idx, dim], idx, rows, padding_idx, DT.DOUBLE)
    got = g.execute({"dy": dy, "ids": ids}, engine="reference")[g.outputs()[0].name]
    w = torch.zeros(rows, dim, dtype=torch.float64, requires_grad=True)
    pad = None if padding_idx is None else padding_idx % rows
    torch.nn.functional.embedding(torch.from_numpy(ids), w, padding_idx=pad).backward(torch.from_numpy(dy))
    assert w.grad is not None
    assert _rel(got, w.grad.numpy()) < 1e-12
    if pad is not None:
        assert not got[pad].any()


def test_reference_backward_wraps_negative_indices(rng: np.random.Generator) -> None:
    rows = 6
    ids = _ids(rng, [9], rows)
    dy = rng.standard_normal((9, 3))
    g = _backward_graph([9, 3], [9], rows, None, DT.DOUBLE)
    got = g.execute({"dy": dy, "ids": ids}, engine="reference")[g.outputs()[0].name]
    want = torch.zeros(rows, 3, dtype=torch.float64).index_add_(
        0, torch.from_numpy(np.where(ids < 0, ids + rows, ids)), torch.from_numpy(dy))
    assert _rel(got, want.numpy()) < 1e-12


@pytest.mark.parametrize("bad", [5, -6, 2**40])
def test_reference_out_of_range_index_names_the_tensor(bad: int, rng: np.random.Generator) -> None:
    g = _gather_graph([5, 4], [3], 0)
    ids = np.array([0, bad, 1], np.int64)
    with pytest.raises(ExecutionError, match=r"out of range \[-5, 5\)") as err:
        g.execute({"data": rng.standard_normal((5, 4)).astype(np.float32), "ids": ids}, engine="reference")
    assert err.value.tensor == "ids" and err.value.node == "gather_0"
    gb = _backward_graph([3, 4], [3], 5, None)
    with pytest.raises(ExecutionError, match="out of range") as err:
        gb.execute({"dy": rng.standard_normal((3, 4)).astype(np.float32), "ids": ids}, engine="reference")
    assert err.value.tensor == "ids"


def test_random_inputs_draw_indices_in_range() -> None:
    g = fg.Graph("g")
    i = g.tensor("i", [400], data_type=DT.INT32)
    g.gather(g.tensor("d", [4, 9], data_type=DT.FLOAT), i).set_output(True)
    g.gather(g.tensor("e", [2, 3], data_type=DT.FLOAT), i, axis=1).set_output(True)
    g.validate()
    ids = random_inputs(g, np.random.default_rng(1))["i"]
    assert ids.dtype == np.int32 and ids.min() == -3 and ids.max() == 2  # the smaller axis (3) bounds both


# ---- the torch engine against the reference -------------------------------------------------------
from fusegraph.engines import torch as torch_engine  # noqa: E402

ENGINE = torch_engine.TorchEngine()


def _check_engine(g: fg.Graph, pack: dict[str, np.ndarray], tol: float) -> None:
    assert ENGINE.supports(g, CPU), ENGINE.supports(g, CPU).reason
    got = ENGINE.build(g, CPU).execute(pack)
    ref = g.execute(pack, engine="reference")
    for t in g.outputs():
        o, r = got[t.name], ref[t.name]
        assert o.shape == r.shape and o.dtype == r.dtype and o.strides == r.strides, (o.shape, o.dtype, r.dtype)
        if not t.dtype.is_float:
            assert np.array_equal(o, r)
        else:
            assert _rel(o, r) <= tol


@pytest.mark.parametrize("it", [DT.INT32, DT.INT64])
@pytest.mark.parametrize("dt", [DT.FLOAT, DT.HALF, DT.BFLOAT16, DT.INT32, DT.BOOLEAN])
@pytest.mark.parametrize(("data", "idx", "axis"), [([50, 16], [4, 7], 0), ([3, 11, 5], [6], -2), ([4, 3, 6], [2, 2, 3], 2)])
def test_torch_engine_gather(data: list[int], idx: list[int], axis: int, dt: DT, it: DT, rng: np.random.Generator) -> None:
    g = _gather_graph(data, idx, axis, dt, it)
    pack = random_inputs(g, rng)
    pack["data"] = (rng.standard_normal(data) * 3).astype(dt.numpy) if dt != DT.BOOLEAN else rng.random(data) < 0.5
    pack["ids"] = _ids(rng, idx, data[axis], it.numpy)
    _check_engine(g, pack, TOL.get(dt, 0.0))


@pytest.mark.parametrize("padding_idx", [None, 0, -3])
@pytest.mark.parametrize("dt", [DT.FLOAT, DT.HALF, DT.BFLOAT16])
def test_torch_engine_gather_backward(dt: DT, padding_idx: int | None, rng: np.random.Generator) -> None:
    rows, idx = 23, [6, 9]
    g = _backward_graph([*idx, 12], idx, rows, padding_idx, dt, DT.INT32)
    pack = {"dy": rng.standard_normal((*idx, 12)).astype(dt.numpy), "ids": _ids(rng, idx, rows, np.int32)}
    _check_engine(g, pack, TOL[dt])


def test_torch_engine_out_of_range_index_is_an_execution_error(rng: np.random.Generator) -> None:
    g = _gather_graph([5, 4], [3], 0)
    plan = ENGINE.build(g, CPU)
    with pytest.raises(ExecutionError, match="out of bounds"):
        plan.execute({"data": rng.standard_normal((5, 4)).astype(np.float32), "ids": np.array([0, 9, 1])})


def test_embedding_then_layer_norm_selected_like_any_graph(rng: np.random.Generator) -> None:
    """Selection on the CPU with no engine named: the engines that cannot run gather are
    passed over with their reasons, and the plan's output matches the reference."""
    g = fg.Graph("emb", io_data_type=DT.FLOAT)
    table = g.tensor("table", [40, 8])
    ids = g.tensor("ids", [3, 5], data_type=DT.INT64)
    e = g.reshape(g.gather(table, ids), [15, 8])
    y, _, _ = g.layernorm(e, g.tensor("s", [1, 8]), g.tensor("b", [1, 8]), 1e-5)
    y.set_output(True)
    g.validate()
    pack = random_inputs(g, rng)
    got = g.build(CPU).execute(pack)
    ref = g.execute(pack, engine="reference")
    assert _rel(got[y.name], ref[y.name]) < 1e-4


# ---- engines that do not run it ------------------------------------------------------------------
def test_other_engines_refuse_gather_with_a_reason() -> None:
    from fusegraph.engines.cudnn import rules as cudnn_rules
    from fusegraph.engines.iree.emit import unsupported_reason
    from fusegraph.engines.triton.rows import Refusal, analyze
    from fusegraph.engines.unsupported import declared_unsupported

    for g in (_gather_graph([5, 4], [3], 0), _backward_graph([3, 4], [3], 5, 1)):
        kind = g.nodes[0].kind.value
        assert f"no {kind} (indexing) node" in (cudnn_rules.refusal(g) or "")
        assert f"no lowering for {kind}" in (unsupported_reason(g) or "")
        with pytest.raises(Refusal, match="row kernel takes pointwise ops"):
            sm = fg.Graph.from_json(g.to_json())
            out = sm.outputs()[0]
            out.set_output(False)
            sm.softmax(out).set_output(True)
            analyze(sm.validate())
        for engine in ("iree", "cudnn", "triton"):
            why = declared_unsupported(engine, g)
            assert why is not None and f"({kind})" in why
        assert declared_unsupported("torch", g) is None and declared_unsupported("reference", g) is None
    assert {OpKind.GATHER, OpKind.GATHER_BACKWARD} == INDEXING


def test_regions_take_gather_as_an_anchor() -> None:
    from fusegraph.regions import split

    g = fg.Graph("r", io_data_type=DT.FLOAT)
    e = g.gather(g.tensor("t", [30, 8]), g.tensor("i", [2, 4], data_type=DT.INT64))
    y = g.add(e, g.tensor("p", [2, 4, 8]))
    y.set_output(True)
    s = split(g.validate())
    assert [r.pattern for r in s.regions] == ["gather", "triton.pointwise"] and not s.rejected


# ---- CUDA (the GPU machine) -------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dt", [DT.FLOAT, DT.HALF, DT.BFLOAT16])
def test_torch_engine_on_cuda(dt: DT, rng: np.random.Generator) -> None:
    """Gather and its backward on a CUDA handle against the reference, chosen by selection
    (cudnn, triton and IREE refuse them), negative ids included."""
    gpu = fg.Handle("cuda:0")
    for g, pack in (
        (_gather_graph([300, 64], [8, 128], 0, dt),
         {"data": rng.standard_normal((300, 64)).astype(dt.numpy), "ids": _ids(rng, [8, 128], 300)}),
        (_gather_graph([6, 40, 8], [5], -2, dt, DT.INT32),
         {"data": rng.standard_normal((6, 40, 8)).astype(dt.numpy), "ids": _ids(rng, [5], 40, np.int32)}),
        (_backward_graph([8, 128, 64], [8, 128], 300, 1, dt),
         {"dy": rng.standard_normal((8, 128, 64)).astype(dt.numpy), "ids": _ids(rng, [8, 128], 300)}),
    ):
        got = g.build(gpu).execute(pack)
        ref = g.execute(pack, engine="reference")
        for t in g.outputs():
            assert _rel(got[t.name], ref[t.name]) <= TOL[dt], (g.name, t.name)
