"""DataType: one enum, mapped to numpy / ml_dtypes, MLIR and torch names.

Everything that accepts a DataType also accepts a numpy dtype (or anything
``numpy.dtype()`` understands), through :func:`as_data_type`.
"""

from __future__ import annotations

import enum
from typing import Any

import ml_dtypes
import numpy as np


class DataType(enum.Enum):
    HALF = "half"
    BFLOAT16 = "bfloat16"
    FLOAT = "float"
    DOUBLE = "double"
    INT8 = "int8"
    UINT8 = "uint8"
    INT16 = "int16"
    INT32 = "int32"
    INT64 = "int64"
    BOOLEAN = "boolean"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"

    @property
    def numpy(self) -> np.dtype[Any]:
        return _NUMPY[self]

    @property
    def is_float(self) -> bool:
        return self in FLOAT_TYPES

    @property
    def is_integer(self) -> bool:
        return self in INTEGER_TYPES

    @property
    def itemsize(self) -> int:
        return int(self.numpy.itemsize)

    @property
    def mlir(self) -> str:
        """The element type in MLIR's builtin spelling (torch dialect: signed ints as si*)."""
        return _MLIR[self]

    def __str__(self) -> str:
        return self.value


FLOAT_TYPES = frozenset(
    {
        DataType.HALF,
        DataType.BFLOAT16,
        DataType.FLOAT,
        DataType.DOUBLE,
        DataType.FP8_E4M3,
        DataType.FP8_E5M2,
    }
)
INTEGER_TYPES = frozenset(
    {DataType.INT8, DataType.UINT8, DataType.INT16, DataType.INT32, DataType.INT64}
)

_NUMPY: dict[DataType, np.dtype[Any]] = {
    DataType.HALF: np.dtype(np.float16),
    DataType.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    DataType.FLOAT: np.dtype(np.float32),
    DataType.DOUBLE: np.dtype(np.float64),
    DataType.INT8: np.dtype(np.int8),
    DataType.UINT8: np.dtype(np.uint8),
    DataType.INT16: np.dtype(np.int16),
    DataType.INT32: np.dtype(np.int32),
    DataType.INT64: np.dtype(np.int64),
    DataType.BOOLEAN: np.dtype(np.bool_),
    DataType.FP8_E4M3: np.dtype(ml_dtypes.float8_e4m3fn),
    DataType.FP8_E5M2: np.dtype(ml_dtypes.float8_e5m2),
}
_FROM_NUMPY = {v: k for k, v in _NUMPY.items()}

_MLIR: dict[DataType, str] = {
    DataType.HALF: "f16",
    DataType.BFLOAT16: "bf16",
    DataType.FLOAT: "f32",
    DataType.DOUBLE: "f64",
    DataType.INT8: "si8",
    DataType.UINT8: "ui8",
    DataType.INT16: "si16",
    DataType.INT32: "si32",
    DataType.INT64: "si64",
    DataType.BOOLEAN: "i1",
    DataType.FP8_E4M3: "f8E4M3FN",
    DataType.FP8_E5M2: "f8E5M2",
}

_ALIASES = {
    "fp16": DataType.HALF,
    "float16": DataType.HALF,
    "f16": DataType.HALF,
    "bf16": DataType.BFLOAT16,
    "fp32": DataType.FLOAT,
    "float32": DataType.FLOAT,
    "f32": DataType.FLOAT,
    "fp64": DataType.DOUBLE,
    "float64": DataType.DOUBLE,
    "f64": DataType.DOUBLE,
    "bool": DataType.BOOLEAN,
}


def as_data_type(value: Any) -> DataType:
    """DataType from a DataType, its name, a numpy dtype, or a scalar type like np.float16."""
    if isinstance(value, DataType):
        return value
    if isinstance(value, str):
        key = value.lower()
        if key in _ALIASES:
            return _ALIASES[key]
        for dt in DataType:
            if dt.value == key or dt.name.lower() == key:
                return dt
    try:
        npdt = np.dtype(value)
    except TypeError as exc:
        raise TypeError(f"not a data type: {value!r}") from exc
    if npdt in _FROM_NUMPY:
        return _FROM_NUMPY[npdt]
    raise TypeError(f"numpy dtype {npdt} has no fusegraph DataType")


def promote(a: DataType, b: DataType) -> DataType:
    """The wider of two types of one family (float/int/bool), as numpy promotes them."""
    if a == b:
        return a
    if a.is_float and b.is_float:
        if {a, b} == {DataType.HALF, DataType.BFLOAT16}:
            return DataType.FLOAT  # no narrow type holds both
        if {a, b} == {DataType.FP8_E4M3, DataType.FP8_E5M2}:
            return DataType.HALF
        return max(a, b, key=lambda d: _FLOAT_RANK[d])
    return as_data_type(np.promote_types(a.numpy, b.numpy))


_FLOAT_RANK = {
    DataType.FP8_E4M3: 0,
    DataType.FP8_E5M2: 0,
    DataType.HALF: 1,
    DataType.BFLOAT16: 1,
    DataType.FLOAT: 2,
    DataType.DOUBLE: 3,
}


def family(dt: DataType) -> str:
    if dt == DataType.BOOLEAN:
        return "bool"
    return "float" if dt.is_float else "int"
