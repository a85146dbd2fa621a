"""The weights a region unit binds, carved from one device block (``to_device_all``): the
same values, dtypes and strides as one copy each, aligned, and no two overlapping."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import fusegraph as fg
from fusegraph import DataType as DT

torch = pytest.importorskip("torch", reason="the region unit's values are torch tensors")

from fusegraph.onnx.region_values import ALIGN, to_device, to_device_all  # noqa: E402


def _tensors() -> dict[str, object]:
    g = fg.Graph("w", io_data_type=DT.FLOAT)
    return {
        "conv_w": g.tensor("conv_w", [8, 3, 3, 3], fg.strides_for([8, 3, 3, 3], "KRSC")),
        "bias": g.tensor("bias", [1, 8, 1, 1]),
        "half": g.tensor("half", [5, 7], data_type=DT.HALF),
        "odd": g.tensor("odd", [3], data_type=DT.BFLOAT16),
        "ids": g.tensor("ids", [4, 2], data_type=DT.INT64),
        "empty": g.tensor("empty", [0, 4]),
    }


def _values(rng: np.random.Generator, ts: dict[str, object]) -> dict[str, object]:
    import ml_dtypes

    out: dict[str, object] = {}
    for name, t in ts.items():
        shape = t.shape  # type: ignore[attr-defined]
        if name == "ids":
            out[name] = rng.integers(-50, 50, size=shape).astype(np.int64)
        elif name == "odd":
            out[name] = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
        elif name == "half":
            out[name] = rng.standard_normal(shape).astype(np.float16)
        else:
            out[name] = rng.standard_normal(shape).astype(np.float32)
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_carved_weights_equal_one_copy_each(rng: np.random.Generator, device: str) -> None:
    ts = _tensors()
    vals = _values(rng, ts)
    dev = torch.device(device)
    items = {k: (vals[k], ts[k]) for k in ts}
    carved = to_device_all(items, dev, pooled=True)
    assert list(carved) == list(ts)
    spans = []
    for name, t in ts.items():
        got, want = carved[name], to_device(vals[name], t, dev)
        assert got.dtype == want.dtype and tuple(got.shape) == tuple(t.shape), name  # type: ignore[attr-defined]
        assert tuple(got.stride()) == tuple(t.strides), name  # type: ignore[attr-defined]
        assert torch.equal(got, want), name
        if got.numel():
            start = got.data_ptr()
            base = got.untyped_storage().data_ptr()
            assert (start - base) % ALIGN == 0, name  # each weight starts where a fresh block would
            extent = 1 + sum((d - 1) * s for d, s in zip(got.shape, got.stride(), strict=True))
            spans.append((start, start + extent * got.element_size()))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans)), spans
    # one block for every weight that has elements
    storages = {carved[n].untyped_storage().data_ptr() for n in ts if carved[n].numel()}
    assert len(storages) == 1


def test_a_tensor_already_placed_is_not_copied(rng: np.random.Generator) -> None:
    g = fg.Graph("w", io_data_type=DT.FLOAT)
    t = g.tensor("x", [4, 4])
    x = torch.from_numpy(rng.standard_normal((4, 4)).astype(np.float32))
    got = to_device_all({"x": (x, t)}, torch.device("cpu"), pooled=True)
    assert got["x"] is x


def test_off_the_gpu_each_weight_is_its_own_tensor(rng: np.random.Generator) -> None:
    ts = _tensors()
    vals = _values(rng, ts)
    got = to_device_all({k: (vals[k], ts[k]) for k in ts}, torch.device("cpu"))
    storages = {got[n].untyped_storage().data_ptr() for n in ts if got[n].numel()}
    assert len(storages) == len([n for n in ts if got[n].numel()])
    for name, t in ts.items():
        assert torch.equal(got[name], to_device(vals[name], t, torch.device("cpu"))), name
