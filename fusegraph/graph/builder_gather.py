"""The builder methods of the indexing ops: ``gather`` (ONNX Gather, an embedding lookup)
and ``gather_backward`` (the embedding's backward).

A mixin of ``graph.Graph``, like graph/builder.py. The attributes are checked here only
for their Python types; what depends on the operands' dims and types (axis range, index
type, the rows of the backward) is checked by shape inference (graph/infer_gather.py),
where the whole graph is in view.
"""

from __future__ import annotations

import operator
from typing import Any

from fusegraph.errors import ValidationError
from fusegraph.graph.builder_base import NodeAdder
from fusegraph.graph.ops import GatherAttrs, GatherBackwardAttrs, OpKind
from fusegraph.graph.tensor import TensorAttr


def _whole(value: Any, what: str, name: str | None) -> int:
    """An int attribute (NumPy integers too); bools and floats are refused (``axis=1.0``
    is a caller's slip, not an axis)."""
    if isinstance(value, bool):
        raise ValidationError(f"{what} must be an integer, got {value!r}", node=name)
    try:
        return operator.index(value)
    except TypeError:
        raise ValidationError(f"{what} must be an integer, got {value!r}", node=name) from None


class GatherBuilder(NodeAdder):
    """The indexing-op methods of ``Graph`` (a mixin: the IR half is ``graph.Graph``)."""

    def gather(self, data: TensorAttr, indices: TensorAttr, axis: int = 0, *, name: str | None = None) -> TensorAttr:
        """ONNX Gather: ``y = numpy.take(data, indices, axis)``, dims
        ``data.dim[:axis] + indices.dim + data.dim[axis + 1:]``. ``indices`` are INT32 or
        INT64, any rank; a negative index counts from the end of the axis (ONNX's rule).
        An index outside ``[-n, n)``: validation refuses a constant one, the reference
        engine raises ExecutionError naming the indices, the torch engine raises too
        (PyTorch's index check; on CUDA a device-side assert) -- no engine returns garbage."""
        attrs = GatherAttrs(_whole(axis, "gather: axis", name))
        return self._add_node(OpKind.GATHER, attrs, {"data": data, "indices": indices}, name).outputs["y"]

    def gather_backward(
        self,
        dy: TensorAttr,
        indices: TensorAttr,
        num_rows: int,
        padding_idx: int | None = None,
        *,
        axis: int = 0,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> TensorAttr:
        """The gradient of ``gather(data, indices, axis=0)`` with respect to ``data`` (an
        embedding's weight gradient): zeros of dims ``[num_rows, *dy.dim[indices.rank:]]``
        with each slice of ``dy`` added into the row its index names (repeated indices
        sum). Row ``padding_idx`` (negative counts from the end) gets no gradient, as
        ``torch.nn.Embedding(padding_idx=...)``. Only ``axis=0`` is supported."""
        attrs = GatherBackwardAttrs(
            num_rows=_whole(num_rows, "gather_backward: num_rows", name),
            padding_idx=None if padding_idx is None else _whole(padding_idx, "gather_backward: padding_idx", name),
            axis=_whole(axis, "gather_backward: axis", name),
            compute_data_type=self._compute_default(compute_data_type),
        )
        ins = {"dy": dy, "indices": indices}
        return self._add_node(OpKind.GATHER_BACKWARD, attrs, ins, name).outputs["d_data"]
