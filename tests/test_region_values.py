"""``region_values.to_device`` on the CPU (fusegraph/onnx/region_values.py): a weight or an
input that already has the declared dtype and dense strides is copied by NumPy (one thread,
not torch's OpenMP ``copy_``); anything else -- another dtype, another layout, a broadcast
scalar, bfloat16 -- takes the general path. Either way the tensor is the declared one, holds
the value exactly, and owns its memory (a read-only weight over the model's bytes is never
shared with a plan)."""

from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from fusegraph.dtypes import DataType
from fusegraph.onnx import region_values

torch = pytest.importorskip("torch", reason="region values are torch tensors (fusegraph[torch])")
CPU = torch.device("cpu")


def _decl(shape: tuple[int, ...], strides: tuple[int, ...], dtype: DataType = DataType.FLOAT) -> SimpleNamespace:
    return SimpleNamespace(shape=shape, strides=strides, dtype=dtype)


def _check(out: object, arr: np.ndarray, t: SimpleNamespace, dtype: object) -> None:
    assert isinstance(out, torch.Tensor)
    assert out.dtype == dtype and tuple(out.shape) == t.shape and tuple(out.stride()) == t.strides
    want = torch.from_numpy(np.array(np.broadcast_to(arr, t.shape), dtype=np.float64))
    assert torch.equal(out.to(torch.float64), want)


@pytest.mark.parametrize("writeable", [True, False])
def test_a_dense_weight_is_copied_into_memory_of_its_own(rng: np.random.Generator, writeable: bool) -> None:
    arr = rng.standard_normal((3, 4, 5)).astype(np.float32)
    arr.flags.writeable = writeable
    t = _decl((3, 4, 5), (20, 5, 1))
    assert region_values._host_copy(arr, t, torch.float32) is not None  # the NumPy path is taken
    out = region_values.to_device(arr, t, CPU)
    _check(out, arr, t, torch.float32)
    assert not np.shares_memory(out.numpy(), arr)
    out.add_(1.0)  # writing the copy leaves the source as it was
    assert not np.array_equal(out.numpy(), arr)


@pytest.mark.parametrize("case", ["channels_last", "other_dtype", "broadcast", "bfloat16", "empty"])
def test_other_values_take_the_general_path(rng: np.random.Generator, case: str) -> None:
    arr = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    t = _decl((2, 3, 4, 5), (60, 20, 5, 1))
    dtype = torch.float32
    if case == "channels_last":
        t = _decl((2, 3, 4, 5), (60, 1, 15, 3))
    elif case == "other_dtype":
        arr = arr.astype(np.float64)
    elif case == "broadcast":
        arr = np.array(rng.standard_normal(), np.float32)
    elif case == "bfloat16":
        arr = arr.astype(ml_dtypes.bfloat16)
        t, dtype = _decl((2, 3, 4, 5), (60, 20, 5, 1), DataType.BFLOAT16), torch.bfloat16
    elif case == "empty":
        arr, t = np.zeros((2, 0, 3), np.float32), _decl((2, 0, 3), (3, 3, 1))
    assert region_values._host_copy(arr, t, dtype) is None
    out = region_values.to_device(arr, t, CPU)
    if case == "bfloat16":
        assert out.dtype == torch.bfloat16 and tuple(out.stride()) == t.strides
        assert np.array_equal(out.view(torch.int16).numpy().view(np.uint16), arr.view(np.uint16))
    elif case == "other_dtype":
        assert out.dtype == torch.float32 and tuple(out.stride()) == t.strides
        assert torch.equal(out, torch.from_numpy(arr.astype(np.float32)))
    else:
        _check(out, arr, t, dtype)
