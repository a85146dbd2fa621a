"""The ONNX execution provider: ONNX models run with claimed subgraphs on fusegraph engines
and the rest on ONNX Runtime, behind ONNX Runtime's own session API.

    import fusegraph.onnx as fgo
    sess = fgo.InferenceSession("model.onnx")           # providers default to
    out = sess.run(None, {"input": x})                  # [Fusegraph, CPU]
    print(sess.partition_report())

See docs/onnx.md.
"""

from __future__ import annotations

from fusegraph.onnx.model import ModelError
from fusegraph.onnx.options import PROVIDER, ProviderOptions
from fusegraph.onnx.report import PartitionReport
from fusegraph.onnx.session import InferenceSession, NodeArg

__all__ = [
    "PROVIDER",
    "InferenceSession",
    "ModelError",
    "NodeArg",
    "PartitionReport",
    "ProviderOptions",
    "get_available_providers",
]


def get_available_providers() -> list[str]:
    import onnxruntime as ort

    return [PROVIDER, *ort.get_available_providers()]
