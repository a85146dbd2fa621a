"""ONNX Gather on fusegraph: an embedding table (constant data) looked up by ids fed at run
time becomes the graph's gather op and is claimed; so is a gather of an activation by an
index input, at any axis, with int32 or int64 ids and negative ones; constant indices stay
slices (and shape Gathers are still folded). Every result is compared with ONNX Runtime
on fresh random data."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import fusegraph.onnx as fgo
from fusegraph.graph.ops import OpKind
from fusegraph.onnx.units import FusegraphUnit

pytest.importorskip("torch", reason="the torch engine runs gather on a compiling path")

F, I32, I64 = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64


def _model(nodes: Sequence[onnx.NodeProto], inputs: Mapping[str, tuple[int, Sequence[int]]],
           outputs: Mapping[str, tuple[int, Sequence[int]]], inits: Mapping[str, np.ndarray] | None = None) -> onnx.ModelProto:
    graph = helper.make_graph(
        list(nodes), "m",
        [helper.make_tensor_value_info(n, t, list(s)) for n, (t, s) in inputs.items()],
        [helper.make_tensor_value_info(n, t, list(s)) for n, (t, s) in outputs.items()],
        [onnx.numpy_helper.from_array(a, n) for n, a in (inits or {}).items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _session(model: onnx.ModelProto, engine: str, **opts: Any) -> fgo.InferenceSession:
    options = {"engine": engine, "torch_mlir_tier": "off", "floor": "off", "strict": 1, **opts}
    return fgo.InferenceSession(model.SerializeToString(), providers=[(fgo.PROVIDER, options), "CPUExecutionProvider"])


def _ort(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert g.shape == w.shape and not np.isnan(g).any() and not np.isnan(w).any()
    return float(np.linalg.norm(g - w) / max(float(np.linalg.norm(w)), 1e-30))


def _gather_kinds(sess: fgo.InferenceSession) -> list[OpKind]:
    """The op kinds of every graph node of the session's fusegraph units."""
    return [n.kind for plan in sess._plans.values() for u in plan.units if isinstance(u, FusegraphUnit)
            for n in u.graph.nodes]


def _embedding_model(rng: np.random.Generator, vocab: int, dim: int, ids_shape: list[int], it: int) -> onnx.ModelProto:
    """BERT's embedding block, shrunk: word + position embeddings, then a LayerNorm."""
    seq = ids_shape[-1]
    nodes = [
        helper.make_node("Gather", ["word", "ids"], ["we"], axis=0),
        helper.make_node("Add", ["we", "pos"], ["e"]),
        helper.make_node("LayerNormalization", ["e", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5),
    ]
    inits = {
        "word": rng.standard_normal((vocab, dim)).astype(np.float32),
        "pos": rng.standard_normal((seq, dim)).astype(np.float32),
        "gamma": rng.uniform(0.5, 1.5, dim).astype(np.float32),
        "beta": rng.standard_normal(dim).astype(np.float32),
    }
    return _model(nodes, {"ids": (it, ids_shape)}, {"y": (F, [*ids_shape, dim])}, inits)


@pytest.mark.parametrize("engine", ["torch", "reference"])
@pytest.mark.parametrize("it", [I64, I32])
def test_embedding_lookup_claimed_and_equal_to_onnxruntime(engine: str, it: int, rng: np.random.Generator) -> None:
    vocab, dim, shape = 97, 16, [3, 12]
    model = _embedding_model(rng, vocab, dim, shape, it)
    ids = rng.integers(0, vocab, shape).astype(np.int64 if it == I64 else np.int32)
    ids[0, 0] = -1  # ONNX wraps a negative id: the last row
    feed = {"ids": ids}
    want = _ort(model, feed)
    sess = _session(model, engine)
    rep = sess.partition_report()
    assert not rep.unclaimed, [(u.op_type, u.reason) for u in rep.unclaimed]
    assert len(rep.subgraphs) == 1 and "Gather" in rep.subgraphs[0].op_types
    assert OpKind.GATHER in _gather_kinds(sess)
    (got,) = sess.run(None, feed)
    assert _rel(got, want[0]) < 1e-5
    ids2 = rng.integers(-vocab, vocab, shape).astype(ids.dtype)  # new ids, same session
    (got2,) = sess.run(None, {"ids": ids2})
    assert _rel(got2, _ort(model, {"ids": ids2})[0]) < 1e-5


@pytest.mark.parametrize(("data", "idx", "axis"), [([4, 7, 5], [3, 2], 1), ([4, 7, 5], [6], -1), ([6, 3], [2, 2, 2], 0)])
def test_gather_of_an_activation_by_an_index_input(data: list[int], idx: list[int], axis: int,
                                                   rng: np.random.Generator) -> None:
    """Gather of a computed value (Relu(x)) by indices fed at run time, any axis."""
    ax = axis % len(data)
    out = [*data[:ax], *idx, *data[ax + 1:]]
    model = _model([
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Gather", ["r", "i"], ["g"], axis=axis),
        helper.make_node("Neg", ["g"], ["y"]),
    ], {"x": (F, data), "i": (I64, idx)}, {"y": (F, out)})
    feed = {"x": rng.standard_normal(data).astype(np.float32), "i": rng.integers(-data[ax], data[ax], idx)}
    want = _ort(model, feed)
    sess = _session(model, "torch")
    assert not sess.partition_report().unclaimed
    (got,) = sess.run(None, feed)
    assert _rel(got, want[0]) < 1e-5


def test_constant_indices_stay_slices(rng: np.random.Generator) -> None:
    """A few arithmetic runs of constant indices: slices and a concat (every engine runs
    them), no gather node; past the run limit: a gather of the constant indices."""
    few = np.array([0, 2, 4, 5], np.int64)
    many = rng.permutation(80)[:60].astype(np.int64)
    for idx, kind in ((few, OpKind.SLICE), (many, OpKind.GATHER)):
        model = _model([
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Gather", ["r", "i"], ["y"], axis=1),
        ], {"x": (F, [2, 80])}, {"y": (F, [2, idx.size])}, {"i": idx})
        feed = {"x": rng.standard_normal((2, 80)).astype(np.float32)}
        sess = _session(model, "torch")
        assert not sess.partition_report().unclaimed
        kinds = _gather_kinds(sess)
        assert kind in kinds and (kind == OpKind.GATHER) == (OpKind.GATHER in kinds), kinds
        (got,) = sess.run(None, feed)
        assert _rel(got, _ort(model, feed)[0]) < 1e-5


def test_shape_gather_is_still_folded(rng: np.random.Generator) -> None:
    model = _model([
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Shape", ["r"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "ax0"], ["nu"]),
        helper.make_node("Concat", ["nu", "minus1"], ["shape"], axis=0),
        helper.make_node("Reshape", ["r", "shape"], ["y"]),
    ], {"x": (F, [3, 4, 5])}, {"y": (F, [3, 20])}, {
        "i0": np.array(0, np.int64), "ax0": np.array([0], np.int64), "minus1": np.array([-1], np.int64)})
    feed = {"x": rng.standard_normal((3, 4, 5)).astype(np.float32)}
    sess = _session(model, "torch")
    rep = sess.partition_report()
    assert rep.folded_nodes >= 4 and not rep.unclaimed and OpKind.GATHER not in _gather_kinds(sess)
    (got,) = sess.run(None, feed)
    assert _rel(got, _ort(model, feed)[0]) < 1e-5


def test_an_engine_without_gather_leaves_it_to_onnxruntime_with_its_reason(rng: np.random.Generator, iree_cache_dir: Any,
                                                                            iree_engine: None) -> None:
    model = _embedding_model(rng, 31, 8, [2, 5], I64)
    sess = _session(model, "iree")
    reasons = {u.op_type: u.reason for u in sess.partition_report().unclaimed}
    assert set(reasons) == {"Gather"} and "no lowering for gather" in reasons["Gather"], reasons
    feed = {"ids": rng.integers(0, 31, (2, 5))}
    (got,) = sess.run(None, feed)
    assert _rel(got, _ort(model, feed)[0]) < 1e-5


@pytest.mark.gpu
def test_embedding_claimed_on_cuda(rng: np.random.Generator) -> None:
    """On a GPU session the lookup runs on the device (a gather region on the torch engine),
    not on ONNX Runtime's CPU provider."""
    model = _embedding_model(rng, 1000, 64, [8, 128], I64)
    feed = {"ids": rng.integers(-1000, 1000, (8, 128))}
    sess = fgo.InferenceSession(model.SerializeToString(),
                                providers=[(fgo.PROVIDER, {"device": "cuda:0", "floor": "off"})])
    (got,) = sess.run(None, feed)
    rep = sess.partition_report()
    assert rep.coverage == 1.0 and not rep.unclaimed, [(u.op_type, u.reason) for u in rep.unclaimed]
    assert _rel(got, _ort(model, feed)[0]) < 1e-4


@pytest.mark.parametrize("bad", [97, -98])
def test_ids_out_of_the_tables_range_are_a_typed_error_naming_the_input(bad: int, rng: np.random.Generator) -> None:
    """Ids fed from the host are checked against the table they index before anything runs
    (on CUDA an out-of-range id would be a device-side assert that poisons the context):
    the error names the input, the node and the valid range; in-range negative ids run."""
    from fusegraph.onnx.ort_errors import InvalidFeedError

    model = _embedding_model(rng, 97, 8, [2, 5], I64)
    sess = _session(model, "torch")
    ids = rng.integers(0, 97, (2, 5)).astype(np.int64)
    ids[0, 0] = -97  # the first row, counted from the end: valid
    got = sess.run(None, {"ids": ids})[0]
    assert _rel(got, _ort(model, {"ids": ids})[0]) < 1e-5
    ids[1, 3] = bad
    with pytest.raises(InvalidFeedError) as info:
        sess.run(None, {"ids": ids})
    assert info.value.tensor == "ids"
    assert f"index {bad} is out of range" in str(info.value) and "97 rows" in str(info.value) and "[-97, 97)" in str(info.value)
