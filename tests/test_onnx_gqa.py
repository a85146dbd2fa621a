"""ONNX Runtime's contrib GroupQueryAttention on fusegraph (fusegraph/onnx/ops/gqa.py): each
tiny model (opset 17 + com.microsoft 1) runs through fusegraph.onnx.InferenceSession against
ONNX Runtime's CPU kernel on fresh random data -- separate and packed QKV, kv_num_heads
dividing num_heads, default and explicit scale, causal and not, the present cache read or
not -- and must be claimed as one sdpa; the forms it does not lower (a past, run-time
lengths, rotary, a local window, softcap) must name why in the partition report and still
give ONNX Runtime's answer."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import fusegraph.onnx as fgo
from fusegraph.graph.ops import OpKind
from fusegraph.onnx.units import FusegraphUnit

B, S, D = 2, 5, 16  # ORT's rotary needs head % 16 == 0
F32 = TensorProto.FLOAT


def _model(heads: int, kv: int, rng: np.random.Generator, *, packed: bool = False, read_present: str = "",
           lens: str = "const", past: int = -1, elem: int = F32, seqlens: list[int] | None = None, batch: int = B, seq: int = S, extra: dict[str, np.ndarray] | None = None,
           **attrs: Any) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One GroupQueryAttention node and a random feed. ``read_present``: "" (present not named),
    "unread" (named, read by nothing), "output" (graph outputs) or "reader" (an Add of both
    feeds the graph output z).
    ``lens``: "const" (initializers), "input" (fed at run time). ``past``: its length, -1 absent (ONNX Runtime takes a past with
    several new positions only in batch 1)."""
    qw, kw = heads * D, kv * D
    names = ["qkv", "", ""] if packed else ["q", "k", "v"]
    dims = {"qkv": [batch, seq, qw + 2 * kw], "q": [batch, seq, qw], "k": [batch, seq, kw], "v": [batch, seq, kw]}
    dt = np.float32 if elem == F32 else np.float16
    feed: dict[str, np.ndarray] = {n: rng.standard_normal(dims[n]).astype(dt) for n in names if n}
    ins = [helper.make_tensor_value_info(n, elem, dims[n]) for n in names if n]
    inits: list[onnx.TensorProto] = []
    if past >= 0:
        names += ["past_k", "past_v"]
        for n in ("past_k", "past_v"):
            ins.append(helper.make_tensor_value_info(n, elem, [batch, kv, past, D]))
            feed[n] = rng.standard_normal((batch, kv, past, D)).astype(dt)
    else:
        names += ["", ""]
    total = seq + max(past, 0)
    lengths = {"seqlens_k": np.array(seqlens, np.int32) if seqlens else np.full(batch, total - 1, np.int32),
               "total_len": np.array(total, np.int32)}
    for n, a in lengths.items():
        if lens == "const":
            inits.append(numpy_helper.from_array(a, n))
        else:
            ins.append(helper.make_tensor_value_info(n, TensorProto.INT32, list(a.shape)))
            feed[n] = a
    names += list(lengths)
    for n, a in (extra or {}).items():
        inits.append(numpy_helper.from_array(a, n))
        names.append(n)
    present = ["present_k", "present_v"] if read_present else []
    node = helper.make_node("GroupQueryAttention", names, ["y", *present], domain="com.microsoft",
                            num_heads=heads, kv_num_heads=kv, **attrs)
    outs = [helper.make_tensor_value_info("y", elem, [batch, seq, qw])]
    nodes = [node]
    if read_present == "output":
        outs += [helper.make_tensor_value_info(n, elem, [batch, kv, total, D]) for n in present]
    elif read_present == "reader":
        nodes.append(helper.make_node("Add", present, ["z"]))
        outs.append(helper.make_tensor_value_info("z", elem, [batch, kv, total, D]))
    graph = helper.make_graph(nodes, "gqa", ins, outs, inits)
    ops = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=ops, ir_version=8), feed


def _session(model: onnx.ModelProto, engine: str = "reference") -> fgo.InferenceSession:
    options = {"engine": engine, "torch_mlir_tier": "off", "floor": "off", "strict": 1}
    return fgo.InferenceSession(model.SerializeToString(), providers=[(fgo.PROVIDER, options), "CPUExecutionProvider"])


def _ort(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [np.asarray(o) for o in sess.run(None, feed)]


def _err(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """(||got - want|| / ||want||, max |got - want|); NaN never passes."""
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert g.shape == w.shape and np.isfinite(g).all() and np.isfinite(w).all()
    return float(np.linalg.norm(g - w) / max(float(np.linalg.norm(w)), 1e-30)), float(np.abs(g - w).max())


def _agree(sess: fgo.InferenceSession, model: onnx.ModelProto, feed: dict[str, np.ndarray], tol: float) -> None:
    want = _ort(model, feed)
    got = sess.run(None, feed)
    assert len(got) == len(want)
    for gv, w in zip(got, want, strict=True):
        rel, big = _err(gv, w)
        assert rel <= tol and big <= 50 * tol * max(float(np.abs(w).max()), 1.0), (rel, big)


@pytest.mark.parametrize(("heads", "kv"), [(4, 2), (4, 1), (2, 2)])
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("scale", [0.0, 0.3], ids=["default-scale", "scale"])
def test_prefill_claimed_and_equal_to_onnxruntime(heads: int, kv: int, packed: bool, scale: float,
                                                  rng: np.random.Generator) -> None:
    attrs: dict[str, Any] = {"scale": scale} if scale else {}
    model, feed = _model(heads, kv, rng, packed=packed, **attrs)
    sess = _session(model)
    rep = sess.partition_report()
    assert not rep.unclaimed, [(u.op_type, u.reason) for u in rep.unclaimed]
    assert rep.subgraphs[0].fusions.get("attention.sdpa") == 1
    sdpa = [n for plan in sess._plans.values() for u in plan.units if isinstance(u, FusegraphUnit)
            for n in u.graph.nodes if n.kind == OpKind.SDPA]
    assert len(sdpa) == 1
    _agree(sess, model, feed, 1e-5)
    feed2 = {k: (rng.standard_normal(v.shape).astype(np.float32) if v.dtype == np.float32 else v)
             for k, v in feed.items()}
    _agree(sess, model, feed2, 1e-5)  # new data, same session


@pytest.mark.parametrize("read_present", ["unread", "output", "reader"])
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
def test_present_cache_read(read_present: str, packed: bool, rng: np.random.Generator) -> None:
    """present_key / present_value as graph outputs or read by a node: the new keys/values."""
    model, feed = _model(4, 2, rng, packed=packed, read_present=read_present)
    sess = _session(model)
    rep = sess.partition_report()
    assert not rep.unclaimed, [(u.op_type, u.reason) for u in rep.unclaimed]
    _agree(sess, model, feed, 1e-5)


def test_not_causal(rng: np.random.Generator) -> None:
    model, feed = _model(4, 2, rng, causal=0)
    sess = _session(model)
    assert not sess.partition_report().unclaimed
    _agree(sess, model, feed, 1e-5)


def test_empty_past_is_the_prefill_form(rng: np.random.Generator) -> None:
    model, feed = _model(4, 2, rng, past=0, read_present="output")
    sess = _session(model)
    rep = sess.partition_report()
    assert not rep.unclaimed, [(u.op_type, u.reason) for u in rep.unclaimed]
    _agree(sess, model, feed, 1e-5)


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"past": 3, "batch": 1, "read_present": "output"}, "past_key 'past_k' [1, 2, 3, 16] holds cached positions"),
    ({"lens": "input"}, "seqlens_k 'seqlens_k' is a run-time value"),
    ({"seqlens": [S - 1, S - 3]}, "seqlens_k [4, 2] is not sequence_length - 1 = 4"),
    ({"do_rotary": 1, "extra": {}}, "do_rotary=1"),
    ({"local_window_size": 2}, "local_window_size=2"),
    ({"softcap": 2.0}, "softcap=2.0"),
])
def test_forms_not_lowered_name_the_reason(kwargs: dict[str, Any], reason: str, rng: np.random.Generator) -> None:
    """Each stays on ONNX Runtime with the reason; the session's answer is ONNX Runtime's."""
    kwargs = dict(kwargs)
    if "extra" in kwargs:  # real caches: cos/sin of position x frequency
        ang = np.arange(S + 3)[:, None] * (1.0 / 10000 ** (np.arange(D // 2) / (D // 2)))[None, :]
        kwargs["extra"] = {"cos": np.cos(ang).astype(np.float32), "sin": np.sin(ang).astype(np.float32)}
    model, feed = _model(4, 2, rng, **kwargs)
    sess = _session(model)
    (u,) = sess.partition_report().unclaimed
    assert u.op_type == "GroupQueryAttention" and reason in u.reason, u.reason
    _agree(sess, model, feed, 1e-6)


def test_total_length_from_shapes_is_folded(rng: np.random.Generator) -> None:
    """total_sequence_length computed from the query's shape (Shape -> Gather -> Cast, as
    exporters write it) is fixed by the model: folded at import, the node is claimed."""
    model, feed = _model(4, 2, rng)
    g = model.graph
    keep = [t for t in g.initializer if t.name != "total_len"]
    del g.initializer[:]
    g.initializer.extend([*keep, numpy_helper.from_array(np.array(1, np.int64), "one")])
    g.node.insert(0, helper.make_node("Cast", ["s64"], ["total_len"], to=TensorProto.INT32))
    g.node.insert(0, helper.make_node("Gather", ["qshape", "one"], ["s64"], axis=0))
    g.node.insert(0, helper.make_node("Shape", ["q"], ["qshape"]))
    sess = _session(model)
    rep = sess.partition_report()
    assert not rep.unclaimed, [(u.op_type, u.reason) for u in rep.unclaimed]
    _agree(sess, model, feed, 1e-5)


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
def test_torch_engine_float32_and_float16(packed: bool, rng: np.random.Generator) -> None:
    pytest.importorskip("torch", reason="the torch engine needs torch")
    for elem, tol in ((F32, 1e-5), (TensorProto.FLOAT16, 1e-2)):
        model, feed = _model(4, 2, rng, packed=packed, elem=elem, read_present="output")
        sess = _session(model, "torch")
        rep = sess.partition_report()
        assert not rep.unclaimed, [(u.op_type, u.reason) for u in rep.unclaimed]
        _agree(sess, model, feed, tol)


@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "kv", "packed"), [(8, 2, False), (8, 1, True)])
def test_prefill_claimed_on_cuda(heads: int, kv: int, packed: bool, rng: np.random.Generator) -> None:
    """On a GPU session the sdpa (and the present cache) run on the device."""
    model, feed = _model(heads, kv, rng, packed=packed, batch=2, seq=64, read_present="output")
    sess = fgo.InferenceSession(model.SerializeToString(),
                                providers=[(fgo.PROVIDER, {"device": "cuda:0", "floor": "off"})])
    rep = sess.partition_report()
    assert rep.coverage == 1.0 and not rep.unclaimed, [(u.op_type, u.reason) for u in rep.unclaimed]
    _agree(sess, model, feed, 1e-5)
