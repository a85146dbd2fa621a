"""The backward ops as graph IR: validation errors that name the node and tensor, the JSON
round trip (same key, same answers), the keys of graphs without the new features unchanged,
and the engines that declare they do not run them (with the reason)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import fusegraph as fg
from fusegraph.dtypes import DataType
from fusegraph.engines.unsupported import declared_unsupported
from fusegraph.errors import ValidationError
from fusegraph.graph.ops import OpKind
from fusegraph.reference.executor import run_reference
from fusegraph.reference.inputs import random_inputs

F32, I64 = DataType.FLOAT, DataType.INT64


def _norms_graph() -> fg.Graph:
    g = fg.Graph("norms", io_data_type=F32)
    x, s, b, dy = g.tensor("x", [4, 6]), g.tensor("s", [6]), g.tensor("b", [6]), g.tensor("dy", [4, 6])
    _, mean, inv = g.layernorm(x, s, b, 1e-5, phase=fg.NormFwdPhase.TRAINING)
    _, inv_rms = g.rmsnorm(x, s, 1e-5, phase=fg.NormFwdPhase.TRAINING)
    assert mean is not None and inv is not None and inv_rms is not None
    outs = [*g.layernorm_backward(dy, x, s, mean, inv), *g.rmsnorm_backward(dy, x, s, inv_rms, has_dbias=True)]
    xb, cs = g.tensor("xb", [3, 2, 5]), g.tensor("cs", [2])
    rm, rv = g.tensor("rm", [2]), g.tensor("rv", [2])
    _, bm, bi, nrm, nrv = g.batchnorm(xb, cs, cs, 1e-3, in_running_mean=rm, in_running_var=rv, momentum=0.3)
    outs += [*g.batchnorm_backward(g.tensor("dyb", [3, 2, 5]), xb, cs, bm, bi), nrm, nrv]
    for t in outs:
        assert t is not None
        t.set_output(True)
    return g


def _attention_graph(p: float = 0.25) -> fg.Graph:
    g = fg.Graph("attn", io_data_type=F32)
    q, k, v = g.tensor("q", [1, 4, 3, 8]), g.tensor("k", [1, 2, 5, 8]), g.tensor("v", [1, 2, 5, 8])
    seed, off = g.tensor("seed", [1], data_type=I64), g.scalar(17, I64)
    drop = (p, seed, off) if p else None
    o, st = g.sdpa(q, k, v, causal=True, generate_stats=True, dropout=drop)
    grads = g.sdpa_backward(q, k, v, o, g.tensor("do", [1, 4, 3, 8]), st, causal=True, dropout=drop)
    for t in (o, st, *grads):
        t.set_output(True)
    return g


@pytest.mark.parametrize("build", (_norms_graph, _attention_graph), ids=("norms", "attention"))
def test_json_round_trip_keeps_key_and_answers(build: object, rng: np.random.Generator) -> None:
    g = build().validate()  # type: ignore[operator]
    h = fg.Graph.from_json(g.to_json()).validate()
    assert h.key() == g.key()
    assert [n.kind for n in h.nodes] == [n.kind for n in g.nodes]
    feeds = random_inputs(g, rng)
    if "seed" in feeds:
        feeds["seed"] = np.array([int(rng.integers(-(2**62), 2**62))], np.int64)
    a, b = run_reference(g, feeds), run_reference(h, feeds)
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name], b[name], equal_nan=True), name


def test_attention_without_dropout_keeps_its_json_and_key() -> None:
    """dropout_probability was added to SdpaAttrs after the format was fixed: at 0 it is not
    written, so graphs saved before (and their tuning records) keep their keys."""
    g = fg.Graph(io_data_type=F32)
    q = g.tensor("q", [1, 2, 3, 4])
    g.sdpa(q, q, q, causal=True).set_output(True)
    attrs = json.loads(g.to_json())["nodes"][0]["attrs"]
    assert attrs == {"attn_scale": None, "causal": True, "compute_data_type": None}
    assert "dropout_probability" in json.loads(_attention_graph().to_json())["nodes"][0]["attrs"]


# ---- validation ----------------------------------------------------------------------------------
def _err(fn: object, *words: str) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        fn()  # type: ignore[operator]
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    return info.value


def test_norm_backward_shape_errors_name_the_tensor() -> None:
    g = fg.Graph(io_data_type=F32)
    x, s, b = g.tensor("x", [4, 6]), g.tensor("s", [6]), g.tensor("b", [6])
    _, mean, inv = g.layernorm(x, s, b, phase=fg.NormFwdPhase.TRAINING)
    assert mean is not None and inv is not None
    g.layernorm_backward(g.tensor("dy_bad", [4, 5]), x, s, mean, inv, name="lnb")[0].set_output(True)
    _err(g.validate, "lnb", "dy_bad", "[4, 5]")

    g = fg.Graph(io_data_type=F32)
    x, s = g.tensor("x", [4, 6]), g.tensor("s", [6])
    g.rmsnorm_backward(g.tensor("dy", [4, 6]), x, s, g.tensor("inv_bad", [6, 1]), name="rb")[0].set_output(True)
    _err(g.validate, "rb", "inv_bad", "[4, 1]")

    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [4, 3, 5])
    m, iv, sc = g.tensor("m", [1, 3, 1]), g.tensor("iv", [1, 3, 1]), g.tensor("sc_bad", [5])
    g.batchnorm_backward(g.tensor("dy", [4, 3, 5]), x, sc, m, iv, name="bnb")[0].set_output(True)
    _err(g.validate, "bnb", "sc_bad", "per-channel")


def test_running_statistics_errors() -> None:
    g = fg.Graph(io_data_type=F32)
    x, c = g.tensor("x", [4, 3]), g.tensor("c", [3])
    _err(lambda: g.batchnorm(x, c, c, in_running_mean=c), "together")  # type: ignore[call-overload]
    _err(lambda: g.batchnorm(x, c, c, momentum=0.1), "momentum without")
    _err(lambda: g.batchnorm(x, c, c, in_running_mean=c, in_running_var=c, momentum=1.5), "momentum", "[0, 1]")
    g = fg.Graph(io_data_type=F32)
    x1, c1 = g.tensor("x1", [1, 3]), g.tensor("c1", [3])
    g.batchnorm(x1, c1, c1, in_running_mean=c1, in_running_var=c1, name="bn1")[0].set_output(True)
    _err(g.validate, "bn1", "more than one value per channel")


def test_attention_stats_and_dropout_errors() -> None:
    g = fg.Graph(io_data_type=F32)
    q = g.tensor("q", [1, 2, 3, 4])
    seed = g.tensor("seed", [1], data_type=I64)
    _err(lambda: g.sdpa(q, q, q, dropout=(1.0, seed, seed)), "[0, 1)")
    _err(lambda: g.sdpa(q, q, q, dropout=(0.1, seed)), "(probability, seed tensor, offset tensor)")  # type: ignore[arg-type]
    _err(lambda: g.sdpa(q, q, q, dropout=(0.1, 5, seed)), "seed must be a tensor")  # type: ignore[arg-type]

    g = fg.Graph(io_data_type=F32)
    q, fseed = g.tensor("q", [1, 2, 3, 4]), g.tensor("fseed", [1], data_type=F32)
    g.sdpa(q, q, q, dropout=(0.1, fseed, fseed), name="att").set_output(True)
    _err(g.validate, "att", "fseed", "INT64")

    g = fg.Graph(io_data_type=F32)
    q, s2 = g.tensor("q", [1, 2, 3, 4]), g.tensor("s2", [2], data_type=I64)
    computed = g.add(s2, s2)
    g.sdpa(q, q, q, dropout=(0.1, g.scalar(1, I64), g.reshape(computed, [2])), name="att2").set_output(True)
    _err(g.validate, "att2", "one INT64")

    g = fg.Graph(io_data_type=F32)
    q = g.tensor("q", [1, 2, 3, 4])
    o, st = g.sdpa(q, q, q, generate_stats=True)
    g.sdpa_backward(q, q, q, o, g.tensor("do_bad", [1, 2, 3, 5]), st, name="bwd")[0].set_output(True)
    _err(g.validate, "bwd", "do_bad", "[1, 2, 3, 4]")

    g = fg.Graph(io_data_type=F32)
    q = g.tensor("q", [1, 2, 3, 4])
    o = g.sdpa(q, q, q)
    g.sdpa_backward(q, q, q, o, g.tensor("do", [1, 2, 3, 4]), g.tensor("st_bad", [1, 2, 3]), name="bwd2")[0].set_output(True)
    _err(g.validate, "bwd2", "st_bad", "log-sum-exp")


def test_a_computed_seed_is_refused() -> None:
    g = fg.Graph(io_data_type=F32)
    q, s = g.tensor("q", [1, 2, 3, 4]), g.tensor("s", [1], data_type=I64)
    seed = g.add(s, g.scalar(1, I64))
    g.sdpa(q, q, q, dropout=(0.2, seed, s), name="att").set_output(True)
    _err(g.validate, "att", "graph input or a constant")


def test_json_with_a_misnamed_port_is_refused() -> None:
    d = json.loads(_attention_graph().to_json())
    d["nodes"][1]["inputs"]["dO"] = d["nodes"][1]["inputs"].pop("do")
    _err(lambda: fg.Graph.from_json(json.dumps(d)), "no input port 'dO'")


# ---- engines that do not run them ---------------------------------------------------------------
def test_engines_declare_the_backward_ops_they_do_not_run() -> None:
    norms, attn = _norms_graph().validate(), _attention_graph().validate()
    for engine in ("iree", "cudnn", "triton"):
        why = declared_unsupported(engine, norms)
        assert why is not None and any(k in why for k in ("layernorm_backward", "rmsnorm_backward", "batchnorm")), (
            engine, why,
        )
        assert declared_unsupported(engine, attn) is not None
    for engine in ("reference", "torch"):
        assert declared_unsupported(engine, norms) is None and declared_unsupported(engine, attn) is None
    # a port added to an op the engine runs is refused by name
    g = fg.Graph(io_data_type=F32)
    q = g.tensor("q", [1, 2, 3, 4])
    o, st = g.sdpa(q, q, q, generate_stats=True, name="att")
    o.set_output(True)
    st.set_output(True)
    why = declared_unsupported("iree", g.validate())  # cudnn runs it since the backward lowering
    assert why is not None and "'stats'" in why and "att" in why
    assert OpKind.SDPA_BACKWARD.value == "sdpa_backward"


def test_the_plan_refuses_a_declared_op_with_its_reason() -> None:
    g = _norms_graph()
    with pytest.raises(fg.UnsupportedError, match="not emitted for IREE"):
        g.build(engine="iree")


def test_attention_statistics_stay_float_in_a_half_graph() -> None:
    """cuDNN keeps the log-sum-exp FLOAT: in f16 it would cost the backward its accuracy."""
    g = fg.Graph(io_data_type=DataType.HALF, intermediate_data_type=DataType.HALF)
    q = g.tensor("q", [1, 2, 3, 4])
    o, st = g.sdpa(q, q, q, generate_stats=True)
    o.set_output(True)
    g.validate()
    assert o.dtype == DataType.HALF and st.dtype == F32  # virtual or not
    st.set_output(True)
    g.validate()
    assert st.dtype == F32
    g2 = fg.Graph(io_data_type=DataType.HALF)
    q2 = g2.tensor("q", [1, 2, 3, 4])
    _, st2 = g2.sdpa(q2, q2, q2, generate_stats=True)
    st2.set_data_type(DataType.HALF).set_output(True)  # stated types win
    g2.validate()
    assert st2.dtype == DataType.HALF
