"""TensorAttr: a tensor of a graph, as the user declares it (cuDNN-frontend style).

Dims are always logical (N, C, spatial... / K, C/groups, spatial...); the memory layout
lives in the strides. Setters chain and may be called until ``validate()``, which fills
what was left unset (dims, strides and types of virtual tensors).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from fusegraph.dtypes import DataType, as_data_type
from fusegraph.errors import ValidationError

if TYPE_CHECKING:
    from fusegraph.graph.graph import Graph

Scalar = bool | int | float


class TensorAttr:
    __slots__ = (
        "_data_type",
        "_dim",
        "_graph",
        "_is_output",
        "_is_virtual",
        "_name",
        "_stride",
        "dim_set",
        "dtype_set",
        "producer",
        "stride_set",
        "value",
    )

    def __init__(
        self,
        graph: Graph,
        name: str,
        dim: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
        data_type: Any = None,
        *,
        is_virtual: bool = False,
        value: Scalar | None = None,
    ) -> None:
        # Weak: the graph owns its tensors, and a strong reference back would make every graph
        # a reference cycle, freed (with the engine plans and weights it caches) only by the
        # garbage collector's full pass instead of when its last user lets go of it.
        self._graph: weakref.ref[Graph] = weakref.ref(graph)
        self._name = name
        self._dim: tuple[int, ...] | None = _ints(dim, name, "dims") if dim is not None else None
        self._stride: tuple[int, ...] | None = (
            _ints(stride, name, "strides") if stride is not None else None
        )
        self._data_type: DataType | None = (
            _data_type(data_type, name) if data_type is not None else None
        )
        self._is_virtual = is_virtual
        self._is_output = False
        self.value = value  # set for scalars inlined into the graph
        self.producer: str | None = None  # name of the node writing this tensor
        # Which attributes the user stated; the rest are inferred by validate().
        self.dim_set = dim is not None
        self.stride_set = stride is not None
        self.dtype_set = data_type is not None

    # ---- read -----------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def dim(self) -> list[int]:
        return list(self._dim) if self._dim is not None else []

    @property
    def stride(self) -> list[int]:
        return list(self._stride) if self._stride is not None else []

    @property
    def data_type(self) -> DataType | None:
        return self._data_type

    @property
    def is_virtual(self) -> bool:
        return self._is_virtual

    @property
    def is_output(self) -> bool:
        return self._is_output

    @property
    def is_scalar(self) -> bool:
        return self.value is not None

    @property
    def graph(self) -> Graph:
        g = self._graph()
        if g is None:
            raise ValidationError(
                "the tensor's graph was freed: keep a reference to the Graph while its tensors are in use",
                tensor=self._name,
            )
        return g

    def belongs_to(self, graph: Graph) -> bool:
        """Whether this tensor is ``graph``'s: False for another graph's, freed or not (a
        check of membership must not raise where the other graph is gone)."""
        return self._graph() is graph

    def _touch(self) -> None:
        g = self._graph()
        if g is not None:  # a freed graph has no plans or key left to invalidate
            g._touch()

    @property
    def shape(self) -> tuple[int, ...]:
        """Dims as a tuple (numpy's word); raises before dims are known."""
        if self._dim is None:
            raise ValueError(f"tensor '{self._name}' has no dims yet")
        return self._dim

    @property
    def strides(self) -> tuple[int, ...]:
        if self._stride is None:
            raise ValueError(f"tensor '{self._name}' has no strides yet")
        return self._stride

    @property
    def dtype(self) -> DataType:
        if self._data_type is None:
            raise ValueError(f"tensor '{self._name}' has no data type yet")
        return self._data_type

    # ---- chainable setters ------------------------------------------------------------
    def set_output(self, is_output: bool = True) -> TensorAttr:
        self._is_output = bool(is_output)
        if is_output:
            self._is_virtual = False
        self._touch()
        return self

    def set_is_virtual(self, is_virtual: bool = True) -> TensorAttr:
        self._is_virtual = bool(is_virtual)
        self._touch()
        return self

    def set_data_type(self, data_type: Any) -> TensorAttr:
        self._data_type = _data_type(data_type, self._name)
        self.dtype_set = True
        self._touch()
        return self

    def set_name(self, name: str) -> TensorAttr:
        old, self._name = self._name, str(name)
        g = self._graph()
        if g is not None:
            g._renamed(old, self._name)
        self._touch()
        return self

    def set_dim(self, dim: Sequence[int]) -> TensorAttr:
        self._dim = _ints(dim, self._name, "dims")
        self.dim_set = True
        self._touch()
        return self

    def set_stride(self, stride: Sequence[int]) -> TensorAttr:
        self._stride = _ints(stride, self._name, "strides")
        self.stride_set = True
        self._touch()
        return self

    # ---- inference (validate() only) -----------------------------------------------------
    def _infer(
        self,
        dim: tuple[int, ...] | None = None,
        stride: tuple[int, ...] | None = None,
        data_type: DataType | None = None,
    ) -> None:
        if dim is not None:
            self._dim = dim
        if stride is not None:
            self._stride = stride
        if data_type is not None:
            self._data_type = data_type

    def __repr__(self) -> str:
        dt = self._data_type.name if self._data_type else "?"
        kind = "scalar" if self.is_scalar else ("virtual" if self._is_virtual else "")
        if self._is_output:
            kind = "output"
        return f"TensorAttr({self._name!r}, dim={self.dim}, stride={self.stride}, {dt}{', ' + kind if kind else ''})"


def _ints(values: Sequence[int], tensor: str | None = None, what: str = "dims and strides") -> tuple[int, ...]:
    """Integers from a sequence; rejects floats and bools rather than truncating them."""
    if isinstance(values, str | bytes) or not hasattr(values, "__iter__"):
        raise ValidationError(f"{what} must be a sequence of integers, got {values!r}", tensor=tensor)
    out = []
    for v in values:
        if isinstance(v, bool | np.bool_) or not hasattr(v, "__index__"):
            raise ValidationError(f"{what} must be integers, got {v!r} in {list(values)}", tensor=tensor)
        out.append(int(v))
    return tuple(out)


def _data_type(value: Any, tensor: str | None) -> DataType:
    try:
        return as_data_type(value)
    except TypeError as exc:
        raise ValidationError(str(exc), tensor=tensor) from None
