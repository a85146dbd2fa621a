"""What the builder mixins (builder*.py) use of ``graph.Graph``, declared once for the type
checker: ``Graph`` provides it, and every mixin adds its nodes through it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fusegraph.dtypes import DataType
    from fusegraph.graph.node import Node
    from fusegraph.graph.ops import OpAttrs, OpKind
    from fusegraph.graph.tensor import Scalar, TensorAttr


class NodeAdder:
    """The base of the builder mixins (nothing at run time)."""

    if TYPE_CHECKING:  # provided by graph.Graph, the one class users construct

        def scalar(self, value: Scalar, data_type: Any = None) -> TensorAttr: ...

        def _add_node(
            self,
            kind: OpKind,
            attrs: OpAttrs,
            inputs: Mapping[str, TensorAttr | None],
            name: str | None,
            outputs: Sequence[str] | None = None,
        ) -> Node: ...

        def _try_infer(self, node: Node) -> None: ...

        def _compute_default(self, compute_data_type: Any) -> DataType | None: ...
