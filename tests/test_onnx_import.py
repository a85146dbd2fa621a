"""The ONNX op table (fusegraph/onnx/ops): structure of the registry, the glue-op lowerings
against ONNX Runtime on fresh random data on each engine, and whole tiny transformer exports
(tests/data/, made by tests/data/make_tiny_transformers.py): shape computation folded, the
glue claimed, few units, outputs equal to ONNX Runtime's."""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import fusegraph.onnx as fgo
from fusegraph.engines.registry import REGISTRY
from fusegraph.onnx import importer
from fusegraph.onnx.model import load_model, specialize
from fusegraph.onnx.ops import SPATIAL_OPS, TABLE, lowers, register
from fusegraph.onnx.ops.shape import arithmetic_runs
from fusegraph.onnx.ops.table import OpEntry

DATA = Path(__file__).parent / "data"
# Ops that only compute shapes: with static input shapes none of them may survive folding.
SHAPE_OPS = frozenset({"Shape", "Size", "ConstantOfShape", "Range", "Equal", "Where", "Cast", "Unsqueeze",
                       "Squeeze", "Expand", "Mod", "ScatterND", "NonZero"})


def _engine_or_skip(name: str) -> None:
    if name == "reference":
        return
    try:
        ok = bool(REGISTRY.get(name).available())
    except Exception as exc:  # a broken engine is reported as the reason
        pytest.skip(f"engine {name} cannot be loaded here: {exc}")
    if not ok:
        pytest.skip(f"engine {name} is not available here")


def _session(model: onnx.ModelProto | Path, engine: str, **opts: Any) -> fgo.InferenceSession:
    src = str(model) if isinstance(model, Path) else model.SerializeToString()
    options = {"engine": engine, "torch_mlir_tier": "off", "floor": "off", "strict": 1, **opts}
    return fgo.InferenceSession(src, providers=[(fgo.PROVIDER, options), "CPUExecutionProvider"])


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert g.shape == w.shape and not np.isnan(g).any() and not np.isnan(w).any()
    return float(np.linalg.norm(g - w) / max(float(np.linalg.norm(w)), 1e-30))


def _model(nodes: Sequence[onnx.NodeProto], inputs: Mapping[str, tuple[int, Sequence[int]]],
           outputs: Mapping[str, tuple[int, Sequence[int]]], inits: Mapping[str, np.ndarray] | None = None) -> onnx.ModelProto:
    graph = helper.make_graph(
        list(nodes), "m",
        [helper.make_tensor_value_info(n, t, list(s)) for n, (t, s) in inputs.items()],
        [helper.make_tensor_value_info(o, t, list(s)) for o, (t, s) in outputs.items()],
        [onnx.numpy_helper.from_array(v, k) for k, v in (inits or {}).items()],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m)
    return m


# ---- the table --------------------------------------------------------------------------------
def test_every_op_type_has_one_entry_in_its_family_module() -> None:
    families = {e.family for e in TABLE.values()}
    assert families == {"conv", "gemm", "elementwise", "gqa", "norm", "rotary", "shape"}
    for op, entry in TABLE.items():
        assert isinstance(entry, OpEntry) and entry.op_type == op
        assert entry.lower.__module__ == f"fusegraph.onnx.ops.{entry.family}"
    assert {"Conv", "MatMul", "Add", "LayerNormalization", "Reshape", "Where", "Cast", "IsNaN", "Expand"} <= set(TABLE)


def test_spatial_ops_come_from_the_table() -> None:
    assert {"Conv", "ConvTranspose", "MaxPool", "AveragePool", "LRN"} == SPATIAL_OPS
    assert importer.SPATIAL_OPS is SPATIAL_OPS


def test_a_second_lowering_for_one_op_type_is_refused() -> None:
    with pytest.raises(ValueError, match="already lowered"):
        register("Conv", TABLE["Relu"].lower)
    with pytest.raises(ValueError, match="already lowered"):
        lowers("MatMul")(TABLE["Relu"].lower)


def test_arithmetic_runs() -> None:
    assert arithmetic_runs(np.array([0, 1, 2, 3])) == [(0, 3, 1)]
    assert arithmetic_runs(np.array([2, 0, 1])) == [(2, 2, 1), (0, 1, 1)]
    assert arithmetic_runs(np.array([1, 3, 5, 0, 4])) == [(1, 5, 2), (0, 4, 4)]
    assert arithmetic_runs(np.array([3, 3])) == [(3, 3, 1), (3, 3, 1)]


# ---- glue ops vs ONNX Runtime, per engine -----------------------------------------------------
def _glue_model(rng: np.random.Generator) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The glue a transformer export leaves between its blocks, all on activations."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    x = rng.standard_normal((2, 1, 6, 8)).astype(np.float32)
    x[0, 0, 1, 2] = np.nan
    x[1, 0, 3, 4] = np.inf
    x[1, 0, 0, 0] = 0.0
    mask = rng.integers(0, 2, (2, 6)).astype(np.int64)
    nodes = [
        helper.make_node("IsNaN", ["x"], ["nan"]),
        helper.make_node("IsInf", ["x"], ["inf"], detect_negative=0),
        helper.make_node("Or", ["nan", "inf"], ["bad"]),
        helper.make_node("Not", ["bad"], ["good"]),
        helper.make_node("Where", ["bad", "zero", "x"], ["clean"]),
        helper.make_node("Cast", ["clean"], ["nz"], to=TensorProto.BOOL),  # float -> bool: != 0
        helper.make_node("And", ["nz", "good"], ["keep"]),
        helper.make_node("Cast", ["keep"], ["keepf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask", "ax12"], ["m4"]),  # [2, 1, 1, 6]
        helper.make_node("Cast", ["m4"], ["m4f"], to=TensorProto.FLOAT),
        helper.make_node("Expand", ["m4f", "shape"], ["mexp"]),  # [2, 1, 6, 6]
        helper.make_node("Equal", ["mexp", "zero"], ["masked"]),
        helper.make_node("Trilu", ["mexp", "k"], ["tri"], upper=0),
        helper.make_node("Where", ["masked", "neg", "tri"], ["bias"]),
        helper.make_node("Neg", ["m4f"], ["m4n"]),
        helper.make_node("Where", ["colmask", "m4f", "m4n"], ["wsel"]),  # no operand has the output's dims
        helper.make_node("Add", ["bias", "wsel"], ["bias2"]),
        helper.make_node("Gather", ["clean", "idx"], ["pick"], axis=3),  # non-arithmetic indices
        helper.make_node("MatMul", ["bias2", "pick"], ["mm"]),
        helper.make_node("Mul", ["mm", "keepf"], ["y"]),
        helper.make_node("Transpose", ["masked"], ["mt"], perm=[0, 1, 3, 2]),
        helper.make_node("Xor", ["masked", "mt"], ["sym"]),
        helper.make_node("Cast", ["sym"], ["y2"], to=TensorProto.INT32),
    ]
    inits = {
        "zero": np.array(0.0, np.float32), "neg": np.array(-1e4, np.float32),
        "ax12": np.array([1, 2], np.int64), "shape": np.array([2, 1, 6, 6], np.int64),
        "k": np.array(1, np.int64), "colmask": rng.integers(0, 2, (1, 1, 6, 1)).astype(bool), "idx": np.array([7, 0, 1, 2, 5, 3, 3, 6], np.int64),
    }
    m = _model(nodes, {"x": (f, x.shape), "mask": (i64, mask.shape)}, {"y": (f, [2, 1, 6, 8]), "y2": (TensorProto.INT32, [2, 1, 6, 6])}, inits)
    return m, {"x": x, "mask": mask}


@pytest.mark.parametrize("engine", ["reference", "torch", "iree"])
def test_glue_ops_claimed_and_equal_to_onnxruntime(engine: str, rng: np.random.Generator,
                                                    iree_cache_dir: Path) -> None:
    _engine_or_skip(engine)
    model, feed = _glue_model(rng)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    sess = _session(model, engine)
    rep = sess.partition_report()
    assert not rep.unclaimed, [(u.op_type, u.reason) for u in rep.unclaimed]
    assert len(rep.subgraphs) == 1
    assert {"IsNaN", "IsInf", "Where", "Cast", "Expand", "Trilu", "Gather", "Equal", "Not", "Xor"} <= set(rep.subgraphs[0].op_types)
    got = sess.run(None, feed)
    assert _rel(got[0], want[0]) < 1e-5
    assert got[1].dtype == want[1].dtype and np.array_equal(got[1], want[1])


def test_glue_refusals_say_why() -> None:
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    m = _model([
        helper.make_node("Gather", ["table", "ids"], ["emb"], axis=0),
        helper.make_node("GatherElements", ["emb", "ids2"], ["ge"], axis=1),
        helper.make_node("Relu", ["ge"], ["y"]),
    ], {"table": (f, [10, 4]), "ids": (i64, [3]), "ids2": (i64, [3, 4])}, {"y": (f, [3, 4])})
    reasons = {u.op_type: u.reason for u in _session(m, "reference").partition_report().unclaimed}
    assert "Gather" not in reasons  # the graph's gather op (tests/test_onnx_gather.py)
    assert "GatherElements" in reasons and "run time" in reasons["GatherElements"]


# ---- real exports ------------------------------------------------------------------------------
def _feed(name: str) -> dict[str, np.ndarray]:
    with np.load(DATA / f"{name}.npz") as z:
        return {k: z[k] for k in z.files}


def test_shape_computation_is_folded_in_a_deep_export() -> None:
    """torchvision's Swin computes every shape at run time; each block's shapes hang on the
    previous block's, so folding must run to a fixed point (8 rounds left ~200 here)."""
    model = load_model(DATA / "tiny_tv_swin.onnx")
    before = collections.Counter(n.op_type for n in model.graph.node)
    assert before["Shape"] > 50 and before["ConstantOfShape"] > 10
    og = specialize(model, {"x": (1, 3, 64, 64)})
    left = collections.Counter(n.op_type for n in og.nodes)
    assert not {op: k for op, k in left.items() if op in SHAPE_OPS}, left
    assert len(og.nodes) < len(model.graph.node) / 3


@pytest.mark.parametrize(("name", "max_units", "ort_nodes"), [
    # the embedding lookup (indices = input ids) is the graph's gather op; BERT's token-type
    # ids over 80 positions are a GatherElements of constants that onnx.reference cannot fold
    # (NumPy path)
    ("tiny_bert", 2, set()),
    ("tiny_gpt2", 3, set()),
    ("tiny_llama", 2, set()),
    ("tiny_tv_swin", 1, set()),
])
def test_tiny_transformers_few_units_and_equal_to_onnxruntime(
    name: str, max_units: int, ort_nodes: set[str]
) -> None:
    path = DATA / f"{name}.onnx"
    feed = _feed(name)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)
    sess = _session(path, "reference")
    rep = sess.partition_report()
    assert {u.op_type for u in rep.unclaimed} == ort_nodes, [(u.op_type, u.reason) for u in rep.unclaimed]
    assert len(rep.subgraphs) <= max_units
    (got,) = sess.run(None, feed)
    assert _rel(got, want[0]) < 1e-5


def test_folding_never_duplicates_a_big_weight(rng: np.random.Generator) -> None:
    """Transpose(W) of a W that another node also reads stays a node (folding it would keep
    two copies of W); with one reader it is folded and W dropped."""
    f = TensorProto.FLOAT
    w = rng.standard_normal((1030, 1024)).astype(np.float32)  # > 1M elements
    shared = _model([
        helper.make_node("Transpose", ["w"], ["wt"]),
        helper.make_node("MatMul", ["x", "w"], ["a"]),       # x [2, 1030] @ w [1030, 1024]
        helper.make_node("MatMul", ["a", "wt"], ["y"]),      # [2, 1024] @ [1024, 1030]
    ], {"x": (f, [2, 1030])}, {"y": (f, [2, 1030])}, {"w": w})
    og = specialize(shared, {"x": (2, 1030)})
    assert [n.op_type for n in og.nodes] == ["Transpose", "MatMul", "MatMul"]
    assert sum(c.size for c in og.constants.values()) == w.size
    alone = _model([
        helper.make_node("Transpose", ["w"], ["wt"]),
        helper.make_node("MatMul", ["x", "wt"], ["y"]),
    ], {"x": (f, [2, 1024])}, {"y": (f, [2, 1030])}, {"w": w})
    og = specialize(alone, {"x": (2, 1024)})
    assert [n.op_type for n in og.nodes] == ["MatMul"]
    assert sum(c.size for c in og.constants.values()) == w.size
    x = rng.standard_normal((2, 1030)).astype(np.float32)
    want = ort.InferenceSession(shared.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    (got,) = _session(shared, "reference").run(None, {"x": x})
    assert _rel(got, want[0]) < 1e-5


@pytest.mark.parametrize("engine", ["torch", "iree"])
@pytest.mark.parametrize("name", ["tiny_bert", "tiny_llama"])
def test_tiny_transformers_on_compiling_engines(name: str, engine: str, iree_cache_dir: Path) -> None:
    """The glue (mask Expand/Where/IsNaN, grouped-query Expand) built into one unit by each
    compiling engine (strict: a failed build raises instead of falling back)."""
    _engine_or_skip(engine)
    path = DATA / f"{name}.onnx"
    feed = _feed(name)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)
    sess = _session(path, engine)
    claimed = [sg for sg in sess.partition_report().subgraphs if sg.kind != "onnxruntime"]
    assert len(claimed) == 1 and claimed[0].engine.startswith(engine), [(sg.kind, sg.engine) for sg in claimed]
    (got,) = sess.run(None, feed)
    assert _rel(got, want[0]) < 1e-5
