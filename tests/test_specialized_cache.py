"""A specialized graph kept in the cache directory (fusegraph/onnx/specialized_cache.py) is
the graph ``specialize`` computes, field by field, on many models; its key changes with the
model's content, the input shapes and the versions; a damaged or foreign file is a miss."""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_onnx_floor import _chain
from test_onnx_import import _glue_model
from test_onnx_setup_cost import _mixed
from test_warm_setup_views import _model_with, _zoo

import fusegraph.onnx as fgo
from fusegraph.cli import main
from fusegraph.onnx import specialize as specialize_mod
from fusegraph.onnx import specialized_cache as sc
from fusegraph.onnx.ir import OnnxGraph
from fusegraph.onnx.load import load_model_with_views
from fusegraph.runtime import cache_limit
from fusegraph.runtime.cache_dir import CacheUnavailableWarning

Shapes = dict[str, tuple[int, ...]]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FUSEGRAPH_CACHE", raising=False)
    return tmp_path / "cache"


# ---- models ----------------------------------------------------------------------------------
def _vi(name: str, elem: int, shape: list[int] | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _make(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
          inits: list[onnx.TensorProto], opset: int = 17, **kw: Any) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "m", inputs, outputs, inits, **kw)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(m)
    return m


def _i64(name: str, values: list[int]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def shape_chain(rng: np.random.Generator, blocks: int = 3) -> onnx.ModelProto:
    """What a torch export leaves for ``x.view(B, H // 2, 2, W // 2, 2, C)`` and its way back,
    block after block: Shape -> Gather -> Div/Mul -> Unsqueeze -> Concat feeding Reshapes,
    with a ConstantOfShape, a Range, an Expand and a Where (a mask built from constants), a
    Constant node of every attribute form, and per block a weight MatMul. Each block's
    Reshape target hangs on the previous block's shapes: several rounds of folding."""
    c = 8
    nodes: list[onnx.NodeProto] = [
        helper.make_node("Constant", [], ["two"], value=numpy_helper.from_array(np.array(2, np.int64))),
        helper.make_node("Constant", [], ["zero_ax"], value_ints=[0]),
        helper.make_node("Constant", [], ["one_f"], value_float=1.0),
        helper.make_node("Constant", [], ["minus1"], value_int=-1),
        helper.make_node("Constant", [], ["neg_f"], value_floats=[-1e4]),
    ]
    inits = [_i64("i0", [0]), _i64("i1", [1]), _i64("i2", [2]), _i64("i3", [3]), _i64("ax0", [0])]
    cur = "x"
    for b in range(blocks):
        p = f"b{b}_"
        inits.append(numpy_helper.from_array((rng.standard_normal((c, c)) * 0.3).astype(np.float32), p + "w"))
        nodes += [
            helper.make_node("Shape", [cur], [p + "shape"]),
            *[helper.make_node("Gather", [p + "shape", f"i{k}"], [p + f"d{k}"], axis=0) for k in range(4)],
            helper.make_node("Div", [p + "d1", "two"], [p + "h2"]),
            helper.make_node("Div", [p + "d2", "two"], [p + "w2"]),
            helper.make_node("Concat", [p + "d0", p + "h2", "i2", p + "w2", "i2", p + "d3"], [p + "t6"], axis=0),
            helper.make_node("Reshape", [cur, p + "t6"], [p + "r6"]),
            helper.make_node("Transpose", [p + "r6"], [p + "tr"], perm=[0, 1, 3, 2, 4, 5]),
            helper.make_node("Mul", [p + "h2", p + "w2"], [p + "nw"]),
            helper.make_node("Mul", [p + "d0", p + "nw"], [p + "bn"]),
            helper.make_node("Concat", [p + "bn", "i3", "i3"], [p + "t3"], axis=0),
            helper.make_node("Squeeze", [p + "t3"], [p + "t3s"]),
            helper.make_node("Slice", [p + "t3s", "i0", "i1"], [p + "lead"]),
            helper.make_node("Concat", [p + "lead", "minus1_1", p + "d3"], [p + "t3b"], axis=0),
            helper.make_node("Reshape", [p + "tr", p + "t3b"], [p + "win"]),
            helper.make_node("MatMul", [p + "win", p + "w"], [p + "mm"]),
            # a mask from constants: ConstantOfShape -> Range -> Expand -> Equal -> Where
            helper.make_node("ConstantOfShape", [p + "t3b_tail"], [p + "zeros"],
                             value=numpy_helper.from_array(np.array([0.0], np.float32))),
            helper.make_node("Range", ["r_start", p + "d3_s", "r_step"], [p + "rng"]),
            helper.make_node("Cast", [p + "rng"], [p + "rngf"], to=TensorProto.FLOAT),
            helper.make_node("Expand", [p + "rngf", p + "t3b_tail"], [p + "grid"]),
            helper.make_node("Equal", [p + "grid", p + "zeros"], [p + "eq"]),
            helper.make_node("Where", [p + "eq", "neg_f", "one_f"], [p + "mask"]),
            helper.make_node("Mul", ["i2", "i2"], [p + "four"]),
            helper.make_node("Concat", [p + "four", p + "d3"], [p + "t3b_tail"], axis=0),
            helper.make_node("Squeeze", [p + "d3", "ax0"], [p + "d3_s"]),
            helper.make_node("Add", [p + "mm", p + "mask"], [p + "mmk"]),
            helper.make_node("Reshape", [p + "mmk", p + "t6"], [p + "back6"]),
            helper.make_node("Transpose", [p + "back6"], [p + "back6t"], perm=[0, 1, 3, 2, 4, 5]),
            helper.make_node("Reshape", [p + "back6t", p + "shape"], [p + "out"]),
        ]
        cur = p + "out"
    nodes.append(helper.make_node("Identity", [cur], ["y"]))
    inits += [_i64("minus1_1", [-1]), numpy_helper.from_array(np.array(0, np.int64), "r_start"),
              numpy_helper.from_array(np.array(1, np.int64), "r_step")]
    # topological order: the Slice/Squeeze feeding the mask come after their readers above
    m = helper.make_model(
        helper.make_graph(nodes, "shape_chain", [_vi("x", TensorProto.FLOAT, ["B", "H", "W", c])],
                          [_vi("y", TensorProto.FLOAT, ["B", "H", "W", c])], inits),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return _sorted(m)


def _sorted(m: onnx.ModelProto) -> onnx.ModelProto:
    """The nodes in an order where each comes after what it reads."""
    known = {i.name for i in m.graph.input} | {i.name for i in m.graph.initializer}
    todo, done = list(m.graph.node), []
    while todo:
        for n in todo:
            if all(not i or i in known for i in n.input):
                done.append(n)
                known.update(n.output)
                todo.remove(n)
                break
        else:
            raise AssertionError("a cycle")
    del m.graph.node[:]
    m.graph.node.extend(done)
    onnx.checker.check_model(m)
    return m


def weights_folded(rng: np.random.Generator, n: int = 192) -> onnx.ModelProto:
    """Big weights (more bytes than the key holds) read by folds: an Identity of one (an
    alias), a Reshape of another and a Transpose (views), a Slice with step -1 (a view with a
    negative stride), a Cast to bfloat16 and back (new values the entry stores); a sparse
    initializer; an If kept as it is (a subgraph)."""
    w = [(rng.standard_normal((n, n)) * 0.1).astype(np.float32) for _ in range(5)]
    inits = [numpy_helper.from_array(a, f"w{k}") for k, a in enumerate(w)]
    inits += [_i64("flat", [n * n // 4, 4]), _i64("s0", [-1]), _i64("e0", [-(2**62)]), _i64("a0", [0]),
              _i64("st", [-1]), numpy_helper.from_array(np.array(True), "cond")]
    sparse = helper.make_sparse_tensor(
        numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "sp"), _i64("sp_idx", [1, 5, 7]), [n])
    then = helper.make_graph([helper.make_node("Relu", ["a_id"], ["t_out"])], "then", [],
                             [_vi("t_out", TensorProto.FLOAT, [4, n])])
    other = helper.make_graph([helper.make_node("Neg", ["a_id"], ["e_out"])], "else", [],
                              [_vi("e_out", TensorProto.FLOAT, [4, n])])
    nodes = [
        helper.make_node("Identity", ["w0"], ["w0_id"]),
        helper.make_node("MatMul", ["x", "w0_id"], ["a"]),
        helper.make_node("Identity", ["a"], ["a_id"]),
        helper.make_node("Reshape", ["w1", "flat"], ["w1_flat"]),
        helper.make_node("Reshape", ["w1_flat", "sq"], ["w1_back"]),
        helper.make_node("MatMul", ["a", "w1_back"], ["b"]),
        helper.make_node("Slice", ["w2", "s0", "e0", "a0", "st"], ["w2_rev"]),
        helper.make_node("MatMul", ["b", "w2_rev"], ["c"]),
        helper.make_node("Transpose", ["w3"], ["w3_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["c", "w3_t"], ["d"]),
        helper.make_node("Cast", ["w4"], ["w4_bf"], to=TensorProto.BFLOAT16),
        helper.make_node("Cast", ["w4_bf"], ["w4_back"], to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["d", "w4_back"], ["e"]),
        helper.make_node("Add", ["e", "sp"], ["f"]),
        helper.make_node("If", ["cond"], ["g"], then_branch=then, else_branch=other),
        helper.make_node("Add", ["f", "g"], ["y"]),
    ]
    inits.append(_i64("sq", [n, n]))
    return _make(nodes, [_vi("x", TensorProto.FLOAT, [4, n])], [_vi("y", TensorProto.FLOAT, [4, n])], inits,
                 sparse_initializer=[sparse])


def zoo(rng: np.random.Generator) -> onnx.ModelProto:
    """Initializers of every kind (tests/test_warm_setup_views.py), strings and int4 among them."""
    return _model_with(_zoo(rng))


def unnamed(rng: np.random.Generator) -> onnx.ModelProto:
    """Nodes without names and with repeated ones (renamed on parsing), Constants folded."""
    nodes = [helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(
                 rng.standard_normal((3,)).astype(np.float32))),
             helper.make_node("Add", ["x", "k"], ["a"]),
             helper.make_node("Mul", ["a", "k"], ["b"], name="dup"),
             helper.make_node("Sub", ["b", "x"], ["y"], name="dup")]
    return _make(nodes, [_vi("x", TensorProto.FLOAT, [2, 3])], [_vi("y", TensorProto.FLOAT, [2, 3])], [])


MODELS: dict[str, tuple[Callable[[np.random.Generator], onnx.ModelProto], Shapes]] = {
    "shape_chain": (shape_chain, {"x": (2, 8, 8, 8)}),
    "weights_folded": (weights_folded, {"x": (4, 192)}),
    "mixed": (_mixed, {"x": (2, 3, 4, 4)}),  # tests/test_onnx_setup_cost.py
    "glue": (lambda rng: _glue_model(rng)[0], {"x": (2, 1, 6, 8), "mask": (2, 6)}),  # tests/test_onnx_import.py
    "chain": (_chain, {"x": (1, 4, 6, 6)}),  # tests/test_onnx_floor.py
    "zoo": (zoo, {"x": (2,)}),
    "unnamed": (unnamed, {"x": (2, 3)}),
}


# ---- the comparison --------------------------------------------------------------------------
def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)


def assert_same_graph(got: OnnxGraph, want: OnnxGraph) -> None:
    """Every field of ``OnnxGraph`` and of its nodes, constants bit for bit and in order."""
    assert [n.name for n in got.nodes] == [n.name for n in want.nodes]
    for g, w in zip(got.nodes, want.nodes, strict=True):
        assert (g.op_type, g.domain, g.inputs, g.outputs, g.sources, g.implicit_inputs, g.source_ops) == (
            w.op_type, w.domain, w.inputs, w.outputs, w.sources, w.implicit_inputs, w.source_ops), g.name
        assert g.proto == w.proto, g.name
        assert list(g.attrs) == list(w.attrs), g.name
        for k in w.attrs:
            assert _same_value(g.attrs[k], w.attrs[k]), (g.name, k)
    assert got.inputs == want.inputs and got.outputs == want.outputs
    assert list(got.constants) == list(want.constants)
    for name, arr in want.constants.items():
        assert _same_value(got.constants[name], arr), name
        # a stored value comes back C-contiguous and writable; where the computed one could be
        # written to, so can the loaded one
        assert got.constants[name].flags.writeable or not arr.flags.writeable, name
    assert list(got.types.items()) == list(want.types.items())
    assert (got.opset, got.ir_version) == (want.opset, want.ir_version)
    assert got.opset_imports == want.opset_imports and got.functions == want.functions
    assert got.folded == want.folded and got.all_node_names == want.all_node_names


def _fresh(model: onnx.ModelProto, shapes: Shapes, monkeypatch: pytest.MonkeyPatch,
           views: dict[str, np.ndarray] | None = None) -> OnnxGraph:
    with monkeypatch.context() as m:
        m.setenv("FUSEGRAPH_CACHE", "0")
        return specialize_mod.specialize(model, shapes, views)


@contextlib.contextmanager
def _loading_only() -> Iterator[None]:
    def refuse(*args: Any) -> Any:
        raise AssertionError("specialize computed the graph instead of loading it")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(specialize_mod, "_infer_types", refuse)
        m.setattr(specialize_mod, "_fold_constants", refuse)
        yield


@pytest.fixture
def no_folding() -> Callable[[], contextlib.AbstractContextManager[None]]:
    """Inside ``with no_folding():`` specialize may not infer types nor fold: it must load."""
    return _loading_only


def _files(cache: Path) -> list[Path]:
    return sorted((cache / sc.SUBDIR).glob(f"*{sc.SUFFIX}"))


# ---- the loaded graph is the computed one --------------------------------------------------------
@pytest.mark.parametrize("name", list(MODELS))
def test_loaded_graph_equals_the_computed_one(name: str, rng: np.random.Generator, cache: Path,
                                              monkeypatch: pytest.MonkeyPatch, no_folding: Any) -> None:
    make, shapes = MODELS[name]
    model = make(rng)
    want = _fresh(model, shapes, monkeypatch)
    assert not _files(cache)
    first = specialize_mod.specialize(model, shapes)
    assert_same_graph(first, want)
    assert len(_files(cache)) == 1
    with no_folding():
        again = specialize_mod.specialize(model, shapes)
    assert_same_graph(again, want)
    # a model read anew from its bytes (a new session): the same again
    with no_folding():
        reread = specialize_mod.specialize(onnx.load_from_string(model.SerializeToString()), shapes)
    assert_same_graph(reread, want)


def test_the_shape_chain_folds_rounds_and_loads_them(rng: np.random.Generator, cache: Path,
                                                     monkeypatch: pytest.MonkeyPatch, no_folding: Any) -> None:
    """The shape computations fold away (only Reshape/Transpose/MatMul/Add run), in more than
    one round; the loaded graph's outputs agree with ONNX Runtime on fresh data."""
    model = shape_chain(rng)
    shapes = {"x": (2, 8, 8, 8)}
    want = _fresh(model, shapes, monkeypatch)
    assert {n.op_type for n in want.nodes} <= {"Reshape", "Transpose", "MatMul", "Add", "Identity"}, \
        sorted({n.op_type for n in want.nodes})
    assert len(want.folded) > 50
    specialize_mod.specialize(model, shapes)
    with no_folding():
        got = specialize_mod.specialize(model, shapes)
    assert_same_graph(got, want)
    x = rng.standard_normal(shapes["x"]).astype(np.float32)
    (ref,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    out = _run_graph(got, {"x": x})
    assert np.isfinite(out).all()
    err = np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref)
    assert err < 1e-5 and np.abs(out - ref).max() < 1e-4, err


def _run_graph(og: OnnxGraph, feed: dict[str, np.ndarray]) -> np.ndarray:
    """The specialized graph as a model of its own (constants as initializers) on ONNX Runtime."""
    used = {i for n in og.nodes for i in n.all_inputs()} | set(og.outputs)
    inits = [numpy_helper.from_array(a.copy(order="C"), k) for k, a in og.constants.items() if k in used]
    g = helper.make_graph([n.to_proto() for n in og.nodes], "g",
                          [_vi(i, og.types[i].elem, list(og.types[i].shape or ())) for i in og.inputs],
                          [onnx.ValueInfoProto(name=o) for o in og.outputs], inits)
    m = helper.make_model(g, opset_imports=og.opset_imports, ir_version=og.ir_version)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, feed)[0])


def test_weights_stay_views_and_are_not_stored(rng: np.random.Generator, cache: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch, no_folding: Any) -> None:
    """A model read from a file: its initializers are views of the file's bytes, and so are
    they (and the folded Identity, Reshape and reversed Slice of weights) in the loaded graph;
    the file holds only what folding made anew (the bf16-rounded weight)."""
    model = weights_folded(rng)
    path = tmp_path / "w.onnx"
    onnx.save(model, str(path))
    loaded, views = load_model_with_views(path)
    assert {"w0", "w1", "w2", "w3", "w4"} <= set(views)
    shapes = {"x": (4, 192)}
    want = _fresh(loaded, shapes, monkeypatch, views)
    specialize_mod.specialize(loaded, shapes, views)
    (f,) = _files(cache)
    head = _header(f)
    kinds = {c[1]: c[0] for c in head["constants"]}
    assert kinds["w0_id"] == "a" and kinds["sp"] == kinds["cond"] == "i" and "w0" not in kinds, kinds
    assert kinds["w1_back"] == kinds["w2_rev"] == kinds["w3_t"] == "v", kinds
    assert kinds["w4_back"] == "d", kinds
    assert set(head["deps"]) == {"w0", "w1", "w2", "w3", "w4"}  # read by folds: checked at load
    n = 192 * 192 * 4
    assert n <= f.stat().st_size < 2 * n  # w4_back, not the five weights
    again, views2 = load_model_with_views(path)
    with no_folding():
        got = specialize_mod.specialize(again, shapes, views2)
    assert_same_graph(got, want)
    assert got.constants["w0_id"] is views2["w0"]
    for name, src in (("w1_back", "w1"), ("w2_rev", "w2"), ("w3_t", "w3")):
        assert np.shares_memory(got.constants[name], views2[src]), name
    assert got.constants["w2_rev"].strides[0] < 0


def _header(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    n = int.from_bytes(data[len(sc.MAGIC): len(sc.MAGIC) + 8], "little")
    out: dict[str, Any] = json.loads(data[len(sc.MAGIC) + 8: len(sc.MAGIC) + 8 + n])
    return out


def test_session_opened_twice_loads_and_agrees_with_onnxruntime(rng: np.random.Generator, cache: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    model = shape_chain(rng, blocks=2)
    opts = {"engine": "reference", "floor": "off", "runners": "off"}
    x = rng.standard_normal((2, 8, 8, 8)).astype(np.float32)
    (ref,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for k in range(2):
        with caplog.at_level(logging.DEBUG, logger="fusegraph.onnx"):
            caplog.clear()
            sess = fgo.InferenceSession(model.SerializeToString(),
                                        providers=["FusegraphExecutionProvider", "CPUExecutionProvider"],
                                        provider_options=[opts, {}])
            (got,) = sess.run(None, {"x": x})
        assert ("specialized graph loaded" in caplog.text) == (k == 1), caplog.text
        err = np.linalg.norm(got.astype(np.float64) - ref) / np.linalg.norm(ref)
        assert np.isfinite(got).all() and err < 1e-5, err
    assert len(_files(cache)) == 1


# ---- the key -------------------------------------------------------------------------------------
def _key(model: onnx.ModelProto, shapes: Shapes) -> str:
    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for sp in model.graph.sparse_initializer:
        consts[sp.values.name] = specialize_mod._sparse_to_dense(sp)
    e = sc.entry_for(model, shapes, consts)
    assert e is not None
    return e.key


def test_key_changes_with_model_shapes_and_versions(rng: np.random.Generator, cache: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    model = _mixed(rng)
    shapes = {"x": (2, 3, 4, 4)}
    base = _key(model, shapes)
    assert _key(onnx.load_from_string(model.SerializeToString()), dict(shapes)) == base  # content, not identity
    other = {"x": (1, 3, 4, 4)}
    assert _key(model, other) != base
    small = onnx.ModelProto()
    small.CopyFrom(model)
    init = next(i for i in small.graph.initializer if i.name == "shape")
    init.CopyFrom(_i64("shape", [2, 96]))  # the same value written anew: the same key
    assert _key(small, shapes) == base
    init.CopyFrom(_i64("shape", [1, 192]))  # a small initializer's value
    assert _key(small, shapes) != base
    attr = onnx.ModelProto()
    attr.CopyFrom(model)
    conv = next(n for n in attr.graph.node if n.op_type == "Conv")
    conv.attribute[0].ints[:] = [0, 0, 0, 0]  # a node's attribute
    assert _key(attr, shapes) != base
    renamed = onnx.ModelProto()
    renamed.CopyFrom(model)
    renamed.graph.node[1].name = "relu_2"
    assert _key(renamed, shapes) != base
    monkeypatch.setattr(sc, "__version__", "0.0.0-other")
    assert _key(model, shapes) != base
    monkeypatch.undo()
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(cache))
    monkeypatch.setattr(onnx, "__version__", "0.0.0-other")
    assert _key(model, shapes) != base
    monkeypatch.setattr(onnx, "__version__", onnx.__version__)
    monkeypatch.setattr(sc, "_code_digest", lambda: "another-checkout")
    assert _key(model, shapes) != base
    monkeypatch.setattr(sc, "_code_digest", sc._code_digest)
    monkeypatch.setattr(specialize_mod, "FOLD_LIMIT", 1 << 10)
    assert _key(model, shapes) != base
    opset = onnx.ModelProto()
    opset.CopyFrom(model)
    opset.opset_import[0].version = 18
    assert _key(opset, shapes) != base


def _replace_init(model: onnx.ModelProto, name: str, value: np.ndarray) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    init = next(i for i in out.graph.initializer if i.name == name)
    init.CopyFrom(numpy_helper.from_array(value, name))
    return out


def test_big_weights_out_of_the_key_are_checked_where_folds_read_them(
        rng: np.random.Generator, cache: Path, monkeypatch: pytest.MonkeyPatch, no_folding: Any) -> None:
    """The same model with other values in a big weight: the key stays (big weights are
    hashed only where folding read them). A weight no fold reads is the new model's in the
    loaded graph; one a fold read (w4, rounded to bfloat16) makes the entry a miss:
    recomputed, and equal to the computed graph of the new model."""
    n = 192
    model = weights_folded(rng, n)
    shapes = {"x": (4, n)}
    specialize_mod.specialize(model, shapes)
    plain = _make(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], [_vi("x", TensorProto.FLOAT, [4, n])],
        [_vi("y", TensorProto.FLOAT, [4, n])], [numpy_helper.from_array(rng.standard_normal((n, n)).astype(np.float32), "w")])
    specialize_mod.specialize(plain, shapes)
    new_w = rng.standard_normal((n, n)).astype(np.float32)
    plain2 = _replace_init(plain, "w", new_w)
    assert _key(plain2, shapes) == _key(plain, shapes)
    with no_folding():
        got = specialize_mod.specialize(plain2, shapes)
    assert_same_graph(got, _fresh(plain2, shapes, monkeypatch))
    assert got.constants["w"].tobytes() == new_w.tobytes()
    new_w4 = (rng.standard_normal((n, n)) * 0.1).astype(np.float32)
    changed = _replace_init(model, "w4", new_w4)
    assert _key(changed, shapes) == _key(model, shapes)
    got = specialize_mod.specialize(changed, shapes)
    want = _fresh(changed, shapes, monkeypatch)
    assert_same_graph(got, want)
    assert got.constants["w4_back"].tobytes() == new_w4.astype(ml_dtypes.bfloat16).astype(np.float32).tobytes()
    with no_folding():  # stored again for the new weights
        assert_same_graph(specialize_mod.specialize(changed, shapes), want)


# ---- damaged, foreign, unwritable -----------------------------------------------------------------
def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _garbage(p: Path) -> None:
    p.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())


def _empty(p: Path) -> None:
    p.write_bytes(b"")


def _edit(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def edit(p: Path) -> None:
        data = p.read_bytes()
        start = len(sc.MAGIC) + 8
        n = int.from_bytes(data[len(sc.MAGIC): start], "little")
        head = json.loads(data[start: start + n])
        change(head)
        text = json.dumps(head).encode()
        p.write_bytes(sc.MAGIC + len(text).to_bytes(8, "little") + text + b"\0" * 64 + data[start + n:])
    return edit


def _bad_node(h: dict[str, Any]) -> None:
    h["nodes"].append(10**6)


def _negative_node(h: dict[str, Any]) -> None:
    h["nodes"][0] = -1


def _nodes_reordered(h: dict[str, Any]) -> None:
    h["nodes"].reverse()


def _past_end(h: dict[str, Any]) -> None:
    d = next(c for c in h["constants"] if c[0] == "d")
    d[4] = 10**9


def _object_dtype(h: dict[str, Any]) -> None:
    next(c for c in h["constants"] if c[0] == "d")[2] = "|O"


def _unknown_kind(h: dict[str, Any]) -> None:
    h["constants"][0][0] = "z"


def _other_key(h: dict[str, Any]) -> None:
    h["key"] = "0" * 64


def _header_flipped(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(sc.MAGIC) + 20] ^= 0xFF
    p.write_bytes(bytes(data))


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated": _truncate, "garbage": _garbage, "empty": _empty, "header flipped": _header_flipped,
    "node out of range": _edit(_bad_node), "negative node": _edit(_negative_node),
    "nodes reordered": _edit(_nodes_reordered), "data past the end": _edit(_past_end),
    "object dtype": _edit(_object_dtype), "unknown kind": _edit(_unknown_kind), "other key": _edit(_other_key),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_file_is_a_miss_never_a_wrong_graph(damage: str, rng: np.random.Generator, cache: Path,
                                                   monkeypatch: pytest.MonkeyPatch, no_folding: Any,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    model = shape_chain(rng, blocks=2)
    shapes = {"x": (2, 8, 8, 8)}
    want = _fresh(model, shapes, monkeypatch)
    specialize_mod.specialize(model, shapes)
    (f,) = _files(cache)
    DAMAGE[damage](f)
    with caplog.at_level(logging.INFO, logger="fusegraph.onnx"):
        got = specialize_mod.specialize(model, shapes)
    assert "not used" in caplog.text, caplog.text
    assert_same_graph(got, want)
    with no_folding():  # the damaged file was replaced by a good one
        assert_same_graph(specialize_mod.specialize(model, shapes), want)


def test_foreign_entry_under_this_key_is_a_miss(rng: np.random.Generator, cache: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Another model's entry copied over this one's file: its header names its own key."""
    a, b = _mixed(rng), _chain(rng)
    sa, sb = {"x": (2, 3, 4, 4)}, {"x": (1, 4, 6, 6)}
    specialize_mod.specialize(a, sa)
    (fa,) = _files(cache)
    specialize_mod.specialize(b, sb)
    (fb,) = [f for f in _files(cache) if f != fa]
    fb.write_bytes(fa.read_bytes())
    assert_same_graph(specialize_mod.specialize(b, sb), _fresh(b, sb, monkeypatch))


def test_cache_off_writes_nothing(rng: np.random.Generator, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEGRAPH_CACHE", "0")
    specialize_mod.specialize(shape_chain(rng, 1), {"x": (2, 4, 4, 8)})
    assert not (cache / sc.SUBDIR).exists()


def test_unwritable_cache_warns_once_and_computes(rng: np.random.Generator, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    model, shapes = _chain(rng), {"x": (1, 4, 6, 6)}
    with pytest.warns(CacheUnavailableWarning):
        got = specialize_mod.specialize(model, shapes, cache_dir=blocker)
    assert_same_graph(got, _fresh(model, shapes, monkeypatch))


def test_ml_dtypes_constants_round_trip(cache: Path, monkeypatch: pytest.MonkeyPatch, no_folding: Any,
                                               rng: np.random.Generator) -> None:
    """Folded values of ml_dtypes types are stored by name and come back bit for bit."""
    w = rng.standard_normal((4, 4)).astype(np.float32)
    nodes = [helper.make_node("Cast", ["w"], ["wb"], to=TensorProto.BFLOAT16),
             helper.make_node("Cast", ["w"], ["w8"], to=TensorProto.FLOAT8E4M3FN),
             helper.make_node("Cast", ["wb"], ["wbf"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["w8"], ["w8f"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["wbf", "w8f"], ["s"]),
             helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16),
             helper.make_node("Mul", ["xb", "wb"], ["y"])]
    model = _make(nodes, [_vi("x", TensorProto.FLOAT, [4, 4])], [_vi("y", TensorProto.BFLOAT16, [4, 4]),
                  _vi("s", TensorProto.FLOAT, [4, 4])], [numpy_helper.from_array(w, "w")], opset=21)
    shapes = {"x": (4, 4)}
    want = _fresh(model, shapes, monkeypatch)
    assert want.constants["wb"].dtype == ml_dtypes.bfloat16
    specialize_mod.specialize(model, shapes)
    with no_folding():
        assert_same_graph(specialize_mod.specialize(model, shapes), want)


# ---- the store among the others ------------------------------------------------------------------
def test_cache_command_lists_and_clears_the_store(rng: np.random.Generator, cache: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    specialize_mod.specialize(_chain(rng), {"x": (1, 4, 6, 6)})
    (f,) = _files(cache)
    assert main(["cache", "list"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("onnx-specialized "))
    assert " 1 " in line
    assert [a.path for a in cache_limit.artifacts(cache) if a.store == "onnx-specialized"] == [f]
    assert main(["cache", "clear", "--only", "onnx-specialized"]) == 0
    assert not f.exists()


def test_size_limit_evicts_specialized_graphs(rng: np.random.Generator, cache: Path) -> None:
    specialize_mod.specialize(_chain(rng), {"x": (1, 4, 6, 6)})
    specialize_mod.specialize(_mixed(rng), {"x": (2, 3, 4, 4)})
    assert len(_files(cache)) == 2
    cache_limit.set_limit(0, cache)
    assert not _files(cache)


def test_loaded_in_a_new_process(rng: np.random.Generator, cache: Path, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A second process loads what the first stored (the key holds no process's state)."""
    path = tmp_path / "chain.onnx"
    onnx.save(shape_chain(rng), str(path))
    code = (
        "import sys, logging\n"
        "logging.basicConfig(level=logging.DEBUG, stream=sys.stdout)\n"
        "from fusegraph.onnx.load import load_model_with_views\n"
        "from fusegraph.onnx.specialize import specialize\n"
        "m, v = load_model_with_views(sys.argv[1])\n"
        "og = specialize(m, {'x': (2, 8, 8, 8)}, v)\n"
        "print('NODES', len(og.nodes), len(og.constants))\n"
    )
    repo = Path(fgo.__file__).resolve().parents[2]  # this checkout's fusegraph, whatever is installed
    runs = [subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                           check=True, cwd=repo).stdout for _ in range(2)]
    assert "specialized graph loaded" not in runs[0] and "specialized graph loaded" in runs[1], runs
    assert runs[0].split("NODES")[1] == runs[1].split("NODES")[1]


def _torch_window_attention() -> tuple[bytes, np.ndarray, np.ndarray]:
    """A Swin-like window attention exported by torch with dynamic batch, height and width:
    the exporter writes ``x.shape`` arithmetic as Shape -> Gather -> Div -> Unsqueeze ->
    Concat chains feeding its Reshapes. Returns (model bytes, input, torch's output)."""
    import inspect
    import io
    import warnings

    import torch
    from torch import nn

    class Window(nn.Module):
        def __init__(self, c: int = 8, heads: int = 2) -> None:
            super().__init__()
            self.qkv, self.proj, self.heads = nn.Linear(c, 3 * c), nn.Linear(c, c), heads
            self.table = nn.Parameter(torch.randn(9, heads) * 0.5)
            idx = torch.arange(4).view(2, 2)
            self.register_buffer("index", (idx.view(-1, 1) - idx.view(1, -1)).abs().clamp(max=8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, h, w, c = x.shape
            win = x.view(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, 4, c)
            qkv = self.qkv(win).reshape(win.shape[0], 4, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
            bias = self.table[self.index.view(-1)].view(4, 4, -1).permute(2, 0, 1)
            a = (qkv[0] @ qkv[1].transpose(-2, -1)) * (c // self.heads) ** -0.5 + bias.unsqueeze(0)
            o = (a.softmax(-1) @ qkv[2]).transpose(1, 2).reshape(win.shape[0], 4, c)
            o = self.proj(o).view(b, h // 2, w // 2, 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
            return x + o

    torch.manual_seed(int(np.random.default_rng().integers(2**31)))
    module = Window().eval()
    x = torch.randn(2, 6, 4, 8)
    f = io.BytesIO()
    kw: dict[str, Any] = {"input_names": ["x"], "output_names": ["y"], "opset_version": 17,
                          "dynamic_axes": {"x": {0: "B", 1: "H", 2: "W"}}}
    if "dynamo" in inspect.signature(torch.onnx.export).parameters:
        kw["dynamo"] = False
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), f, **kw)
        want = module(x).numpy()
    return f.getvalue(), x.numpy(), want


def test_torch_export_shape_chains_fold_and_load(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                 no_folding: Any) -> None:
    pytest.importorskip("torch", reason="exports the model with torch.onnx (fusegraph[torch])")
    data, x, want_y = _torch_window_attention()
    model = onnx.load_from_string(data)
    assert {"Shape", "Gather", "Concat"} <= {n.op_type for n in model.graph.node}
    shapes = {"x": x.shape}
    want = _fresh(model, shapes, monkeypatch)
    # what is left runs on data (the Gathers pick q, k and v); the shape arithmetic folded
    assert not {"Shape", "Concat", "Unsqueeze", "Div", "Cast"} & {n.op_type for n in want.nodes}, \
        sorted(n.op_type for n in want.nodes)
    specialize_mod.specialize(model, shapes)
    with no_folding():
        got = specialize_mod.specialize(onnx.load_from_string(data), shapes)
    assert_same_graph(got, want)
    out = _run_graph(got, {"x": x})
    err = np.linalg.norm(out.astype(np.float64) - want_y) / np.linalg.norm(want_y)
    assert np.isfinite(out).all() and err < 1e-5 and np.abs(out - want_y).max() < 1e-4, err
