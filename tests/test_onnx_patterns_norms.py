"""Norm and GELU patterns of transformer exports (fusegraph/onnx/patterns_norms.py,
patterns_gelu.py) and ONNX Runtime's contrib norms and GELUs (fusegraph/onnx/ops/norm.py,
elementwise.py): each small graph against ONNX Runtime on fresh random inputs, a golden
list of the fused graph's ops, and near misses (wrong constant, axis, keepdims, an
intermediate read elsewhere) that must not fuse, with the reason in the partition report."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from bench_modules import load_bench
from onnx import TensorProto, helper, numpy_helper

import fusegraph.onnx as fgo
from fusegraph.onnx.units import FusegraphUnit

F = TensorProto.FLOAT
B, S, D = 2, 6, 32
X = {"x": (B, S, D)}


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


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert g.shape == w.shape and not np.isnan(g).any() and not np.isnan(w).any()
    return float(np.linalg.norm(g - w) / max(float(np.linalg.norm(w)), 1e-30))


def _run(model: onnx.ModelProto, feed: Mapping[str, np.ndarray], **opts: Any) -> fgo.InferenceSession:
    """The session, after checking every output against ONNX Runtime (f32 norms: 1e-4 relative)."""
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, dict(feed))
    options = {"engine": "reference", "torch_mlir_tier": "off", "floor": "off", "strict": 1, **opts}
    sess = fgo.InferenceSession(model.SerializeToString(), providers=[(fgo.PROVIDER, options), "CPUExecutionProvider"])
    got = sess.run(None, dict(feed))
    for g, w in zip(got, want, strict=True):
        assert _rel(g, w) <= 1e-4
        assert np.abs(np.asarray(g, np.float64) - w).max() <= 1e-4 * max(float(np.abs(w).max()), 1.0)
    return sess


def _kinds(sess: fgo.InferenceSession) -> list[str]:
    graphs = [u.graph for p in sess._plans.values() for u in p.units if isinstance(u, FusegraphUnit)]
    out = []
    for g in graphs:
        for n in g.nodes:
            mode = getattr(n.attrs, "mode", None)
            out.append(f"pointwise:{mode.value}" if mode is not None else n.kind.value)
    return out


def _x(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _c(v: float) -> np.ndarray:
    return np.array(v, dtype=np.float32)


def _refused(sess: fgo.InferenceSession, pattern: str, text: str) -> None:
    rep = sess.partition_report()
    assert pattern not in rep.rewrites, rep.rewrites
    assert any(pattern in r and text in r for r in rep.patterns_refused), rep.patterns_refused


# ---- RMS norm ---------------------------------------------------------------------------------
def _rms(*, pow_: float = 2.0, axes: Sequence[int] = (-1,), keepdims: int = 1, eps: float = 1e-6,
         form: str = "div1", weight: bool = True, cast: bool = False, opset: int = 17,
         extra_out: str = "") -> tuple[list[onnx.NodeProto], dict[str, np.ndarray], dict[str, Sequence[int]]]:
    inits: dict[str, np.ndarray] = {"two": _c(pow_), "eps": _c(eps), "one": _c(1.0)}
    rm_kw: dict[str, Any] = {"keepdims": keepdims}
    rm_in = ["sq"]
    if opset >= 18:
        inits["axes"] = np.array(list(axes), np.int64)
        rm_in.append("axes")
    else:
        rm_kw["axes"] = list(axes)
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"]), helper.make_node("ReduceMean", rm_in, ["ms"], **rm_kw),
             helper.make_node("Add", ["ms", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["rt"])]
    if form == "div1":
        nodes += [helper.make_node("Div", ["one", "rt"], ["inv"]), helper.make_node("Mul", ["x", "inv"], ["n0"])]
    elif form == "recip":
        nodes += [helper.make_node("Reciprocal", ["rt"], ["inv"]), helper.make_node("Mul", ["inv", "x"], ["n0"])]
    else:
        nodes += [helper.make_node("Div", ["x", "rt"], ["n0"])]
    last = "n0"
    if cast:
        nodes.append(helper.make_node("Cast", ["n0"], ["n1"], to=F))
        last = "n1"
    if weight:
        inits["w"] = np.random.default_rng().uniform(0.5, 1.5, D).astype(np.float32)
        nodes.append(helper.make_node("Mul", ["w", last], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", [last], ["y"]))
    outs: dict[str, Sequence[int]] = {"y": (B, S, D)}
    if extra_out:
        outs[extra_out] = (B, S, 1)
    return nodes, inits, outs


@pytest.mark.parametrize("form", ["div1", "recip", "divx"])
@pytest.mark.parametrize("opset", [17, 18])
def test_rms_forms_are_one_rmsnorm(rng: np.random.Generator, form: str, opset: int) -> None:
    nodes, inits, outs = _rms(form=form, cast=form == "div1", opset=opset)
    sess = _run(_model(nodes, X, outs, inits, opset=opset), {"x": _x(rng, B, S, D)})
    assert _kinds(sess) == ["reshape", "rmsnorm", "reshape"]
    rep = sess.partition_report()
    assert rep.rewrites == {"onnx.norm.rms": 1} and rep.subgraphs[0].fusions == {"norm.rms": 1}


def test_rms_without_weight_over_two_axes(rng: np.random.Generator) -> None:
    nodes, inits, outs = _rms(axes=(1, 2), weight=False)
    sess = _run(_model(nodes, X, outs, inits), {"x": _x(rng, B, S, D)})
    assert "rmsnorm" in _kinds(sess) and "reduction" not in _kinds(sess)


@pytest.mark.parametrize(("kw", "why"), [
    ({"axes": (1,)}, "not the trailing axes"),
    ({"keepdims": 0}, "keepdims=0"),
    ({"extra_out": "ms"}, "is a graph output"),
    ({"extra_out": "rt"}, "is a graph output"),
])
def test_rms_near_misses_are_refused(rng: np.random.Generator, kw: dict[str, Any], why: str) -> None:
    nodes, inits, outs = _rms(**kw)
    if kw.get("keepdims") == 0:  # the mean of [B, S] needs its axis back to broadcast against x
        nodes.insert(2, helper.make_node("Unsqueeze", ["ms0", "ax"], ["ms"]))
        nodes[1] = helper.make_node("ReduceMean", ["sq"], ["ms0"], axes=[-1], keepdims=0)
        inits["ax"] = np.array([-1], np.int64)
    if kw.get("axes") == (1,):
        outs = {"y": (B, S, D)}
        nodes[-1] = helper.make_node("Mul", ["n0", "w2"], ["y"])
        inits["w2"] = inits.pop("w")
    sess = _run(_model(nodes, X, outs, inits), {"x": _x(rng, B, S, D)})
    _refused(sess, "onnx.norm.rms", why)
    assert "rmsnorm" not in _kinds(sess)


def test_rms_with_squares_of_another_power_is_not_rms(rng: np.random.Generator) -> None:
    nodes, inits, outs = _rms(pow_=3.0)
    sess = _run(_model(nodes, X, outs, inits), {"x": np.abs(_x(rng, B, S, D)) + 0.1})
    assert "onnx.norm.rms" not in sess.partition_report().rewrites and "rmsnorm" not in _kinds(sess)


def test_rms_with_a_wrong_inverse_is_refused(rng: np.random.Generator) -> None:
    nodes, inits, outs = _rms()
    inits["one"] = _c(2.0)  # 2 / sqrt(...): not an RMS norm
    sess = _run(_model(nodes, X, outs, inits), {"x": _x(rng, B, S, D)})
    _refused(sess, "onnx.norm.rms", "is not Div(x, root), Div(1, root) or Reciprocal")


def test_rms_stops_before_a_cast_to_another_type(rng: np.random.Generator) -> None:
    """fp16 Llama: normalize in f32, Cast to f16, weight in f16 -- the weight stays outside."""
    nodes, inits, _ = _rms(cast=True)
    nodes[-2] = helper.make_node("Cast", ["n0"], ["n1"], to=TensorProto.FLOAT16)
    nodes[-1] = helper.make_node("Mul", ["w", "n1"], ["y"])
    inits["w"] = inits["w"].astype(np.float16)
    m = _model(nodes, X, {}, inits)
    m.graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT16, [B, S, D]))
    sess = _run(m, {"x": _x(rng, B, S, D)})
    assert sess.partition_report().rewrites == {"onnx.norm.rms": 1}
    kinds = _kinds(sess)
    assert kinds.count("rmsnorm") == 1 and kinds[-1] == "pointwise:mul"


# ---- layer norm, decomposed --------------------------------------------------------------------
def _layer(*, sub_of: str = "x", eps: float = 1e-5, affine: bool = True) -> tuple[list[onnx.NodeProto], dict[str, np.ndarray]]:
    rng = np.random.default_rng()
    nodes = [helper.make_node("ReduceMean", ["x"], ["mu"], axes=[-1]),
             helper.make_node("Sub", [sub_of, "mu"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["d2"]),
             helper.make_node("ReduceMean", ["d2"], ["var"], axes=[-1]),
             helper.make_node("Add", ["var", "eps"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["sd"]),
             helper.make_node("Div", ["d", "sd"], ["n"])]
    inits = {"two": _c(2.0), "eps": _c(eps)}
    if affine:
        nodes += [helper.make_node("Mul", ["n", "g"], ["nb"]), helper.make_node("Add", ["nb", "b"], ["y"])]
        inits |= {"g": rng.uniform(0.5, 1.5, D).astype(np.float32), "b": rng.standard_normal(D).astype(np.float32)}
    else:
        nodes.append(helper.make_node("Identity", ["n"], ["y"]))
    return nodes, inits


def test_decomposed_layernorm_is_one_layernorm(rng: np.random.Generator) -> None:
    nodes, inits = _layer()
    sess = _run(_model(nodes, X, {"y": (B, S, D)}, inits, opset=13), {"x": _x(rng, B, S, D)})
    assert _kinds(sess) == ["reshape", "layernorm", "reshape"]
    assert sess.partition_report().rewrites == {"onnx.norm.layer": 1}


def test_decomposed_layernorm_of_another_mean_is_not_fused(rng: np.random.Generator) -> None:
    nodes, inits = _layer(sub_of="x2")
    sess = _run(_model(nodes, {"x": (B, S, D), "x2": (B, S, D)}, {"y": (B, S, D)}, inits, opset=13),
                {"x": _x(rng, B, S, D), "x2": _x(rng, B, S, D)})
    assert "layernorm" not in _kinds(sess)


def test_layernormalization_is_one_layernorm(rng: np.random.Generator) -> None:
    node = helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=1e-12)
    inits = {"g": rng.uniform(0.5, 1.5, D).astype(np.float32), "b": _x(rng, D)}
    sess = _run(_model([node], X, {"y": (B, S, D)}, inits), {"x": _x(rng, B, S, D)})
    assert _kinds(sess) == ["reshape", "layernorm", "reshape"]


# ---- GELU -------------------------------------------------------------------------------------
def _gelu_erf(*, c: float = math.sqrt(2.0), form: str = "bert", half: float = 0.5) -> tuple[list[onnx.NodeProto], dict[str, np.ndarray]]:
    inits = {"c": _c(c), "one": _c(1.0), "half": _c(half)}
    head = [helper.make_node("Div" if form != "mul" else "Mul", ["x", "c"], ["t"]), helper.make_node("Erf", ["t"], ["e"]),
            helper.make_node("Add", ["e", "one"], ["a"])]
    if form in ("bert", "mul"):  # x * (1 + erf) * 0.5
        tail = [helper.make_node("Mul", ["x", "a"], ["m"]), helper.make_node("Mul", ["m", "half"], ["y"])]
    else:  # (x * 0.5) * (1 + erf)
        tail = [helper.make_node("Mul", ["x", "half"], ["h"]), helper.make_node("Mul", ["h", "a"], ["y"])]
    return head + tail, inits


@pytest.mark.parametrize("form", ["bert", "mul", "half_first"])
def test_gelu_erf_forms_are_one_gelu(rng: np.random.Generator, form: str) -> None:
    nodes, inits = _gelu_erf(c=1 / math.sqrt(2.0) if form == "mul" else math.sqrt(2.0), form=form)
    sess = _run(_model(nodes, X, {"y": (B, S, D)}, inits), {"x": _x(rng, B, S, D) * 3})
    assert _kinds(sess) == ["pointwise:gelu_fwd"]
    assert sess.partition_report().rewrites == {"onnx.gelu.erf": 1}


def _gelu_tanh(*, k: float = 0.044715, c: float = math.sqrt(2 / math.pi), cube: str = "pow") -> tuple[list[onnx.NodeProto], dict[str, np.ndarray]]:
    inits = {"k": _c(k), "c": _c(c), "one": _c(1.0), "half": _c(0.5), "three": _c(3.0)}
    cube_nodes = ([helper.make_node("Pow", ["x", "three"], ["x3"])] if cube == "pow" else
                  [helper.make_node("Mul", ["x", "x"], ["xx"]), helper.make_node("Mul", ["xx", "x"], ["x3"])])
    nodes = [helper.make_node("Mul", ["x", "half"], ["h"]), *cube_nodes,
             helper.make_node("Mul", ["x3", "k"], ["kx3"]), helper.make_node("Add", ["x", "kx3"], ["in"]),
             helper.make_node("Mul", ["in", "c"], ["s"]), helper.make_node("Tanh", ["s"], ["t"]),
             helper.make_node("Add", ["t", "one"], ["a"]), helper.make_node("Mul", ["h", "a"], ["y"])]
    return nodes, inits


@pytest.mark.parametrize("cube", ["pow", "mul"])
def test_gelu_tanh_forms_are_one_gelu(rng: np.random.Generator, cube: str) -> None:
    nodes, inits = _gelu_tanh(cube=cube)
    sess = _run(_model(nodes, X, {"y": (B, S, D)}, inits), {"x": _x(rng, B, S, D) * 3})
    assert _kinds(sess) == ["pointwise:gelu_approx_tanh_fwd"]
    assert sess.partition_report().rewrites == {"onnx.gelu.tanh": 1}


@pytest.mark.parametrize(("make", "pattern", "why"), [
    (lambda: _gelu_erf(c=1.5), "onnx.gelu.erf", "not sqrt(2)"),
    (lambda: _gelu_erf(half=0.25), "onnx.gelu.erf", "is not then multiplied by 0.5"),
    (lambda: _gelu_erf(c=1 / math.sqrt(2.0) + 1e-3, form="mul"), "onnx.gelu.erf", "not 1/sqrt(2)"),
    (lambda: _gelu_tanh(k=0.045), "onnx.gelu.tanh", "not 0.044715"),
    (lambda: _gelu_tanh(c=0.8), "onnx.gelu.tanh", "not sqrt(2/pi)"),
])
def test_gelu_with_a_wrong_constant_is_refused(rng: np.random.Generator, make: Any, pattern: str, why: str) -> None:
    nodes, inits = make()
    sess = _run(_model(nodes, X, {"y": (B, S, D)}, inits), {"x": _x(rng, B, S, D) * 3})
    _refused(sess, pattern, why)
    assert not any(k.startswith("pointwise:gelu") for k in _kinds(sess))


def test_gelu_with_an_intermediate_read_elsewhere_is_refused(rng: np.random.Generator) -> None:
    nodes, inits = _gelu_erf()
    sess = _run(_model(nodes, X, {"y": (B, S, D), "e": (B, S, D)}, inits), {"x": _x(rng, B, S, D)})
    _refused(sess, "onnx.gelu.erf", "the Erf/Tanh output 'e' is a graph output")


# ---- ONNX Runtime's contrib norms and GELUs -------------------------------------------------------
def test_skip_layernorm_with_its_sum_output(rng: np.random.Generator) -> None:
    node = helper.make_node("SkipLayerNormalization", ["x", "skip", "g", "b", "bias"], ["y", "", "", "sum"],
                            domain="com.microsoft", epsilon=1e-5)
    inits = {"g": rng.uniform(0.5, 1.5, D).astype(np.float32), "b": _x(rng, D), "bias": _x(rng, D)}
    m = _model([node], {"x": (B, S, D), "skip": (B, S, D)}, {"y": (B, S, D), "sum": (B, S, D)}, inits, contrib=True)
    sess = _run(m, {"x": _x(rng, B, S, D), "skip": _x(rng, B, S, D)})
    assert "layernorm" in _kinds(sess) and not sess.partition_report().unclaimed


def test_values_after_contrib_ops_get_shapes_and_are_claimed(rng: np.random.Generator) -> None:
    """ONNX shape inference knows no contrib op: their output types come from
    patterns_contrib_types, so the MatMul, BiasGelu and Relu after them are claimed too."""
    w = _x(rng, D, 2 * D)
    nodes = [helper.make_node("SkipLayerNormalization", ["x", "skip", "g", "b"], ["h", "", "", "sum"],
                              domain="com.microsoft", epsilon=1e-5),
             helper.make_node("MatMul", ["h", "w"], ["m"]),
             helper.make_node("BiasGelu", ["m", "bias"], ["a"], domain="com.microsoft"),
             helper.make_node("Relu", ["sum"], ["r"]),
             helper.make_node("ReduceSum", ["a", "axes"], ["y"], keepdims=1)]
    inits = {"g": rng.uniform(0.5, 1.5, D).astype(np.float32), "b": _x(rng, D), "w": w, "bias": _x(rng, 2 * D),
             "axes": np.array([-1], np.int64)}
    m = _model(nodes, {"x": (B, S, D), "skip": (B, S, D)}, {"y": (B, S, 1), "r": (B, S, D)}, inits, contrib=True)
    sess = _run(m, {"x": _x(rng, B, S, D), "skip": _x(rng, B, S, D)})
    rep = sess.partition_report()
    assert not rep.unclaimed and len(rep.subgraphs) == 1, [(u.node, u.reason) for u in rep.unclaimed]


def test_skip_simplified_layernorm(rng: np.random.Generator) -> None:
    node = helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "g", "bias"], ["y"],
                            domain="com.microsoft", epsilon=1e-6)
    inits = {"g": rng.uniform(0.5, 1.5, D).astype(np.float32), "bias": _x(rng, D)}
    m = _model([node], {"x": (B, S, D), "skip": (B, S, D)}, {"y": (B, S, D)}, inits, contrib=True)
    sess = _run(m, {"x": _x(rng, B, S, D), "skip": _x(rng, B, S, D)})
    assert _kinds(sess).count("rmsnorm") == 1 and not sess.partition_report().unclaimed


def test_skip_layernorm_without_epsilon_is_refused(rng: np.random.Generator) -> None:
    node = helper.make_node("SkipLayerNormalization", ["x", "skip", "g", "b"], ["y"], domain="com.microsoft")
    inits = {"g": rng.uniform(0.5, 1.5, D).astype(np.float32), "b": _x(rng, D)}
    m = _model([node], {"x": (B, S, D), "skip": (B, S, D)}, {"y": (B, S, D)}, inits, contrib=True)
    sess = _run(m, {"x": _x(rng, B, S, D), "skip": _x(rng, B, S, D)})
    (u,) = sess.partition_report().unclaimed
    assert "epsilon" in u.reason


@pytest.mark.parametrize(("op", "mode"), [("Gelu", "gelu_fwd"), ("BiasGelu", "gelu_fwd"),
                                          ("FastGelu", "gelu_approx_tanh_fwd")])
def test_contrib_gelus(rng: np.random.Generator, op: str, mode: str) -> None:
    ins = ["x"] if op == "Gelu" else ["x", "bias"]
    m = _model([helper.make_node(op, ins, ["y"], domain="com.microsoft")], X, {"y": (B, S, D)},
               {} if op == "Gelu" else {"bias": _x(rng, D)}, contrib=True)
    sess = _run(m, {"x": _x(rng, B, S, D) * 3})
    assert f"pointwise:{mode}" in _kinds(sess)




def test_the_diffusion_unets_group_norms_lower_on_the_region_path(rng: np.random.Generator, tmp_path: Any) -> None:
    """bench_onnx_gpu's diffusion UNet (one level, 16x16): its GroupNorms, exported as
    Reshape -> InstanceNormalization -> Reshape, read a reshape whose output had no type yet
    while being lowered, and the whole model fell back to ONNX Runtime ("tensor
    'reshape_28::y' has no data type yet"). The norm takes the type from the model."""
    torch = pytest.importorskip("torch")

    bench = load_bench("bench_onnx_gpu", "bench_onnx_gpu_for_test")
    torch.manual_seed(int(rng.integers(1 << 31)))
    x = torch.randn(1, 4, 16, 16)
    path = tmp_path / "unet.onnx"
    with torch.no_grad():
        bench.export(bench.UNet(64, 1).eval(), (x,), ["x"], path)
    opts = {"regions": "on", "engine": "torch", "runners": "off", "floor_mode": "inline"}
    sess = _run(onnx.load(str(path)), {"x": x.numpy()}, **opts)  # strict: a build failure raises
    report = sess.partition_report()
    assert [s.kind for s in report.subgraphs] == ["fusegraph"] and "regions:" in str(report), str(report)
