"""The provider's view of an ONNX graph: nodes with their attributes parsed (``ONode``),
what shape inference knows of each value (``TypeInfo``), and the graph specialized to
concrete input shapes (``OnnxGraph``), which every later stage reads."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

DEFAULT_DOMAINS = ("", "ai.onnx")


@dataclass(frozen=True)
class TypeInfo:
    """What shape inference knows of one value."""

    elem: int  # onnx.TensorProto data type; 0 when not a tensor or unknown
    shape: tuple[int, ...] | None  # static dims, None when unknown or symbolic
    proto: onnx.TypeProto | None = None  # the full type (sequences, optionals), for sub-models

    @property
    def is_tensor(self) -> bool:
        return self.elem != 0

    @property
    def numpy_dtype(self) -> np.dtype[Any] | None:
        if not self.elem:
            return None
        try:
            return np.dtype(helper.tensor_dtype_to_np_dtype(self.elem))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass
class ONode:
    """One ONNX node, attributes parsed; ``sources`` names the original nodes it stands for."""

    name: str
    op_type: str
    domain: str
    inputs: tuple[str, ...]  # "" marks an absent optional input
    outputs: tuple[str, ...]
    attrs: dict[str, Any]
    proto: onnx.NodeProto | None  # the original node; None once a rewrite changed it
    sources: tuple[str, ...] = ()
    implicit_inputs: tuple[str, ...] = ()  # outer-scope values read by subgraph attributes
    source_ops: tuple[str, ...] = ()  # op types of ``sources`` when a rewrite merged nodes

    def origin(self) -> list[tuple[str, str]]:
        """(name, op type) of every original node this one stands for."""
        ops = self.source_ops or (self.op_type,) * len(self.sources)
        return list(zip(self.sources, ops, strict=True))

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    @property
    def is_default_domain(self) -> bool:
        return self.domain in DEFAULT_DOMAINS

    def all_inputs(self) -> tuple[str, ...]:
        """Every value the node reads: its inputs (absent ones dropped) and outer-scope reads."""
        return tuple(i for i in self.inputs if i) + self.implicit_inputs

    def to_proto(self) -> onnx.NodeProto:
        if self.proto is not None:
            p = onnx.NodeProto()
            p.CopyFrom(self.proto)
            p.name = self.name
            return p
        return helper.make_node(
            self.op_type, list(self.inputs), list(self.outputs), name=self.name,
            domain=self.domain or None, **self.attrs,
        )


@dataclass
class OnnxGraph:
    """An ONNX graph specialized to concrete input shapes, constants folded away."""

    nodes: list[ONode]  # topological order; only what runs on each call
    inputs: list[str]  # graph inputs fed by the caller
    outputs: list[str]
    constants: dict[str, np.ndarray]
    types: dict[str, TypeInfo]
    opset: int  # of the default domain
    opset_imports: list[onnx.OperatorSetIdProto]
    ir_version: int
    functions: list[onnx.FunctionProto] = field(default_factory=list)
    folded: list[str] = field(default_factory=list)  # original nodes folded into constants
    all_node_names: list[str] = field(default_factory=list)  # every original node

    def producers(self) -> dict[str, ONode]:
        return {o: n for n in self.nodes for o in n.outputs if o}

    def consumers(self) -> dict[str, list[ONode]]:
        out: dict[str, list[ONode]] = {}
        for n in self.nodes:
            for i in n.all_inputs():
                out.setdefault(i, []).append(n)
        return out

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name in self.constants:
            return tuple(self.constants[name].shape)
        t = self.types.get(name)
        return t.shape if t is not None else None

    def elem(self, name: str) -> int:
        if name in self.constants:
            return int(helper.np_dtype_to_tensor_dtype(self.constants[name].dtype))
        t = self.types.get(name)
        return t.elem if t is not None else 0


def iter_values(nodes: Iterable[ONode]) -> Iterable[str]:
    for n in nodes:
        yield from n.all_inputs()
        yield from (o for o in n.outputs if o)
