"""ONNX Runtime's contrib RotaryEmbedding on fusegraph (fusegraph/onnx/ops/rotary.py): each
tiny model (one node, opset 17 + com.microsoft 1) runs through fusegraph.onnx.InferenceSession
against ONNX Runtime's CPU kernel on fresh random data -- half-split and interleaved, full and
partial rotary_embedding_dim, [batch, seq, hidden] and [batch, heads, seq, head] input,
position_ids [batch, seq] and the one-element start offset, fed at run time or constant --
and must be claimed; the forms it does not lower must name why in the partition report."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import fusegraph.onnx as fgo
from fusegraph.errors import FusegraphError
from fusegraph.graph.ops import OpKind
from fusegraph.onnx.units import FusegraphUnit

pytest.importorskip("torch", reason="the torch engine is one of the two engines compared")

B, H, S, D, MAXPOS = 2, 3, 5, 8, 24


def _model(xdims: Sequence[int], ids_dims: Sequence[int] | None, half: int, rng: np.random.Generator,
           *, elem: int = TensorProto.FLOAT, const_ids: np.ndarray | None = None, const_caches: bool = True,
           maxpos: int = MAXPOS, **attrs: Any) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One RotaryEmbedding node and a random feed; caches are initializers unless told."""
    dt = np.float32 if elem == TensorProto.FLOAT else np.float16
    node = helper.make_node("RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"], domain="com.microsoft", **attrs)
    # real caches (cos/sin of position x frequency) so that fp16 keeps its range
    freq = 1.0 / 10000 ** (np.arange(half) / max(half, 1))
    ang = np.arange(maxpos)[:, None] * freq[None, :]
    caches = {"cos": np.cos(ang).astype(dt), "sin": np.sin(ang).astype(dt)}
    ins = [helper.make_tensor_value_info("x", elem, list(xdims))]
    feed = {"x": rng.standard_normal(xdims).astype(dt)}
    inits = dict(caches) if const_caches else {}
    if not const_caches:
        ins += [helper.make_tensor_value_info(k, elem, [maxpos, half]) for k in caches]
        feed.update(caches)
    if const_ids is not None:
        inits["pos"] = const_ids
    else:
        assert ids_dims is not None
        ins.append(helper.make_tensor_value_info("pos", TensorProto.INT64, list(ids_dims)))
        seq = xdims[2] if len(xdims) == 4 else xdims[1]
        feed["pos"] = (rng.integers(0, maxpos, ids_dims) if len(ids_dims) == 2
                       else np.full(ids_dims, rng.integers(0, maxpos - seq + 1))).astype(np.int64)
    graph = helper.make_graph([node], "rope", ins, [helper.make_tensor_value_info("y", elem, list(xdims))],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    ops = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=ops, ir_version=8), feed


def _session(model: onnx.ModelProto, engine: str = "reference") -> fgo.InferenceSession:
    options = {"engine": engine, "torch_mlir_tier": "off", "floor": "off", "strict": 1}
    return fgo.InferenceSession(model.SerializeToString(), providers=[(fgo.PROVIDER, options), "CPUExecutionProvider"])


def _ort(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    out = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    return np.asarray(out[0])


def _err(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """(||got - want|| / ||want||, max |got - want|); NaN never passes."""
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert g.shape == w.shape and np.isfinite(g).all() and np.isfinite(w).all()
    return float(np.linalg.norm(g - w) / max(float(np.linalg.norm(w)), 1e-30)), float(np.abs(g - w).max())


def _kinds(sess: fgo.InferenceSession) -> list[OpKind]:
    return [n.kind for plan in sess._plans.values() for u in plan.units if isinstance(u, FusegraphUnit)
            for n in u.graph.nodes]


def _claimed_and_equal(model: onnx.ModelProto, feed: dict[str, np.ndarray], engine: str, tol: float = 1e-5) -> fgo.InferenceSession:
    want = _ort(model, feed)
    sess = _session(model, engine)
    rep = sess.partition_report()
    assert not rep.unclaimed, [(u.op_type, u.reason) for u in rep.unclaimed]
    assert rep.subgraphs[0].fusions.get("rotary.embedding") == 1
    (got,) = sess.run(None, feed)
    rel, big = _err(got, want)
    assert rel <= tol and big <= 50 * tol * max(float(np.abs(want).max()), 1.0), (rel, big)
    return sess


@pytest.mark.parametrize("engine", ["reference", "torch"])
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rot", [0, 6], ids=["full", "partial"])
@pytest.mark.parametrize("bnsh", [False, True], ids=["3d", "4d"])
@pytest.mark.parametrize("ids_dims", [[B, S], [1]], ids=["ids", "offset"])
def test_rotary_embedding_claimed_and_equal_to_onnxruntime(engine: str, interleaved: int, rot: int, bnsh: bool,
                                                           ids_dims: list[int], rng: np.random.Generator) -> None:
    xdims = [B, H, S, D] if bnsh else [B, S, H * D]
    attrs: dict[str, Any] = {"interleaved": interleaved}
    if rot or not bnsh:
        attrs["num_heads"] = H
    if rot:
        attrs["rotary_embedding_dim"] = rot
    model, feed = _model(xdims, ids_dims, (rot or D) // 2, rng, **attrs)
    sess = _claimed_and_equal(model, feed, engine)
    kinds = _kinds(sess)
    assert OpKind.GATHER in kinds and OpKind.CONCATENATE in kinds  # run-time ids: the rows are gathered
    # new positions, same session
    feed2 = dict(feed)
    feed2["pos"] = (rng.integers(0, MAXPOS, ids_dims) if len(ids_dims) == 2 else np.array([MAXPOS - S])).astype(np.int64)
    (got,) = sess.run(None, feed2)
    assert _err(got, _ort(model, feed2))[0] <= 1e-5


@pytest.mark.parametrize("form", ["ids", "offset"])
def test_constant_position_ids_fold_the_rows(form: str, rng: np.random.Generator) -> None:
    """Constant ids and caches: the rows are constants (no gather); constant ids with caches
    fed at run time: a gather of the fed caches by the constant ids."""
    ids = rng.integers(0, MAXPOS, (B, S)) if form == "ids" else np.array([rng.integers(0, MAXPOS - S + 1)])
    for const_caches in (True, False):
        model, feed = _model([B, S, H * D], None, D // 2, rng, const_ids=ids.astype(np.int64),
                             const_caches=const_caches, num_heads=H, interleaved=1)
        sess = _claimed_and_equal(model, feed, "reference")
        assert (OpKind.GATHER in _kinds(sess)) != const_caches


def test_query_and_key_rotated_in_one_partition(rng: np.random.Generator) -> None:
    """Two nodes (q and k) reading one start offset and one pair of caches, then a reader
    of both: one fusegraph partition holding both rotations."""
    model, feed = _model([B, S, H * D], [1], D // 2, rng, num_heads=H)
    g = model.graph
    g.node.append(helper.make_node("RotaryEmbedding", ["k", "pos", "cos", "sin"], ["yk"], domain="com.microsoft",
                                   num_heads=H))
    g.node.append(helper.make_node("Mul", ["y", "yk"], ["z"]))
    g.input.append(helper.make_tensor_value_info("k", TensorProto.FLOAT, [B, S, H * D]))
    g.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [B, S, H * D]))
    feed["k"] = rng.standard_normal((B, S, H * D)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    sess = _session(model, "torch")
    rep = sess.partition_report()
    assert not rep.unclaimed and len(rep.subgraphs) == 1 and rep.subgraphs[0].fusions.get("rotary.embedding") == 2
    for got, w in zip(sess.run(None, feed), want, strict=True):
        assert _err(got, w)[0] <= 1e-5


def test_float16_against_onnxruntime(rng: np.random.Generator) -> None:
    model, feed = _model([B, S, H * D], [B, S], D // 2, rng, elem=TensorProto.FLOAT16, num_heads=H)
    _claimed_and_equal(model, feed, "torch", tol=1e-2)


def test_position_past_the_caches_is_an_error_not_garbage(rng: np.random.Generator) -> None:
    model, feed = _model([B, S, H * D], [B, S], D // 2, rng, num_heads=H)
    sess = _session(model, "reference")
    assert not sess.partition_report().unclaimed
    feed["pos"][1, 2] = MAXPOS
    with pytest.raises(FusegraphError, match=r"ind(ex|ices)"):
        sess.run(None, feed)


def test_negative_position_is_a_typed_error_as_onnxruntime_refuses_it(rng: np.random.Generator) -> None:
    """ONNX Runtime rejects a negative position id; the session checks host-fed ids against
    the caches' rows and raises InvalidFeedError naming the input and the node."""
    from fusegraph.onnx.ort_errors import InvalidFeedError

    model, feed = _model([B, S, H * D], [B, S], D // 2, rng, num_heads=H)
    feed["pos"][0, 1] = -1
    with pytest.raises(Exception):  # noqa: B017  (ONNX Runtime's own error type)
        _ort(model, feed)
    sess = _session(model, "torch")
    with pytest.raises(InvalidFeedError, match=r"index -1 is out of range.*\[0, 24\)") as info:
        sess.run(None, feed)
    assert info.value.tensor == "pos"


@pytest.mark.parametrize(("attrs", "half", "ids_dims", "reason"), [
    ({"num_heads": H, "is_packed_batching": 1}, D // 2, [B, S], "is_packed_batching=1"),
    ({"num_heads": H, "scale": 0.5}, D // 2, [B, S], "scale=0.5"),
    ({"num_heads": H, "rotary_embedding_dim": 4}, D // 2, [B, S], "caches [max_position, 2]"),
    ({"num_heads": H}, D // 2, [], "rank-0"),
])
def test_forms_not_lowered_name_the_reason(attrs: dict[str, Any], half: int, ids_dims: list[int], reason: str,
                                           rng: np.random.Generator) -> None:
    """Each stays on ONNX Runtime with the reason; the session's answer is ONNX Runtime's."""
    model, feed = _model([B, S, H * D], ids_dims, half, rng, **attrs)
    sess = _session(model)
    (u,) = sess.partition_report().unclaimed
    assert u.op_type == "RotaryEmbedding" and reason in u.reason, u.reason
    (got,) = sess.run(None, feed)
    assert _err(got, _ort(model, feed))[0] <= 1e-6


def test_on_iree_runtime_ids_stay_on_onnxruntime_constant_ids_run(rng: np.random.Generator, iree_cache_dir: Any,
                                                                    iree_engine: None) -> None:
    """IREE has no gather: run-time position ids leave the node to ONNX Runtime, saying so;
    constant ids fold the rows, and IREE runs the rotation."""
    model, feed = _model([B, S, H * D], [B, S], D // 2, rng, num_heads=H)
    sess = _session(model, "iree")
    (u,) = sess.partition_report().unclaimed
    assert u.op_type == "RotaryEmbedding" and "no lowering for gather" in u.reason, u.reason
    assert _err(sess.run(None, feed)[0], _ort(model, feed))[0] <= 1e-6
    model, feed = _model([B, H, S, D], None, 3, rng, const_ids=np.array([2]), num_heads=H, rotary_embedding_dim=6,
                         interleaved=1)
    _claimed_and_equal(model, feed, "iree")


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_embedding_claimed_on_cuda(interleaved: int, rng: np.random.Generator) -> None:
    """On a GPU session the gather and the rotation run on the device, not on ONNX Runtime's
    CPU provider."""
    b, heads, seq, head = 4, 8, 64, 64
    # ONNX Runtime 1.32 refuses caches shorter than the sequence ("updating cos_cache ... not supported")
    model, feed = _model([b, seq, heads * head], [b, seq], head // 2, rng, num_heads=heads, interleaved=interleaved,
                         maxpos=2 * seq)
    want = _ort(model, feed)
    sess = fgo.InferenceSession(model.SerializeToString(),
                                providers=[(fgo.PROVIDER, {"device": "cuda:0", "floor": "off"})])
    (got,) = sess.run(None, feed)
    rep = sess.partition_report()
    assert rep.coverage == 1.0 and not rep.unclaimed, [(u.op_type, u.reason) for u in rep.unclaimed]
    assert _err(got, want)[0] <= 1e-5


# ---- the default domain's RotaryEmbedding (opset 23): (X, cos_cache, sin_cache, position_ids?)
def _model23(xdims: Sequence[int], rng: np.random.Generator, *, ids: bool = True, rot: int = 0,
             **attrs: Any) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    heads = attrs.get("num_heads") or xdims[1]
    head = (xdims[2] // heads) if len(xdims) == 3 else xdims[3]
    seq = xdims[1] if len(xdims) == 3 else xdims[2]
    half = (rot or head) // 2
    freq = 1.0 / 10000 ** (np.arange(half) / max(half, 1))
    if ids:
        ang = np.arange(MAXPOS)[:, None] * freq[None, :]
    else:  # the rows themselves, one per (batch, position)
        ang = rng.integers(0, MAXPOS, (xdims[0], seq))[..., None] * freq
    caches = {"cos": np.cos(ang).astype(np.float32), "sin": np.sin(ang).astype(np.float32)}
    if rot:
        attrs["rotary_embedding_dim"] = rot
    inputs = ["x", "cos", "sin"] + (["pos"] if ids else [])
    node = helper.make_node("RotaryEmbedding", inputs, ["y"], **attrs)
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(xdims))]
    feed = {"x": rng.standard_normal(xdims).astype(np.float32)}
    if ids:
        ins.append(helper.make_tensor_value_info("pos", TensorProto.INT64, [xdims[0], seq]))
        feed["pos"] = rng.integers(0, MAXPOS, (xdims[0], seq)).astype(np.int64)
    graph = helper.make_graph([node], "rope23", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(xdims))],
                              [numpy_helper.from_array(v, k) for k, v in caches.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10), feed


@pytest.mark.parametrize(("xdims", "attrs", "rot", "ids"), [
    ([B, S, H * D], {"num_heads": H}, 0, True),
    ([B, S, H * D], {"num_heads": H, "interleaved": 1}, 0, True),
    ([B, H, S, D], {}, 0, True),
    ([B, H, S, D], {"interleaved": 1}, 4, True),
    ([B, S, H * D], {"num_heads": H}, 6, False),
    ([B, H, S, D], {}, 0, False),
])
def test_opset23_rotary_embedding_against_onnxruntime(xdims: list[int], attrs: dict[str, Any], rot: int, ids: bool,
                                                       rng: np.random.Generator) -> None:
    model, feed = _model23(xdims, rng, ids=ids, rot=rot, **attrs)
    for engine in ("reference", "torch"):
        sess = _session(model, engine)
        rep = sess.partition_report()
        assert not rep.unclaimed, [(u.op_type, u.reason) for u in rep.unclaimed]
        assert _err(sess.run(None, feed)[0], _ort(model, feed))[0] <= 1e-5


def test_opset23_forms_not_lowered_name_the_reason(rng: np.random.Generator) -> None:
    """A [batch, seq, hidden] input without num_heads: ONNX Runtime cannot split the heads
    either; the node stays unclaimed with the reason."""
    model, _ = _model23([B, S, H * D], rng, num_heads=H)
    for a in model.graph.node[0].attribute:
        if a.name == "num_heads":
            a.i = 0
    sess = _session(model)
    (u,) = sess.partition_report().unclaimed
    assert u.op_type == "RotaryEmbedding" and "needs num_heads" in u.reason, u.reason


def test_opset23_negative_position_is_a_typed_error(rng: np.random.Generator) -> None:
    from fusegraph.onnx.ort_errors import InvalidFeedError

    model, feed = _model23([B, S, H * D], rng, num_heads=H)
    feed["pos"][1, 0] = -2
    with pytest.raises(InvalidFeedError, match=r"index -2 is out of range") as info:
        _session(model, "torch").run(None, feed)
    assert info.value.tensor == "pos"
