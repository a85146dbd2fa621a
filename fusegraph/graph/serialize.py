"""Versioned JSON form of a graph and its content hash.

Format ``fusegraph.graph`` version 1::

    {"format": "fusegraph.graph", "version": 1, "name": str,
     "io_data_type": str|null, "intermediate_data_type": str|null, "compute_data_type": str|null,
     "tensors": [{"name", "dim", "stride", "data_type", "is_virtual", "is_output",
                  "value" (scalars only), "set": ["dim", "stride", "data_type"] (user-stated)}],
     "nodes": [{"name", "op": OpKind value, "attrs": {field: value},
                "inputs": {port: tensor name}, "outputs": {port: tensor name}}]}

Enums are stored by value, DataTypes by name value ("half"...), non-finite floats as the
strings "inf", "-inf", "nan". An attribute field marked ``omit_if_default`` (one added after
version 1 was fixed, e.g. SdpaAttrs.dropout_probability) is left out at its default, and a
missing field reads as its default, so older documents and keys stay valid. The key hashes
this form without the graph's own name.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import types
import typing
from typing import TYPE_CHECKING, Any

from fusegraph.dtypes import DataType
from fusegraph.errors import ValidationError
from fusegraph.graph.node import Node
from fusegraph.graph.ops import OPS, OpKind
from fusegraph.graph.tensor import TensorAttr

if TYPE_CHECKING:
    from fusegraph.graph.graph import Graph

FORMAT = "fusegraph.graph"
VERSION = 1


def _enc(v: Any) -> Any:
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, tuple | list):
        return [_enc(x) for x in v]
    return v


def _dec_float(v: Any) -> Any:
    if isinstance(v, str) and v in ("inf", "-inf", "nan"):
        return float(v)
    return v


def graph_to_dict(g: Any, *, with_name: bool = True) -> dict[str, Any]:
    tensors = []
    for t in g.tensors:
        entry: dict[str, Any] = {
            "name": t.name,
            "dim": t.dim or None,
            "stride": t.stride or None,
            "data_type": _enc(t.data_type) if t.data_type else None,
            "is_virtual": t.is_virtual,
            "is_output": t.is_output,
            "set": [k for k, on in (("dim", t.dim_set), ("stride", t.stride_set), ("data_type", t.dtype_set)) if on],
        }
        if t.is_scalar:
            entry["value"] = _enc(t.value)
        tensors.append(entry)
    nodes = []
    for n in g.nodes:
        attrs = {
            f.name: _enc(getattr(n.attrs, f.name))
            for f in dataclasses.fields(n.attrs)
            if not (f.metadata.get("omit_if_default") and getattr(n.attrs, f.name) == f.default)
        }
        nodes.append(
            {
                "name": n.name,
                "op": n.kind.value,
                "attrs": attrs,
                "inputs": {p: t.name for p, t in n.inputs.items()},
                "outputs": {p: t.name for p, t in n.outputs.items()},
            }
        )
    out: dict[str, Any] = {"format": FORMAT, "version": VERSION}
    if with_name:
        out["name"] = g.name
    for k in ("io_data_type", "intermediate_data_type", "compute_data_type"):
        out[k] = _enc(getattr(g, k)) if getattr(g, k) else None
    out["tensors"] = tensors
    out["nodes"] = nodes
    return out


def graph_to_json(g: Any, indent: int | None = None) -> str:
    return json.dumps(graph_to_dict(g), indent=indent, sort_keys=False, allow_nan=False)


def graph_key(g: Any) -> str:
    text = json.dumps(graph_to_dict(g, with_name=False), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _field_value(tp: Any, raw: Any) -> Any:
    """Decodes one attribute value from its declared dataclass field type."""
    if raw is None:
        return None
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for a in args:
            if a is type(None):
                continue
            try:
                return _field_value(a, raw)
            except (ValueError, TypeError, KeyError):
                continue
        raise ValueError(f"cannot decode {raw!r} as {tp}")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(raw)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_field_value(args[0], x) for x in raw)
        return tuple(_field_value(a, x) for a, x in zip(args, raw, strict=True))
    if tp is float:
        return float(_dec_float(raw))
    if tp is int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise TypeError(f"expected an integer, got {raw!r}")
        return raw
    if tp is bool:
        return bool(raw)
    if tp is str:
        return str(raw)
    return raw


def graph_from_dict(d: dict[str, Any]) -> Graph:
    """A Graph from its dict form; every malformation is a ValidationError."""
    try:
        return _graph_from_dict(d)
    except ValidationError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        what = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ValidationError(f"malformed graph JSON: {what}") from None


def _check_ports(kind: OpKind, node: str, inputs: dict[str, Any], outputs: dict[str, Any]) -> None:
    spec = OPS[kind]
    fixed = [p for p in spec.inputs if not p.endswith("*")]
    variadic = [p[:-1] for p in spec.inputs if p.endswith("*")]
    for port in inputs:
        ok = port in fixed or any(port.startswith(v) and port[len(v):].isdigit() for v in variadic)
        if not ok:
            raise ValidationError(f"{kind.value} has no input port '{port}'", node=node)
    for port in fixed:
        if port not in inputs and port not in spec.optional_inputs:
            raise ValidationError(f"{kind.value} needs input port '{port}'", node=node)
    for port in outputs:
        if port not in spec.outputs:
            raise ValidationError(f"{kind.value} has no output port '{port}'", node=node)
    for port in spec.outputs:
        if port not in outputs and port not in spec.optional_outputs:
            raise ValidationError(f"{kind.value} needs output port '{port}'", node=node)


def _graph_from_dict(d: dict[str, Any]) -> Graph:
    from fusegraph.graph.graph import Graph

    if d.get("format") != FORMAT:
        raise ValidationError(f"not a fusegraph graph (format {d.get('format')!r})")
    if d.get("version") != VERSION:
        raise ValidationError(f"graph format version {d.get('version')!r} is not supported (this is {VERSION})")
    g = Graph(
        d.get("name"),
        d.get("io_data_type"),
        d.get("intermediate_data_type"),
        d.get("compute_data_type"),
    )
    by_name: dict[str, TensorAttr] = {}
    for e in d["tensors"]:
        value = e.get("value")
        if value is not None:
            value = _dec_float(value)
        t = TensorAttr(
            g,
            e["name"],
            e.get("dim"),
            e.get("stride"),
            _data_type(e["data_type"], e["name"]) if e.get("data_type") else None,
            is_virtual=bool(e.get("is_virtual")),
            value=value,
        )
        t._is_output = bool(e.get("is_output"))
        stated = set(e.get("set", []))
        t.dim_set, t.stride_set, t.dtype_set = "dim" in stated, "stride" in stated, "data_type" in stated
        if e["name"] in by_name:
            raise ValidationError("duplicate tensor name in JSON", tensor=e["name"])
        by_name[e["name"]] = t
        g.tensors.append(t)
    for e in d["nodes"]:
        try:
            kind = OpKind(e["op"])
        except ValueError:
            raise ValidationError(f"unknown op {e['op']!r}", node=e.get("name")) from None
        spec = OPS[kind]
        hints = _hints(spec.attrs)
        try:
            attrs = spec.attrs(**{k: _field_value(hints[k], v) for k, v in e["attrs"].items()})
        except (TypeError, ValueError, KeyError) as exc:
            raise ValidationError(f"bad attributes: {exc}", node=e.get("name")) from None

        def look(name: str, node_name: str = e["name"]) -> TensorAttr:
            if name not in by_name:
                raise ValidationError("node refers to an unknown tensor", node=node_name, tensor=name)
            return by_name[name]

        _check_ports(kind, e["name"], e["inputs"], e["outputs"])
        node = Node(
            e["name"],
            kind,
            attrs,
            {p: look(n) for p, n in e["inputs"].items()},
            {p: look(n) for p, n in e["outputs"].items()},
        )
        for t in node.outputs.values():
            if t.producer is not None:
                raise ValidationError(
                    f"tensor is written by two nodes ('{t.producer}' and '{node.name}')",
                    node=node.name,
                    tensor=t.name,
                )
            if t.is_scalar:
                raise ValidationError("a node writes a scalar constant", node=node.name, tensor=t.name)
            t.producer = node.name
        g.nodes.append(node)
    for n in g.nodes:  # counters continue after restored names
        g._counters[n.kind.value] = max(g._counters.get(n.kind.value, 0), len(g.nodes))
    g._counters["scalar"] = len(g.tensors)
    return g


_HINTS: dict[type, dict[str, Any]] = {}  # a cache: attribute class -> its resolved field types


def _hints(cls: type) -> dict[str, Any]:
    """The attribute class's field types, resolved once per class: ``get_type_hints``
    evaluates the annotations anew on every call (half of ``graph_from_dict``'s time where
    the region path cuts a model's pieces, issue 24 item 6)."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def _data_type(value: Any, tensor: str) -> DataType:
    try:
        return DataType(value)
    except ValueError:
        raise ValidationError(f"unknown data type {value!r}", tensor=tensor) from None


def graph_from_json(text: str) -> Graph:
    try:
        d = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValidationError(f"graph JSON does not parse: {exc}") from None
    except RecursionError:
        # json.loads recurses once per nesting level: a document nested ~1,000+ deep is no graph
        raise ValidationError("graph JSON is nested too deeply to be a graph document") from None
    if not isinstance(d, dict):
        raise ValidationError("graph JSON must be an object")
    return graph_from_dict(d)
