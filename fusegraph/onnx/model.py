"""The ONNX model as the provider sees it: loaded, checked, upgraded, specialized.

``load_model`` turns whatever the user handed to the session (a path, bytes, a
ModelProto) into a checked ModelProto at opset >= 7, or raises :class:`ModelError` that
says what is wrong -- never a raw protobuf traceback. ``specialize`` fixes the input
shapes, runs ONNX shape inference and folds every constant computation (Constant,
ConstantOfShape, and shape subgraphs such as Shape -> Gather -> Unsqueeze -> Concat
feeding a Reshape) into arrays, leaving the nodes that really run on each call.

The pieces, one idea a module: ``ir`` (ONode, TypeInfo, OnnxGraph), ``load`` (load_model,
the hostile-model checks, input_signature), ``specialize`` (shape inference and constant
folding). This module names them where the rest of fusegraph and its users import them.
"""

from __future__ import annotations

from fusegraph.onnx.ir import DEFAULT_DOMAINS, OnnxGraph, ONode, TypeInfo, iter_values
from fusegraph.onnx.load import (
    KNOWN_DOMAINS,
    MAX_ELEMENTS,
    MAX_OPSET,
    MIN_OPSET,
    ModelError,
    default_opset,
    input_signature,
    load_model,
)
from fusegraph.onnx.specialize import FOLD_LIMIT, FOLD_MAX_ELEMENTS, specialize

__all__ = [
    "DEFAULT_DOMAINS",
    "FOLD_LIMIT",
    "FOLD_MAX_ELEMENTS",
    "KNOWN_DOMAINS",
    "MAX_ELEMENTS",
    "MAX_OPSET",
    "MIN_OPSET",
    "ModelError",
    "ONode",
    "OnnxGraph",
    "TypeInfo",
    "default_opset",
    "input_signature",
    "iter_values",
    "load_model",
    "specialize",
]
