"""Attention patterns of transformer exports (fusegraph/onnx/patterns_attention.py) and ONNX
Runtime's contrib attention ops (fusegraph/onnx/ops/gemm.py): each small graph runs through
fusegraph.onnx.InferenceSession on the CPU against ONNX Runtime on fresh random inputs, the
fused graph's ops are compared with a golden list, and each near-miss must not fuse, with the
reason in the partition report. The tiny transformer exports in tests/data report how many
patterns they hold."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import fusegraph.onnx as fgo
from fusegraph.engines.registry import REGISTRY
from fusegraph.graph.ops import OpKind, SdpaAttrs
from fusegraph.onnx.units import FusegraphUnit

F = TensorProto.FLOAT
DATA = Path(__file__).parent / "data"
B, H, S, D = 2, 4, 8, 16


def _model(nodes: Sequence[onnx.NodeProto], inputs: Mapping[str, Sequence[int]], outputs: Mapping[str, Sequence[int]],
           inits: Mapping[str, np.ndarray] | None = None, *, contrib: bool = False, opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(
        list(nodes), "m",
        [helper.make_tensor_value_info(n, F, list(s)) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, F, list(s)) for n, s in outputs.items()],
        [numpy_helper.from_array(v, k) for k, v in (inits or {}).items()],
    )
    ops = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)] if contrib else [])
    return helper.make_model(graph, opset_imports=ops, ir_version=8)


def _session(model: onnx.ModelProto, **opts: Any) -> fgo.InferenceSession:
    options = {"engine": "reference", "torch_mlir_tier": "off", "floor": "off", "strict": 1, **opts}
    return fgo.InferenceSession(model.SerializeToString(), providers=[(fgo.PROVIDER, options), "CPUExecutionProvider"])


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert g.shape == w.shape and not np.isnan(g).any() and not np.isnan(w).any()
    return float(np.linalg.norm(g - w) / max(float(np.linalg.norm(w)), 1e-30))


def _run(model: onnx.ModelProto, feed: Mapping[str, np.ndarray], **opts: Any) -> fgo.InferenceSession:
    """The session, after checking every output against ONNX Runtime (f32: 1e-4 relative)."""
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, dict(feed))
    sess = _session(model, **opts)
    got = sess.run(None, dict(feed))
    for g, w in zip(got, want, strict=True):
        assert _rel(g, w) <= 1e-4
        # max-abs beside the norm: f32 ONNX Runtime against the float64 reference on peaked softmaxes
        assert np.abs(np.asarray(g, np.float64) - w).max() <= 1e-3 * max(float(np.abs(w).max()), 1.0)
    return sess


def _engine(name: str) -> str:
    """``name``, or a skip saying why it cannot run here."""
    if name != "reference":
        try:
            ok = bool(REGISTRY.get(name).available())
        except Exception as exc:  # a broken engine is reported as the reason
            pytest.skip(f"engine {name} cannot be loaded here: {exc}")
        if not ok:
            pytest.skip(f"engine {name} is not available here")
    return name


ENGINES = ["reference", "torch"]


def _graphs(sess: fgo.InferenceSession) -> list[Any]:
    return [u.graph for plan in sess._plans.values() for u in plan.units if isinstance(u, FusegraphUnit)]


def _kinds(sess: fgo.InferenceSession) -> list[str]:
    return [n.kind.value for g in _graphs(sess) for n in g.nodes]


def _sdpa(sess: fgo.InferenceSession) -> list[Any]:
    return [n for g in _graphs(sess) for n in g.nodes if n.kind == OpKind.SDPA]


def _x(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _c(v: float) -> np.ndarray:
    return np.array(v, dtype=np.float32)


def _key_mask(rng: np.random.Generator, masked_rows: bool = False, fill: float = -np.inf) -> np.ndarray:
    """An additive key-padding mask [B, 1, 1, S] (0 or ``fill``), the last keys masked in batch 0."""
    m = np.zeros((B, 1, 1, S), np.float32)
    m[0, ..., S - 3:] = fill
    if masked_rows:
        m[1] = -np.inf  # every key of batch 1 masked: its rows are all -inf
    return m


# ---- the export forms -----------------------------------------------------------------------
def _core(scale_nodes: list[onnx.NodeProto], scores: str) -> list[onnx.NodeProto]:
    return [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s0"]),
        *scale_nodes,
        helper.make_node("Add", [scores, "mask"], ["s2"]),
        helper.make_node("Softmax", ["s2"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["o"]),
    ]


QKV = {"q": (B, H, S, D), "k": (B, H, S, D), "v": (B, H, S, D), "mask": (B, 1, 1, S)}
OUT = {"o": (B, H, S, D)}


@pytest.mark.parametrize("engine", ENGINES)
def test_div_by_sqrt_d_with_a_mask_is_one_sdpa(rng: np.random.Generator, engine: str) -> None:
    m = _model(_core([helper.make_node("Div", ["s0", "c"], ["s1"])], "s1"), QKV, OUT, {"c": _c(math.sqrt(D))})
    feed = {"q": _x(rng, B, H, S, D), "k": _x(rng, B, H, S, D), "v": _x(rng, B, H, S, D), "mask": _key_mask(rng)}
    sess = _run(m, feed, engine=_engine(engine))
    assert _kinds(sess) == ["sdpa"]  # the Transpose of K is read through the sdpa node
    (node,) = _sdpa(sess)
    assert isinstance(node.attrs, SdpaAttrs) and not node.attrs.causal and "mask" in node.inputs
    assert node.attrs.attn_scale == pytest.approx(1 / math.sqrt(D), rel=1e-7)
    rep = sess.partition_report()
    assert rep.rewrites == {"onnx.attention.sdpa": 1} and rep.subgraphs[0].fusions == {"attention.sdpa": 1}
    assert rep.total_nodes == 6 and rep.subgraphs[0].op_types == {"Transpose": 1, "MatMul": 2, "Div": 1, "Add": 1, "Softmax": 1}


@pytest.mark.parametrize("engine", ENGINES)
def test_q_and_k_scaled_apart_with_the_nan_guard(rng: np.random.Generator, engine: str) -> None:
    """torch's scaled_dot_product_attention export (transformers' BERT): q and kᵀ each times
    d^-1/4, and Where(IsNaN(p), 0, p); a batch whose keys are all masked gives 0, as in ONNX."""
    c = _c(D ** -0.25)
    nodes = [
        helper.make_node("Mul", ["q0", "c"], ["q"]),
        helper.make_node("Transpose", ["k"], ["kt0"], perm=[0, 1, 3, 2]),
        helper.make_node("Mul", ["kt0", "c"], ["kt"]),
        helper.make_node("MatMul", ["q", "kt"], ["s0"]),
        helper.make_node("Add", ["s0", "mask"], ["s2"]),
        helper.make_node("Softmax", ["s2"], ["p0"], axis=-1),
        helper.make_node("IsNaN", ["p0"], ["nan"]),
        helper.make_node("Where", ["nan", "zero", "p0"], ["p"]),
        helper.make_node("MatMul", ["p", "v"], ["o"]),
    ]
    ins = {"q0": (B, H, S, D), "k": (B, H, S, D), "v": (B, H, S, D), "mask": (B, 1, 1, S)}
    m = _model(nodes, ins, OUT, {"c": c, "zero": _c(0.0)})
    feed = {"q0": _x(rng, B, H, S, D), "k": _x(rng, B, H, S, D), "v": _x(rng, B, H, S, D),
            "mask": _key_mask(rng, masked_rows=True)}
    sess = _run(m, feed, engine=_engine(engine))
    kinds = _kinds(sess)
    assert kinds.count("sdpa") == 1 and "matmul" not in kinds and "softmax" not in kinds
    (node,) = _sdpa(sess)
    assert node.attrs.attn_scale == pytest.approx(float(c) ** 2, rel=1e-7)
    (got,) = sess.run(None, feed)
    assert not np.isnan(got).any() and np.all(got[1] == 0.0)


def test_head_split_and_merge_around_attention(rng: np.random.Generator) -> None:
    """BERT's heads: [b, s, h*d] -> Reshape -> Transpose (K straight to [b, h, d, s] by
    perm [0, 2, 3, 1]) ... -> Transpose -> Reshape back; sdpa reads K as the head split's
    [0, 2, 1, 3]."""
    shp = {"to4": np.array([B, S, H, D], np.int64), "to3": np.array([B, S, H * D], np.int64)}
    nodes = [
        helper.make_node("Reshape", ["xq", "to4"], ["q4"]), helper.make_node("Transpose", ["q4"], ["q"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["xk", "to4"], ["k4"]), helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
        helper.make_node("Reshape", ["xv", "to4"], ["v4"]), helper.make_node("Transpose", ["v4"], ["v"], perm=[0, 2, 1, 3]),
        helper.make_node("MatMul", ["q", "kt"], ["s0"]),
        helper.make_node("Div", ["s0", "c"], ["s1"]),
        helper.make_node("Softmax", ["s1"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["o4"]),
        helper.make_node("Transpose", ["o4"], ["o3"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["o3", "to3"], ["o"]),
    ]
    ins = {n: (B, S, H * D) for n in ("xq", "xk", "xv")}
    m = _model(nodes, ins, {"o": (B, S, H * D)}, {"c": _c(math.sqrt(D)), **shp})
    sess = _run(m, {n: _x(rng, B, S, H * D) for n in ins})
    kinds = _kinds(sess)
    assert sorted(kinds) == sorted(["reshape"] * 4 + ["transpose"] * 4 + ["sdpa"])
    assert kinds[-3:] == ["sdpa", "transpose", "reshape"]
    (node,) = _sdpa(sess)
    k = node.inputs["k"]
    assert k.producer is not None and tuple(k.dim) == (B, H, S, D)


def test_constant_causal_mask_becomes_causal(rng: np.random.Generator) -> None:
    tri = np.where(np.tril(np.ones((S, S), bool)), 0.0, -np.inf).astype(np.float32)
    m = _model(_core([helper.make_node("Mul", ["s0", "c"], ["s1"])], "s1"),
               {k: v for k, v in QKV.items() if k != "mask"}, OUT, {"c": _c(0.125), "mask": tri})
    sess = _run(m, {n: _x(rng, B, H, S, D) for n in ("q", "k", "v")})
    (node,) = _sdpa(sess)
    assert node.attrs.causal and "mask" not in node.inputs and node.attrs.attn_scale == 0.125
    # a constant mask that is not exactly the triangle stays an additive mask
    tri2 = tri.copy()
    tri2[0, 1] = -1e9
    m = _model(_core([helper.make_node("Mul", ["s0", "c"], ["s1"])], "s1"),
               {k: v for k, v in QKV.items() if k != "mask"}, OUT, {"c": _c(0.125), "mask": tri2})
    sess = _run(m, {n: _x(rng, B, H, S, D) for n in ("q", "k", "v")})
    (node,) = _sdpa(sess)
    assert not node.attrs.causal and "mask" in node.inputs


@pytest.mark.parametrize("fill", [-np.inf, float(np.finfo(np.float32).min)])
def test_causal_where_of_a_triangle_becomes_causal(rng: np.random.Generator, fill: float) -> None:
    """Older GPT-2 exports: Where(tril, scores, fill) after the scale, an additive mask after it."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s0"]),
             helper.make_node("Div", ["s0", "c"], ["s1"]),
             helper.make_node("Where", ["tri", "s1", "fill"], ["s2"]),
             helper.make_node("Add", ["s2", "mask"], ["s3"]),
             helper.make_node("Softmax", ["s3"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["o"])]
    inits = {"c": _c(math.sqrt(D)), "tri": np.tril(np.ones((1, 1, S, S), bool)), "fill": _c(fill)}
    m = _model(nodes, QKV, OUT, inits)
    feed = {"q": _x(rng, B, H, S, D), "k": _x(rng, B, H, S, D), "v": _x(rng, B, H, S, D),
            "mask": _key_mask(rng, fill=-1e4)}
    sess = _run(m, feed)
    (node,) = _sdpa(sess)
    assert node.attrs.causal and "mask" in node.inputs


def test_where_with_a_finite_fill_off_the_triangle_is_refused(rng: np.random.Generator) -> None:
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s0"]),
             helper.make_node("Where", ["keep", "s0", "fill"], ["s1"]),
             helper.make_node("Softmax", ["s1"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["o"])]
    keep = rng.random((1, 1, S, S)) > 0.3
    keep[..., 0] = True
    m = _model(nodes, {k: v for k, v in QKV.items() if k != "mask"}, OUT, {"keep": keep, "fill": _c(-1e4)})
    sess = _run(m, {n: _x(rng, B, H, S, D) for n in "qkv"})
    _refused(sess, "Where fills masked scores with -10000.0")
    # with -inf the same condition is an additive mask
    m = _model(nodes, {k: v for k, v in QKV.items() if k != "mask"}, OUT, {"keep": keep, "fill": _c(-np.inf)})
    sess = _run(m, {n: _x(rng, B, H, S, D) for n in "qkv"})
    (node,) = _sdpa(sess)
    assert not node.attrs.causal and "mask" in node.inputs


@pytest.mark.parametrize("engine", ENGINES)
def test_grouped_query_repeat_kv_is_sdpa_gqa(rng: np.random.Generator, engine: str) -> None:
    """Llama's repeat_kv (Unsqueeze -> Expand -> Reshape) read as sdpa's own k/v heads."""
    hk, n = 2, H // 2

    def rep(src: str, dst: str) -> list[onnx.NodeProto]:
        return [
            helper.make_node("Unsqueeze", [src, "ax2"], [f"{src}_u"]),
            helper.make_node("Expand", [f"{src}_u", "big"], [f"{src}_e"]),
            helper.make_node("Reshape", [f"{src}_e", "to4"], [dst]),
        ]

    nodes = [*rep("k", "kr"), *rep("v", "vr"),
             helper.make_node("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s0"]),
             helper.make_node("Mul", ["s0", "c"], ["s1"]),
             helper.make_node("Softmax", ["s1"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "vr"], ["o"])]
    inits = {"ax2": np.array([2], np.int64), "big": np.array([B, hk, n, S, D], np.int64),
             "to4": np.array([B, H, S, D], np.int64), "c": _c(D ** -0.5)}
    m = _model(nodes, {"q": (B, H, S, D), "k": (B, hk, S, D), "v": (B, hk, S, D)}, OUT, inits)
    sess = _run(m, {"q": _x(rng, B, H, S, D), "k": _x(rng, B, hk, S, D), "v": _x(rng, B, hk, S, D)},
                engine=_engine(engine))
    assert _kinds(sess) == ["sdpa"]
    (node,) = _sdpa(sess)
    assert node.inputs["k"].dim[1] == hk and node.inputs["v"].dim[1] == hk


def test_identity_dropout_and_same_type_casts_after_the_softmax(rng: np.random.Generator) -> None:
    nodes = _core([helper.make_node("Div", ["s0", "c"], ["s1"])], "s1")
    nodes[-1:] = [helper.make_node("Dropout", ["p", "ratio"], ["p1"]), helper.make_node("Cast", ["p1"], ["p2"], to=F),
                  helper.make_node("Identity", ["p2"], ["p3"]), helper.make_node("MatMul", ["p3", "v"], ["o"])]
    m = _model(nodes, QKV, OUT, {"c": _c(math.sqrt(D)), "ratio": _c(0.1)})
    feed = {"q": _x(rng, B, H, S, D), "k": _x(rng, B, H, S, D), "v": _x(rng, B, H, S, D), "mask": _key_mask(rng)}
    sess = _run(m, feed)
    assert _kinds(sess) == ["sdpa"]


def test_rank3_scores_run_as_one_head(rng: np.random.Generator) -> None:
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["s0"]),
             helper.make_node("Mul", ["c", "s0"], ["s1"]),
             helper.make_node("Softmax", ["s1"], ["p"], axis=2),
             helper.make_node("MatMul", ["p", "v"], ["o"])]
    m = _model(nodes, {n: (B * H, S, D) for n in "qkv"}, {"o": (B * H, S, D)}, {"c": _c(0.2)})
    sess = _run(m, {n: _x(rng, B * H, S, D) for n in "qkv"})
    assert _kinds(sess).count("sdpa") == 1 and "softmax" not in _kinds(sess)


# ---- near misses: not fused, the reason in the report ------------------------------------------
def _refused(sess: fgo.InferenceSession, text: str) -> None:
    rep = sess.partition_report()
    assert "onnx.attention.sdpa" not in rep.rewrites and not _sdpa(sess)
    assert any(text in r and "onnx.attention.sdpa" in r for r in rep.patterns_refused), rep.patterns_refused
    assert "patterns not applied" in str(rep)


def test_softmax_over_another_axis_is_refused(rng: np.random.Generator) -> None:
    nodes = _core([helper.make_node("Div", ["s0", "c"], ["s1"])], "s1")
    nodes[4] = helper.make_node("Softmax", ["s2"], ["p"], axis=2)
    m = _model(nodes, QKV, OUT, {"c": _c(math.sqrt(D))})
    feed = {"q": _x(rng, B, H, S, D), "k": _x(rng, B, H, S, D), "v": _x(rng, B, H, S, D),
            "mask": _key_mask(rng, fill=-30.0)}  # finite: a softmax over the query axis sees whole masked columns
    _refused(_run(m, feed), "axis=2 is not the last axis")


@pytest.mark.parametrize(("value", "what"), [("p", "the probabilities"), ("s0", "the scores"), ("s1", "the scaled scores")])
def test_an_intermediate_read_elsewhere_is_refused(rng: np.random.Generator, value: str, what: str) -> None:
    m = _model(_core([helper.make_node("Div", ["s0", "c"], ["s1"])], "s1"), QKV,
               {**OUT, value: (B, H, S, S)}, {"c": _c(math.sqrt(D))})
    feed = {"q": _x(rng, B, H, S, D), "k": _x(rng, B, H, S, D), "v": _x(rng, B, H, S, D), "mask": _key_mask(rng)}
    _refused(_run(m, feed), f"{what} '{value}' is a graph output")


def test_probabilities_read_by_another_node_are_refused(rng: np.random.Generator) -> None:
    nodes = [*_core([helper.make_node("Div", ["s0", "c"], ["s1"])], "s1"), helper.make_node("Neg", ["p"], ["np"])]
    m = _model(nodes, QKV, {**OUT, "np": (B, H, S, S)}, {"c": _c(math.sqrt(D))})
    feed = {"q": _x(rng, B, H, S, D), "k": _x(rng, B, H, S, D), "v": _x(rng, B, H, S, D), "mask": _key_mask(rng)}
    _refused(_run(m, feed), "the probabilities 'p' is also read by")


def test_an_excluded_op_type_is_refused(rng: np.random.Generator) -> None:
    m = _model(_core([helper.make_node("Div", ["s0", "c"], ["s1"])], "s1"), QKV, OUT, {"c": _c(math.sqrt(D))})
    feed = {"q": _x(rng, B, H, S, D), "k": _x(rng, B, H, S, D), "v": _x(rng, B, H, S, D), "mask": _key_mask(rng)}
    _refused(_run(m, feed, op_types_to_exclude="Softmax"), "Softmax in op_types_to_exclude")


def test_batch_broadcast_of_k_is_refused(rng: np.random.Generator) -> None:
    m = _model(_core([helper.make_node("Div", ["s0", "c"], ["s1"])], "s1"),
               {**QKV, "k": (1, H, S, D)}, OUT, {"c": _c(math.sqrt(D))})
    feed = {"q": _x(rng, B, H, S, D), "k": _x(rng, 1, H, S, D), "v": _x(rng, B, H, S, D), "mask": _key_mask(rng)}
    _refused(_run(m, feed), "batch of Q")


def test_fused_node_falls_back_to_onnxruntime_exactly(rng: np.random.Generator) -> None:
    """Where the engine refuses the fused node, ONNX Runtime runs its original nodes (the
    model-local function): same outputs, the node unclaimed with the engine's reason."""
    m = _model(_core([helper.make_node("Div", ["s0", "c"], ["s1"])], "s1"), QKV, OUT, {"c": _c(math.sqrt(D))})
    feed = {"q": _x(rng, B, H, S, D), "k": _x(rng, B, H, S, D), "v": _x(rng, B, H, S, D), "mask": _key_mask(rng)}
    sess = _run(m, feed, op_types_to_exclude="Attention_1")
    rep = sess.partition_report()
    assert rep.rewrites == {"onnx.attention.sdpa": 1}
    assert {u.op_type for u in rep.unclaimed} == {"Transpose", "MatMul", "Div", "Add", "Softmax"}
    assert all("op_types_to_exclude" in u.reason for u in rep.unclaimed)


# ---- ONNX Runtime's contrib ops ------------------------------------------------------------------
def test_contrib_attention(rng: np.random.Generator) -> None:
    hid = H * D
    w, b = _x(rng, hid, 3 * hid) * 0.1, _x(rng, 3 * hid)
    for causal in (0, 1):
        node = helper.make_node("Attention", ["x", "w", "b"], ["o"], domain="com.microsoft", num_heads=H,
                                unidirectional=causal)
        m = _model([node], {"x": (B, S, hid)}, {"o": (B, S, hid)}, {"w": w, "b": b}, contrib=True)
        sess = _run(m, {"x": _x(rng, B, S, hid)})
        (sd,) = _sdpa(sess)
        assert sd.attrs.causal == bool(causal)
        assert sess.partition_report().subgraphs[0].fusions["attention.sdpa"] == 1


def test_contrib_multihead_attention_with_bias_and_attention_bias(rng: np.random.Generator) -> None:
    hid, sk = H * D, S + 3
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v", "bias", "", "ab"], ["o"],
                            domain="com.microsoft", num_heads=H, scale=0.3)
    m = _model([node], {"q": (B, S, hid), "k": (B, sk, hid), "v": (B, sk, hid), "ab": (1, H, S, sk)},
               {"o": (B, S, hid)}, {"bias": _x(rng, 3 * hid)}, contrib=True)
    sess = _run(m, {"q": _x(rng, B, S, hid), "k": _x(rng, B, sk, hid), "v": _x(rng, B, sk, hid),
                    "ab": _x(rng, 1, H, S, sk)})
    (sd,) = _sdpa(sess)
    assert sd.attrs.attn_scale == pytest.approx(0.3) and "mask" in sd.inputs


@pytest.mark.parametrize("shape", ["1d", "2d", "3d"])
def test_contrib_attention_with_a_mask_index(rng: np.random.Generator, shape: str) -> None:
    """mask_index as the optimizer emits it: a fully masked batch row shows the filter value
    (-10000, or the attribute) is the one ONNX Runtime adds."""
    hid = H * D
    if shape == "1d":
        mi = np.array([S, S - 3], np.int32)
    else:
        mi = (rng.random((B, S) if shape == "2d" else (B, S, S)) > 0.3).astype(np.int32)
        mi[0] = 0
    filters: list[dict[str, Any]] = [{}, {"mask_filter_value": -30.0}]
    for filt in filters:
        node = helper.make_node("Attention", ["x", "w", "b", "mi"], ["o"], domain="com.microsoft", num_heads=H, **filt)
        m = _model([node], {"x": (B, S, hid)}, {"o": (B, S, hid)},
                   {"w": _x(rng, hid, 3 * hid), "b": _x(rng, 3 * hid)}, contrib=True)
        m.graph.input.append(helper.make_tensor_value_info("mi", TensorProto.INT32, list(mi.shape)))
        sess = _run(m, {"x": _x(rng, B, S, hid), "mi": mi})
        assert not sess.partition_report().unclaimed and len(_sdpa(sess)) == 1


def test_contrib_attention_with_past_is_refused_with_the_reason(rng: np.random.Generator) -> None:
    hid = H * D
    node = helper.make_node("Attention", ["x", "w", "b", "", "past"], ["o", "present"], domain="com.microsoft",
                            num_heads=H, unidirectional=1)
    m = _model([node], {"x": (B, S, hid), "past": (2, B, H, 3, D)}, {"o": (B, S, hid)},
               {"w": _x(rng, hid, 3 * hid) * 0.1, "b": _x(rng, 3 * hid)}, contrib=True)
    sess = _run(m, {"x": _x(rng, B, S, hid), "past": _x(rng, 2, B, H, 3, D)})
    (u,) = sess.partition_report().unclaimed
    assert "past" in u.reason and u.op_type == "Attention"


def test_contrib_multihead_attention_with_a_key_padding_mask(rng: np.random.Generator) -> None:
    hid, sk = H * D, S + 2
    kpm = (rng.random((B, sk)) > 0.3).astype(np.int32)
    kpm[:, 0] = 1
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v", "", "kpm"], ["o"], domain="com.microsoft",
                            num_heads=H)
    m = _model([node], {"q": (B, S, hid), "k": (B, sk, hid), "v": (B, sk, hid)}, {"o": (B, S, hid)}, contrib=True)
    m.graph.input.append(helper.make_tensor_value_info("kpm", TensorProto.INT32, [B, sk]))
    sess = _run(m, {"q": _x(rng, B, S, hid), "k": _x(rng, B, sk, hid), "v": _x(rng, B, sk, hid), "kpm": kpm})
    assert not sess.partition_report().unclaimed and len(_sdpa(sess)) == 1


# ---- torch.onnx.export ------------------------------------------------------------------------------
def _torch_modules() -> dict[str, Any]:
    torch = pytest.importorskip("torch", reason="torch exports the modules (the fusegraph[torch] extra)")
    fn = torch.nn.functional
    module: Any = torch.nn.Module

    class Block(module):  # type: ignore[misc]  # torchvision ViT's encoder block: nn.MultiheadAttention, LayerNorm, GELU
        def __init__(self) -> None:
            super().__init__()
            self.ln = torch.nn.LayerNorm(H * D)
            self.attn = torch.nn.MultiheadAttention(H * D, H, batch_first=True)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(H * D, 2 * H * D), torch.nn.GELU(),
                                           torch.nn.Linear(2 * H * D, H * D))

        def forward(self, x: Any) -> Any:
            y = self.ln(x)
            y, _ = self.attn(y, y, y, need_weights=False)
            return self.mlp(x + y)

    class Causal(module):  # type: ignore[misc]  # F.scaled_dot_product_attention(is_causal=True), Llama's RMSNorm
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.rand(D) + 0.5)

        def forward(self, q: Any, k: Any, v: Any) -> Any:
            o = fn.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.w * (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6))

    return {"vit_block": (Block(), [(B, S, H * D)], {"onnx.attention.sdpa": 1, "onnx.gelu.erf": 1}),
            "causal_rms": (Causal(), [(B, H, S, D)] * 3, {"onnx.attention.sdpa": 1, "onnx.norm.rms": 1})}


@pytest.mark.filterwarnings("ignore:Converting a tensor to a Python boolean", "ignore:You are using the legacy TorchScript",
                            "ignore:The feature will be removed")
@pytest.mark.parametrize("opset", [14, 17])
@pytest.mark.parametrize("name", ["vit_block", "causal_rms"])
def test_torch_exports_are_recognised(rng: np.random.Generator, tmp_path: Path, name: str, opset: int) -> None:
    torch = pytest.importorskip("torch", reason="torch exports the modules (the fusegraph[torch] extra)")
    module, shapes, patterns = _torch_modules()[name]
    module.eval()
    args = tuple(torch.from_numpy(_x(rng, *s)) for s in shapes)
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(module, args, str(path), opset_version=opset, dynamo=False)
    model = onnx.load(str(path))
    feed = {i.name: a.numpy() for i, a in zip(model.graph.input, args, strict=True)}
    sess = _run(model, feed)
    rep = sess.partition_report()
    if opset < 17 and name == "vit_block":
        patterns = {**patterns, "onnx.norm.layer": 1}  # LayerNorm is decomposed before opset 17
    assert rep.rewrites == patterns and not rep.unclaimed
    if name == "causal_rms":
        (node,) = _sdpa(sess)
        assert node.attrs.causal and "mask" not in node.inputs


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_onnxruntime_optimized_bert_runs_on_fusegraph(tmp_path: Path) -> None:
    """tiny_bert through ONNX Runtime's transformer optimizer (SkipLayerNormalization,
    BiasGelu; its attention left as exported): the contrib ops lowered, the values after
    them typed, the attention recognised; the embedding Gather claimed too (the gather op)."""
    optimizer = pytest.importorskip("onnxruntime.transformers.optimizer", reason="ships with onnxruntime")
    opt = optimizer.optimize_model(str(DATA / "tiny_bert.onnx"), model_type="bert", num_heads=2, hidden_size=64,
                                   opt_level=0)
    path = tmp_path / "tiny_bert_opt.onnx"
    opt.save_model_to_file(str(path))
    model = onnx.load(str(path))
    contrib = {n.op_type for n in model.graph.node if n.domain == "com.microsoft"}
    assert {"SkipLayerNormalization", "BiasGelu"} <= contrib, contrib
    with np.load(DATA / "tiny_bert.npz") as z:
        feed = {k: z[k] for k in z.files}
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)
    sess = _session(model)
    rep = sess.partition_report()
    assert not rep.unclaimed, [(u.node, u.reason) for u in rep.unclaimed]
    assert rep.rewrites == {"onnx.attention.sdpa": 2}
    fused = next(s for s in rep.subgraphs if s.kind == "fusegraph").fusions
    assert fused["attention.sdpa"] == 2 and fused["norm.layer"] == 4
    (got,) = sess.run(None, feed)
    assert _rel(got, want[0]) < 1e-5


# ---- the tiny transformer exports ------------------------------------------------------------------
@pytest.mark.parametrize(("name", "patterns"), [
    ("tiny_bert", {"onnx.attention.sdpa": 2, "onnx.gelu.erf": 2}),
    ("tiny_gpt2", {"onnx.attention.sdpa": 2, "onnx.gelu.tanh": 2}),
    ("tiny_llama", {"onnx.attention.sdpa": 2, "onnx.norm.rms": 5}),
    ("tiny_tv_swin", {"onnx.attention.sdpa": 8, "onnx.gelu.erf": 8}),
])
def test_tiny_transformers_recognised(name: str, patterns: dict[str, int]) -> None:
    path = DATA / f"{name}.onnx"
    with np.load(DATA / f"{name}.npz") as z:
        feed = {k: z[k] for k in z.files}
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)
    model = onnx.load(str(path))
    sess = _session(model)
    rep = sess.partition_report()
    assert rep.rewrites == patterns and not rep.patterns_refused
    fused = {k: v for s in rep.subgraphs for k, v in s.fusions.items() if k.startswith(("attention", "norm", "gelu"))}
    assert fused == {k.removeprefix("onnx."): v for k, v in patterns.items()}
    (got,) = sess.run(None, feed)
    assert _rel(got, want[0]) < 1e-5
