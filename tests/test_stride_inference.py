"""Output strides the user leaves unset, as cuDNN's frontend infers them: a pointwise output
of its input's dims takes that input's strides as they are, gaps included -- so a rotary
embedding of the query slice of a packed QKV tensor writes straight into the same slice of
another packed QKV tensor -- while packed, broadcast and stated layouts behave as before."""

from __future__ import annotations

import numpy as np
import pytest

import fusegraph as fg
from fusegraph.dtypes import DataType
from fusegraph.graph import layout

F32 = DataType.FLOAT
B, S, H, D = 2, 5, 3, 8


def _rope_graph(q_view: np.ndarray) -> tuple[fg.Graph, fg.TensorAttr]:
    """y = q * cos + rotate_half(q) * sin, rotate_half(q) = [-q2, q1] (the halves of the head dim)."""
    g = fg.Graph(io_data_type=F32)
    q = g.tensor_like(q_view, "q")
    cos, sin = g.tensor("cos", [1, 1, S, D]), g.tensor("sin", [1, 1, S, D])
    q1 = g.slice(q, [0], [D // 2], axes=[3])
    q2 = g.slice(q, [D // 2], [D], axes=[3])
    rot = g.concatenate([g.neg(q2), q1], axis=3)
    y = g.add(g.mul(q, cos), g.mul(rot, sin)).set_output(True)
    return g.validate(), y


def _rope_numpy(q: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    q64 = q.astype(np.float64)
    rot = np.concatenate([-q64[..., D // 2:], q64[..., : D // 2]], axis=-1)
    return q64 * cos + rot * sin  # type: ignore[no-any-return]


def _query_slice(qkv: np.ndarray) -> np.ndarray:
    """The query of a packed [B, S, 3, H, D] array as a [B, H, S, D] view (no copy)."""
    return qkv[:, :, 0].transpose(0, 2, 1, 3)


@pytest.mark.parametrize("engine", ("reference", "torch", "iree"))
def test_rope_writes_into_the_query_slice_of_a_packed_qkv(engine: str, rng: np.random.Generator) -> None:
    if engine == "torch":
        pytest.importorskip("torch", reason="the torch engine needs PyTorch")
    qkv_in = rng.standard_normal((B, S, 3, H, D)).astype(np.float32)
    q_in = _query_slice(qkv_in)
    g, y = _rope_graph(q_in)
    # the output takes the query view's strides: a slice of a packed QKV tensor, not packed itself
    assert tuple(y.stride) == layout.element_strides(q_in.shape, q_in.strides, 4)
    assert not layout.is_packed(y.dim, y.stride)
    cos, sin = (rng.standard_normal((1, 1, S, D)).astype(np.float32) for _ in range(2))
    qkv_out = np.full((B, S, 3, H, D), 1234.5, dtype=np.float32)  # sentinel: k and v parts stay
    out_view = _query_slice(qkv_out)
    g.execute({"q": q_in, "cos": cos, "sin": sin, y.name: out_view}, engine=engine)
    want = _rope_numpy(q_in, cos, sin)
    err = np.linalg.norm(out_view - want) / np.linalg.norm(want)
    assert err < 1e-6, f"{engine}: rel err {err:.3g}"
    assert (qkv_out[:, :, 1:] == 1234.5).all(), f"{engine} wrote outside the query slice"


def test_a_contiguous_array_for_that_output_is_refused_with_the_layout() -> None:
    qkv = np.zeros((B, S, 3, H, D), np.float32)
    g, y = _rope_graph(_query_slice(qkv))
    feeds = {"q": _query_slice(qkv), "cos": np.zeros((1, 1, S, D), np.float32), "sin": np.zeros((1, 1, S, D), np.float32)}
    with pytest.raises(fg.VariantPackError) as info:
        g.execute({**feeds, y.name: np.zeros((B, H, S, D), np.float32)}, engine="reference")
    assert y.name in str(info.value)


def test_packed_inputs_keep_the_packed_rule() -> None:
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [2, 3, 4, 5], layout.strides_for([2, 3, 4, 5], "NHWC"))
    y = g.relu(x).set_output(True)
    g.validate()
    assert tuple(y.stride) == layout.strides_for([2, 3, 4, 5], "NHWC")


def test_broadcast_and_overlapping_inputs_give_packed_outputs() -> None:
    g = fg.Graph(io_data_type=F32)
    bcast = g.tensor("b", [4, 5], [0, 1])  # one row read four times
    window = g.tensor("w", [4, 3], [1, 1])  # a sliding window: rows overlap
    yb = g.exp(bcast).set_output(True)
    yw = g.exp(window).set_output(True)
    g.validate()
    assert tuple(yb.stride) == (5, 1) and tuple(yw.stride) == (3, 1)


def test_a_broadcasting_pointwise_output_is_packed_in_the_source_order() -> None:
    g = fg.Graph(io_data_type=F32)
    big = np.zeros((4, 6, 2), np.float32)[:, ::2]  # [4, 3, 2] with a gap
    x = g.tensor_like(big, "x")
    y = g.add(g.tensor("one", [1, 1, 1]), x).set_output(True)  # first input is the broadcast one
    z = g.add(x, g.tensor("row", [4, 3, 2])).set_output(True)
    g.validate()
    assert tuple(z.stride) == tuple(x.stride)  # the first same-dims input's strides
    assert tuple(y.stride) == tuple(x.stride)  # the only same-dims input is x


def test_stated_output_strides_win() -> None:
    q_in = _query_slice(np.zeros((B, S, 3, H, D), np.float32))
    g = fg.Graph(io_data_type=F32)
    q = g.tensor_like(q_in, "q")
    y = g.exp(q).set_stride(layout.packed_strides([B, H, S, D])).set_output(True)
    g.validate()
    assert tuple(y.stride) == layout.packed_strides([B, H, S, D])


def test_non_pointwise_outputs_are_unchanged() -> None:
    """A norm's output keeps the packed-in-input-order rule even for a strided input."""
    q_in = _query_slice(np.zeros((B, S, 3, H, D), np.float32))
    g = fg.Graph(io_data_type=F32)
    q = g.tensor_like(q_in, "q")
    y = g.softmax(q, axis=-1).set_output(True)
    g.validate()
    assert layout.is_packed(y.dim, y.stride)


@pytest.mark.gpu
def test_rope_into_a_packed_qkv_on_cuda(rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    qkv_in = torch.tensor(rng.standard_normal((B, S, 3, H, D)).astype(np.float32), device="cuda")
    q_in = qkv_in[:, :, 0].transpose(1, 2)
    g = fg.Graph(io_data_type=F32)
    q = g.tensor("q", list(q_in.shape), list(q_in.stride()))
    cos_t, sin_t = g.tensor("cos", [1, 1, S, D]), g.tensor("sin", [1, 1, S, D])
    rot = g.concatenate([g.neg(g.slice(q, [D // 2], [D], axes=[3])), g.slice(q, [0], [D // 2], axes=[3])], axis=3)
    y = g.add(g.mul(q, cos_t), g.mul(rot, sin_t)).set_output(True)
    cos, sin = (torch.randn(1, 1, S, D, device="cuda") for _ in range(2))
    qkv_out = torch.full((B, S, 3, H, D), 1234.5, device="cuda")
    out_view = qkv_out[:, :, 0].transpose(1, 2)
    g.execute({"q": q_in, "cos": cos, "sin": sin, y.name: out_view}, engine="torch", handle=fg.Handle("cuda:0"))
    want = _rope_numpy(q_in.cpu().numpy(), cos.cpu().numpy(), sin.cpu().numpy())
    assert np.abs(out_view.cpu().numpy() - want).max() < 1e-5
    assert bool((qkv_out[:, :, 1:] == 1234.5).all())
