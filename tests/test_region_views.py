"""Border reshapes folded into views (fusegraph/regions/views.py): the layer norm a
PyTorch converter emits for [B, S, F] -- rows reshaped in, weight and bias reshaped to
[1, F], the result reshaped back and cast -- loses every reshape node, and the folded
plan, fed and read through views, gives the float64 reference's answer of the original
graph on fresh random data. Golden text fixes what the folded graph holds."""

from __future__ import annotations

import numpy as np
import pytest

import fusegraph as fg
from fusegraph.graph.ops import OpKind
from fusegraph.regions.views import FoldedPlan, fold_border_reshapes, sink_reshapes

B, S, F = 2, 3, 8


def _ln_graph() -> fg.Graph:
    g = fg.Graph("ln3d", io_data_type=fg.DataType.FLOAT)
    x, w, b = g.tensor("x", [B, S, F]), g.tensor("w", [F]), g.tensor("b", [F])
    rows = g.reshape(x, [B * S, F])
    y, mean, inv = g.layernorm(rows, g.reshape(w, [1, F]), g.reshape(b, [1, F]), 1e-5, fg.NormFwdPhase.TRAINING)
    assert mean is not None and inv is not None
    back = g.reshape(y, [B, S, F])
    g.mul(back, g.scalar(2.0, fg.DataType.FLOAT)).set_output(True).set_name("out")
    g.reshape(mean, [B, S, 1]).set_output(True).set_name("mean")
    g.reshape(inv, [B, S, 1]).set_output(True).set_name("rstd")
    return g.validate()


def test_inner_reshape_moves_past_a_scalar_op() -> None:
    sunk = sink_reshapes(_ln_graph())
    kinds = [n.kind for n in sunk.nodes]
    # the reshape back to [B, S, F] now follows the multiply by 2 and writes the output
    i = kinds.index(OpKind.LAYERNORM)
    assert kinds[i + 1] == OpKind.POINTWISE and kinds[-3:].count(OpKind.RESHAPE) >= 1
    out = next(n for n in sunk.nodes if "out" in [t.name for t in n.outputs.values()])
    assert out.kind == OpKind.RESHAPE


def test_every_border_reshape_folds_and_the_answer_is_the_originals(rng: np.random.Generator) -> None:
    g = _ln_graph()
    folded = fold_border_reshapes(g)
    assert folded is not None
    assert [n.kind for n in folded.graph.nodes] == [OpKind.LAYERNORM, OpKind.POINTWISE]
    assert sorted((src, shape) for _, src, shape in folded.feeds) == [
        ("b", (1, F)), ("w", (1, F)), ("x", (B * S, F))]
    assert sorted((name, shape) for name, _, shape in folded.results) == [
        ("mean", (B, S, 1)), ("out", (B, S, F)), ("rstd", (B, S, 1))]
    feed = {"x": rng.standard_normal((B, S, F)).astype(np.float32),
            "w": rng.standard_normal(F).astype(np.float32), "b": rng.standard_normal(F).astype(np.float32)}
    want = g.build(engine="reference").execute(feed)
    inner = folded.graph.build(engine="reference")
    got = FoldedPlan(g, folded, inner).execute(feed)
    assert set(got) == set(want)
    for k in want:
        w64, g64 = np.asarray(want[k], np.float64), np.asarray(got[k], np.float64)
        assert g64.shape == w64.shape and np.isfinite(g64).all()
        assert np.linalg.norm(g64 - w64) / np.linalg.norm(w64) <= 1e-6, k


def test_nothing_to_fold_is_none() -> None:
    g = fg.Graph("plain", io_data_type=fg.DataType.FLOAT)
    g.relu(g.tensor("x", [4, 4])).set_output(True).set_name("y")
    assert fold_border_reshapes(g.validate()) is None


@pytest.mark.parametrize("strided", [False, True])
def test_a_non_packed_reshape_result_is_not_folded(strided: bool) -> None:
    """A reshape whose result is declared in a non-packed layout is no view: it stays."""
    g = fg.Graph("t", io_data_type=fg.DataType.FLOAT)
    x = g.tensor("x", [4, 6])
    r = g.reshape(x, [6, 4])
    if strided:
        r.set_stride([1, 6])
    g.relu(r).set_output(True).set_name("y")
    folded = fold_border_reshapes(g.validate())
    assert (folded is None) == strided


def test_a_reshape_nobody_reads_is_dropped(rng: np.random.Generator) -> None:
    """Inference reads no statistics: their reshapes back to PyTorch's shapes read nothing
    and write nothing anyone reads, and must not keep the region from a kernel engine."""
    g = fg.Graph("ln_infer", io_data_type=fg.DataType.FLOAT)
    x, w, b = g.tensor("x", [B, S, F]), g.tensor("w", [F]), g.tensor("b", [F])
    y, mean, inv = g.layernorm(g.reshape(x, [B * S, F]), g.reshape(w, [1, F]), g.reshape(b, [1, F]), 1e-5,
                               fg.NormFwdPhase.TRAINING)
    assert mean is not None and inv is not None
    g.reshape(mean, [B, S, 1])
    g.reshape(inv, [B, S, 1])
    g.reshape(y, [B, S, F]).set_output(True).set_name("out")
    g.validate()
    folded = fold_border_reshapes(g)
    assert folded is not None and [n.kind for n in folded.graph.nodes] == [OpKind.LAYERNORM]
    feed = {"x": rng.standard_normal((B, S, F)).astype(np.float32),
            "w": rng.standard_normal(F).astype(np.float32), "b": rng.standard_normal(F).astype(np.float32)}
    want = g.build(engine="reference").execute(feed)["out"]
    got = FoldedPlan(g, folded, folded.graph.build(engine="reference")).execute(feed)["out"]
    assert got.shape == want.shape
    assert np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want) <= 1e-6


def test_output_buffers_passed_in_the_pack_get_the_results(rng: np.random.Generator) -> None:
    g = _ln_graph()
    folded = fold_border_reshapes(g)
    assert folded is not None
    feed = {"x": rng.standard_normal((B, S, F)).astype(np.float32),
            "w": rng.standard_normal(F).astype(np.float32), "b": rng.standard_normal(F).astype(np.float32)}
    want = g.build(engine="reference").execute(feed)["out"]
    buf = np.full((B, S, F), np.nan, np.float32)
    got = FoldedPlan(g, folded, folded.graph.build(engine="reference")).execute({**feed, "out": buf})
    assert got["out"] is buf and np.isfinite(buf).all()
    assert np.linalg.norm(buf - want) / np.linalg.norm(want) <= 1e-6


def test_a_dead_reshape_that_also_casts_is_dropped_a_live_one_is_kept() -> None:
    """PyTorch's half-precision layer norm: float32 statistics reshaped (and cast) to the
    input's type. Nobody reading them, they go; read out, the cast is no view and stays."""
    for read_out in (False, True):
        g = fg.Graph("ln_half", io_data_type=fg.DataType.HALF, intermediate_data_type=fg.DataType.FLOAT)
        x, w, b = g.tensor("x", [B * S, F]), g.tensor("w", [1, F]), g.tensor("b", [1, F])
        y, mean, _ = g.layernorm(x, w, b, 1e-5, fg.NormFwdPhase.TRAINING)
        y.set_data_type(fg.DataType.HALF)  # as the converter types it: PyTorch's result type
        assert mean is not None and mean.data_type == fg.DataType.FLOAT
        stat = g.reshape(mean, [B, S, 1]).set_data_type(fg.DataType.HALF)
        if read_out:
            stat.set_output(True).set_name("mean")
        g.reshape(y, [B, S, F]).set_output(True).set_name("out")
        folded = fold_border_reshapes(g.validate())
        assert folded is not None
        kinds = [n.kind for n in folded.graph.nodes]
        assert kinds == ([OpKind.LAYERNORM, OpKind.RESHAPE] if read_out else [OpKind.LAYERNORM]), kinds


def _ln_transposed(read_inside: bool = False) -> fg.Graph:
    """ViT-B/16's first layer norm as the ONNX door lowers it: [B, S, F] rows reshaped in,
    normalized, reshaped back and transposed to [S, B, F] for the attention after it."""
    g = fg.Graph("ln_t", io_data_type=fg.DataType.FLOAT)
    x, w, b = g.tensor("x", [B, S, F]), g.tensor("w", [1, F]), g.tensor("b", [1, F])
    y, _, _ = g.layernorm(g.reshape(x, [B * S, F]), w, b, 1e-5)
    back = g.reshape(y, [B, S, F])
    g.transpose(back, [1, 0, 2]).set_output(True).set_name("out")
    if read_inside:
        g.relu(back).set_output(True).set_name("other")
    return g.validate()


@pytest.mark.parametrize("array", ["numpy", "torch"])
def test_an_output_transpose_folds_into_a_permuted_view_where_asked(rng: np.random.Generator, array: str) -> None:
    g = _ln_transposed()
    assert fold_border_reshapes(g) is not None and OpKind.TRANSPOSE in [
        n.kind for n in fold_border_reshapes(g).graph.nodes]  # type: ignore[union-attr]  # not asked: it stays
    folded = fold_border_reshapes(g, transposes=True)
    assert folded is not None
    assert [n.kind for n in folded.graph.nodes] == [OpKind.LAYERNORM]  # a row kernel's graph
    assert folded.permuted == (("out", (1, 0, 2)),)
    feed = {"x": rng.standard_normal((B, S, F)).astype(np.float32),
            "w": rng.standard_normal((1, F)).astype(np.float32), "b": rng.standard_normal((1, F)).astype(np.float32)}
    want = g.build(engine="reference").execute(feed)["out"]
    if array == "torch":
        torch = pytest.importorskip("torch")
        inner = folded.graph.build(engine="torch")
        got = FoldedPlan(g, folded, inner).execute({k: torch.from_numpy(v) for k, v in feed.items()})["out"]
        assert tuple(got.shape) == (S, B, F) and not got.is_contiguous()  # a view, no copy
        got = got.numpy()
    else:
        got = FoldedPlan(g, folded, folded.graph.build(engine="reference")).execute(feed)["out"]
    assert got.shape == (S, B, F)
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=1e-5, atol=1e-5)


def test_a_transpose_whose_input_is_read_inside_stays() -> None:
    folded = fold_border_reshapes(_ln_transposed(read_inside=True), transposes=True)
    assert folded is not None and folded.permuted == ()
    assert OpKind.TRANSPOSE in [n.kind for n in folded.graph.nodes]
