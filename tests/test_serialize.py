"""JSON form and content key: lossless round trips, stability across processes, and a key
that changes with any attribute, dim, stride or dtype."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fusegraph as fg
from fusegraph import (
    DataType,
    NormFwdPhase,
    PointwiseMode,
    PoolingMode,
    ReductionMode,
    ValidationError,
)

F16, F32, I32, BOOL = DataType.HALF, DataType.FLOAT, DataType.INT32, DataType.BOOLEAN


# ---- a zoo of graphs covering every op kind ---------------------------------------------------------------
def conv_block() -> fg.Graph:
    g = fg.Graph("conv_block", io_data_type=F16, intermediate_data_type=F32, compute_data_type=F32)
    xd, wd = [2, 4, 6, 6], [6, 2, 3, 3]
    x = g.tensor("x", xd, fg.strides_for(xd, "NHWC"))
    w = g.tensor("w", wd, fg.strides_for(wd, "KRSC"))
    b = g.tensor("b", [1, 6, 1, 1])
    c = g.conv_fprop(x, w, stride=[2, 1], dilation=[1, 2], pre_padding=[1, 2], post_padding=[0, 2])
    y = g.relu(g.bias(c, b), upper_clip=6.0).set_output(True)
    g.pooling(y, PoolingMode.AVG_EXCLUDE_PAD, window=[2, 2], stride=[1, 1], padding=[1, 0]).set_output(True)
    dy = g.tensor("dy", [2, 6, 3, 6])
    g.conv_dgrad(dy, w, stride=[2, 1], dilation=[1, 2], pre_padding=[1, 2], post_padding=[0, 2]).set_dim(xd).set_output(True)
    g.conv_wgrad(x, dy, stride=[2, 1], dilation=[1, 2], pre_padding=[1, 2], post_padding=[0, 2]).set_dim(wd).set_output(True)
    return g


def transformer_block() -> fg.Graph:
    g = fg.Graph("attn", io_data_type=F32)
    x = g.tensor("x", [2, 4, 8])
    gamma, beta = g.tensor("gamma", [1, 4, 8]), g.tensor("beta", [1, 4, 8])
    h, mean, inv = g.layernorm(x, gamma, beta, epsilon=1e-5, phase=NormFwdPhase.TRAINING)
    assert mean is not None and inv is not None
    mean.set_output(True)
    wq = g.tensor("wq", [8, 8], [1, 8])  # transposed
    q = g.reshape(g.matmul(h, wq), [2, 4, 2, 4])
    qt = g.transpose(q, [0, 2, 1, 3])
    mask = g.tensor("mask", [1, 1, 4, 4], data_type=BOOL)
    o = g.sdpa(qt, qt, qt, attn_scale=0.5, causal=True, mask=mask)
    r, inv_rms = g.rmsnorm(o, g.tensor("rs", [4]), epsilon=g.scalar(1e-6), phase=NormFwdPhase.TRAINING)
    assert inv_rms is not None
    g.softmax(r, axis=-1, log=True).set_output(True)
    g.gelu_approx_tanh(g.slice(r, [0, 1], [2, -1], [1, 2], axes=[0, 3])).set_output(True)
    return g


def misc_block() -> fg.Graph:
    g = fg.Graph("misc")
    a = g.tensor("a", [3, 4], data_type=np.int32)
    b = g.tensor("b", [1, 4], [0, 1], data_type=np.int32)
    s = g.add(a, b)
    cond = g.cmp_ge(s, g.scalar(2))
    g.binary_select(s, g.neg(s), cond).set_output(True)
    g.reduction(s, ReductionMode.AMAX, axes=[0]).set_output(True)
    f = g.tensor("f", [3, 4], data_type=F16)
    g.concatenate([f, g.softplus(f, beta=2.0), g.elu(f, alpha=0.5)], axis=0).set_output(True)
    bn_in = g.tensor("bn", [2, 3, 4], data_type=F32)
    ps = [g.tensor(n, [3], data_type=F32) for n in ("s", "sh", "m", "v")]
    g.batchnorm_inference(bn_in, *ps, epsilon=1e-3).set_output(True)
    y, _, _ = g.batchnorm(bn_in, ps[0], ps[1])
    y.set_output(True).set_data_type(F16)
    g.pointwise(f, mode=PointwiseMode.RELU_FWD, relu_lower_clip=-math.inf).set_output(True)
    return g


ZOO: dict[str, Callable[[], fg.Graph]] = {
    "conv_block": conv_block,
    "transformer_block": transformer_block,
    "misc_block": misc_block,
}


def zoo_keys() -> dict[str, str]:
    """Keys of the zoo, as a fresh process computes them (see test below)."""
    return {name: build().key() for name, build in ZOO.items()}


def random_inputs(g: fg.Graph, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for t in g.inputs():
        dense = rng.uniform(0.5, 2.0, t.shape) if t.dtype != BOOL else rng.random(t.shape) < 0.8
        if t.name == "v":
            dense = np.abs(dense)
        arr = fg.graph.layout.empty_strided(t.shape, [s or 1 for s in t.strides], t.dtype.numpy)
        arr[...] = dense
        if 0 in t.strides:  # a broadcast input: one row, viewed with zero strides
            arr = np.broadcast_to(arr[tuple(slice(0, 1) if s == 0 else slice(None) for s in t.strides)], t.shape)
        out[t.name] = arr
    return out


# ---- round trips ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(ZOO))
def test_round_trip_is_lossless(name: str) -> None:
    g = ZOO[name]().validate()
    text = g.to_json()
    g2 = fg.Graph.from_json(text)
    assert g2.to_json() == text
    assert g2.key() == g.key()
    assert g2.to_json() == text  # validating the copy changes nothing
    assert g2.name == g.name
    assert [n.name for n in g2.nodes] == [n.name for n in g.nodes]
    for t, t2 in zip(g.tensors, g2.tensors, strict=True):
        assert (t.name, t.dim, t.stride, t.data_type, t.is_virtual, t.is_output, t.value) == (
            t2.name, t2.dim, t2.stride, t2.data_type, t2.is_virtual, t2.is_output, t2.value
        )
    for n, n2 in zip(g.nodes, g2.nodes, strict=True):
        assert n.kind == n2.kind and n.attrs == n2.attrs
        assert list(n.inputs) == list(n2.inputs) and list(n.outputs) == list(n2.outputs)


@pytest.mark.parametrize("name", list(ZOO))
def test_a_loaded_graph_computes_the_same(name: str, rng: np.random.Generator) -> None:
    g = ZOO[name]()
    g2 = fg.Graph.from_json(g.validate().to_json())
    pack = random_inputs(g, rng)
    r1 = g.execute(pack, engine="reference")
    r2 = g2.execute(pack, engine="reference")
    assert set(r1) == set(r2) == {t.name for t in g.outputs()}
    for k in r1:
        np.testing.assert_array_equal(r1[k], r2[k])


def test_round_trip_of_an_unvalidated_graph() -> None:
    g = fg.Graph("lazy", io_data_type=F32)
    dy = g.tensor("dy", [1, 2, 3, 3])
    dx = g.conv_dgrad(dy, g.tensor("w", [2, 2, 3, 3])).set_output(True)
    text = g.to_json()
    g2 = fg.Graph.from_json(text)
    assert g2.to_json() == text
    g2.tensor_by_name(dx.name).set_dim([1, 2, 5, 5])
    dx.set_dim([1, 2, 5, 5])
    assert g2.key() == g.key()


def test_nodes_added_after_loading_get_fresh_names() -> None:
    g = fg.Graph.from_json(conv_block().validate().to_json())
    y = g.tanh(g.tensor_by_name("x"))
    names = [t.name for t in g.tensors] + [n.name for n in g.nodes]
    assert len(names) == len(set(names)) and y.name in names


def test_json_document_shape() -> None:
    g = misc_block().validate()
    text = g.to_json(indent=2)
    assert "\n" in text
    d = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert d["format"] == "fusegraph.graph" and d["version"] == 1 and d["name"] == "misc"
    assert {"tensors", "nodes", "io_data_type", "intermediate_data_type", "compute_data_type"} <= set(d)
    relu = next(n for n in d["nodes"] if n["attrs"].get("mode") == "relu_fwd")
    assert dict(relu["attrs"]["params"])["relu_lower_clip"] == "-inf"
    assert dict(relu["attrs"]["params"])["relu_upper_clip"] == "inf"
    assert json.loads(g.to_json()) == d


@pytest.mark.parametrize(
    "edit,words",
    [
        (lambda d: d.update(format="onnx"), "format"),
        (lambda d: d.update(version=99), "version"),
        (lambda d: d.pop("nodes"), "nodes"),
    ],
)
def test_foreign_documents_are_rejected(edit: Callable[[dict[str, Any]], Any], words: str) -> None:
    d = json.loads(misc_block().to_json())
    edit(d)
    with pytest.raises(ValidationError, match=words):
        fg.Graph.from_json(json.dumps(d))


@pytest.mark.parametrize("text", ["{", "[]", "null"])
def test_malformed_json_text(text: str) -> None:
    with pytest.raises(ValidationError):
        fg.Graph.from_json(text)


# ---- the key ---------------------------------------------------------------------------------------------------------
def test_key_is_a_sha256_hex_and_ignores_the_graph_name() -> None:
    g1, g2 = conv_block(), conv_block()
    g2.name = "renamed"
    assert len(g1.key()) == 64 and int(g1.key(), 16) >= 0
    assert g1.key() == g2.key()


def test_keys_are_stable_in_a_fresh_process() -> None:
    here = zoo_keys()
    assert len(set(here.values())) == len(here)
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import test_serialize as t; "
        "print(json.dumps(t.zoo_keys()))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=120, env=env, check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


def _chain(dims: list[int], strides: list[int] | None, dt: DataType, modes: list[tuple[PointwiseMode, float]]) -> fg.Graph:
    g = fg.Graph("chain", io_data_type=dt)
    t = g.tensor("x", dims, strides)
    for mode, p in modes:
        if mode == PointwiseMode.ELU_FWD:
            t = g.pointwise(t, mode=mode, elu_alpha=p)
        elif mode == PointwiseMode.ADD:
            t = g.pointwise(t, g.scalar(p), mode=mode)
        else:
            t = g.pointwise(t, mode=mode)
    t.set_output(True)
    return g


chain_st = st.tuples(
    st.lists(st.integers(1, 4), min_size=1, max_size=4),
    st.booleans(),
    st.sampled_from([F32, F16, DataType.BFLOAT16, DataType.DOUBLE]),
    st.lists(
        st.tuples(
            st.sampled_from([PointwiseMode.ELU_FWD, PointwiseMode.ADD, PointwiseMode.TANH_FWD, PointwiseMode.EXP]),
            st.floats(-4, 4, allow_nan=False).filter(lambda v: v != 0),
        ),
        min_size=1,
        max_size=4,
    ),
)


def _strides(dims: list[int], reverse: bool) -> list[int] | None:
    if not reverse:
        return None
    return list(fg.graph.layout.packed_strides(dims, list(reversed(range(len(dims))))))


@settings(max_examples=60, deadline=None)
@given(chain_st)
def test_random_graphs_round_trip_and_keep_their_key(spec: tuple[Any, ...]) -> None:
    dims, rev, dt, modes = spec
    g = _chain(dims, _strides(dims, rev), dt, modes).validate()
    text = g.to_json()
    g2 = fg.Graph.from_json(text)
    assert g2.to_json() == text and g2.key() == g.key()
    assert _chain(dims, _strides(dims, rev), dt, modes).key() == g.key()


@settings(max_examples=80, deadline=None)
@given(chain_st, st.data())
def test_any_change_of_dim_stride_dtype_or_attribute_changes_the_key(spec: tuple[Any, ...], data: st.DataObject) -> None:
    dims, rev, dt, modes = spec
    modes = list(modes)
    what = data.draw(st.sampled_from(["dim", "stride", "dtype", "mode", "param"]))
    i = data.draw(st.integers(0, len(modes) - 1))
    dims2, rev2, dt2, modes2 = list(dims), rev, dt, list(modes)
    if what == "dim":
        dims2[i % len(dims)] += 1
    elif what == "stride":
        if len([d for d in dims if d > 1]) < 2:  # a layout change needs two axes longer than 1
            dims = dims2 = [*dims, 2, 3]
        rev2 = not rev
    elif what == "dtype":
        dt2 = data.draw(st.sampled_from([d for d in (F32, F16, DataType.BFLOAT16, DataType.DOUBLE) if d != dt]))
    elif what == "mode":
        modes2[i] = (PointwiseMode.SIN, modes[i][1])  # not among the modes chain_st draws
    else:
        modes[i] = (PointwiseMode.ELU_FWD, modes[i][1])
        modes2[i] = (PointwiseMode.ELU_FWD, modes[i][1] + 0.5)
    base = _chain(dims, _strides(dims, rev), dt, modes).key()
    changed = _chain(dims2, _strides(dims2, rev2), dt2, modes2).key()
    assert changed != base, what


def _key_after(edit: Callable[[fg.Graph], Any]) -> str:
    g = conv_block()
    edit(g)
    return g.key()


EDITS: dict[str, Callable[[fg.Graph], Any]] = {
    "conv stride": lambda g: g.nodes.__setitem__(0, _replace_attr(g.nodes[0], stride=(1, 1))),
    "conv dilation": lambda g: g.nodes.__setitem__(0, _replace_attr(g.nodes[0], dilation=(1, 1))),
    "conv padding": lambda g: g.nodes.__setitem__(0, _replace_attr(g.nodes[0], post_padding=(1, 2))),
    "compute type": lambda g: g.nodes.__setitem__(0, _replace_attr(g.nodes[0], compute_data_type=DataType.DOUBLE)),
    "relu clip": lambda g: g.nodes.__setitem__(2, _replace_attr(g.nodes[2], params=(("relu_lower_clip", 0.0), ("relu_upper_clip", 5.0), ("relu_lower_clip_slope", 0.0)))),
    "pool window": lambda g: g.nodes.__setitem__(3, _replace_attr(g.nodes[3], mode=PoolingMode.MAX)),
    "input layout": lambda g: g.tensor_by_name("x").set_stride(fg.strides_for([2, 4, 6, 6], "NCHW")),
    "input dtype": lambda g: g.tensor_by_name("b").set_data_type(F32),
    "output dtype": lambda g: g.outputs()[0].set_data_type(F32),
    "output layout": lambda g: g.outputs()[0].set_stride(fg.strides_for([2, 6, 3, 6], "NCHW")),
    "an extra output": lambda g: g.nodes[0].outputs["y"].set_output(True),
    "a tensor name": lambda g: g.tensor_by_name("b").set_name("bias"),
    "dgrad dims": lambda g: g.nodes[4].outputs["dx"].set_dim([2, 4, 7, 6]),  # same dy: a remainder row
}


def _replace_attr(node: Any, **changes: Any) -> Any:
    import dataclasses

    node.attrs = dataclasses.replace(node.attrs, **changes)
    return node


@pytest.mark.parametrize("what", list(EDITS))
def test_each_edit_of_a_real_graph_changes_the_key(what: str) -> None:
    base = conv_block().key()
    assert _key_after(EDITS[what]) != base
