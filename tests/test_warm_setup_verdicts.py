"""Per-node claim verdicts shared between nodes alike (issue 24 item 6): a node whose op,
attributes, input / output types and shapes, small constants' values and readers match a
node found claimable is claimable without being lowered again; refusals are never shared.
A model of repeated blocks (with weights of their own, an op that stays on ONNX Runtime, a
value read twice) gets the same verdicts with the sharing as without it, fewer nodes are
lowered, and the session agrees with ONNX Runtime."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import fusegraph.onnx as fgo
from fusegraph.onnx import plan as plan_mod
from fusegraph.onnx.importer import Importer

pytestmark = pytest.mark.usefixtures("own_cache")

PROVIDERS = ["FusegraphExecutionProvider", "CPUExecutionProvider"]
OPTS: dict[str, Any] = {"engine": "torch", "floor": "off", "floor_mode": "inline", "runners": "off"}


def _blocks(rng: np.random.Generator, n: int = 4, d: int = 16) -> onnx.ModelProto:
    nodes, inits = [], []
    x = "x"
    for k in range(n):
        w = f"w{k}"
        inits.append(numpy_helper.from_array((rng.standard_normal((d, d)) * 0.3).astype(np.float32), w))
        inits.append(numpy_helper.from_array(np.array([2, 2 * d], np.int64), f"shape{k}"))
        inits.append(numpy_helper.from_array(np.array([4, d], np.int64), f"back{k}"))
        nodes += [
            helper.make_node("MatMul", [x, w], [f"m{k}"]),
            helper.make_node("Add", [f"m{k}", x], [f"a{k}"]),  # residual
            helper.make_node("Mul", [f"a{k}", f"a{k}"], [f"sq{k}"]),  # one value read twice
            helper.make_node("Relu", [f"sq{k}"], [f"r{k}"]),
            helper.make_node("Reshape", [f"r{k}", f"shape{k}"], [f"re{k}"]),
            helper.make_node("Softmax", [f"re{k}"], [f"s{k}"], axis=-1),
            helper.make_node("Tanh", [f"s{k}"], [f"t{k}"]),  # excluded below: stays on ONNX Runtime
            helper.make_node("Reshape", [f"t{k}", f"back{k}"], [f"y{k}"]),
        ]
        x = f"y{k}"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    g = helper.make_graph(nodes, "blocks", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, d])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, d])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _open(model: onnx.ModelProto, monkeypatch: pytest.MonkeyPatch, share: bool) -> tuple[Any, int]:
    lowered = [0]
    real = Importer.lower

    def counting(self: Importer, node: Any) -> None:
        lowered[0] += 1
        real(self, node)

    with monkeypatch.context() as m:
        m.setattr(Importer, "lower", counting)
        if not share:
            m.setattr(plan_mod.SessionPlan, "_verdict_key", lambda self, node, channels_last: None)
        opts = {**OPTS, "op_types_to_exclude": "Tanh"}
        sess = fgo.InferenceSession(model.SerializeToString(), providers=PROVIDERS, provider_options=[opts, {}])
    return sess, lowered[0]


def test_shared_verdicts_equal_the_plain_ones(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _blocks(rng)
    shared, n_shared = _open(model, monkeypatch, True)
    plain, n_plain = _open(model, monkeypatch, False)
    assert shared._last.node_verdicts == plain._last.node_verdicts
    refused = [k for k, v in plain._last.node_verdicts.items() if v]
    assert refused and all("op_types_to_exclude" in plain._last.node_verdicts[k] for k in refused)
    assert n_shared < n_plain, (n_shared, n_plain)  # the later blocks were not lowered node by node
    x = rng.standard_normal((4, 16)).astype(np.float32)
    (want,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    (got,) = shared.run(None, {"x": x})
    err = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want)
    assert np.isfinite(got).all() and err < 1e-5, err


def test_key_tells_apart_what_lowering_reads(rng: np.random.Generator) -> None:
    """Constants' values (small ones), large ones' names (but their type and shape for ops
    that only bind weights), a value read twice and attribute values (-0.0 and 0.0 included)
    give different keys; a tensor attribute none."""
    model = _blocks(rng, n=2)
    sess = fgo.InferenceSession(model.SerializeToString(), providers=PROVIDERS, provider_options=[OPTS, {}])
    plan = sess._last
    by_name = {n.name: n for n in plan.og.nodes}
    ops = {n.op_type: [] for n in plan.og.nodes}
    for n in plan.og.nodes:
        ops[n.op_type].append(n)

    def key(n: Any) -> Any:
        return plan._verdict_key(n, False)

    mm0, mm1 = ops["MatMul"]
    assert key(mm0) == key(mm1)  # MatMul only binds its weight: keyed by its type and shape
    as_prelu = [type(n)(**{**n.__dict__, "op_type": "PRelu"}) for n in (mm0, mm1)]
    assert key(as_prelu[0]) != key(as_prelu[1])  # elsewhere a large constant is keyed by its name
    add0, add1 = ops["Add"]
    assert key(add0) == key(add1)
    mul0 = ops["Mul"][0]
    other = type(mul0)(**{**mul0.__dict__, "inputs": (mul0.inputs[0], add1.outputs[0])})
    assert key(other) != key(mul0)  # the same value twice is not two values
    re0, re1 = ops["Reshape"][0], ops["Reshape"][1]
    assert key(re0) != key(re1)  # shape constants [2, 16] and [4, 8]
    sm = ops["Softmax"][0]
    for a, b in ((-1, 1), (0.0, -0.0)):
        assert key(type(sm)(**{**sm.__dict__, "attrs": {"axis": a}})) != key(type(sm)(**{**sm.__dict__, "attrs": {"axis": b}}))
    last = by_name[plan.og.nodes[-1].name]
    assert key(type(last)(**{**last.__dict__, "attrs": {"t": onnx.TensorProto()}})) is None
