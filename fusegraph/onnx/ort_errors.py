"""Feed errors an ``except`` written for ONNX Runtime also catches.

ONNX Runtime raises ``InvalidArgument`` (a pybind11 exception class) for a wrong input dtype,
shape or output name, and ``ValueError`` for missing inputs. The session's typed errors
subclass both fusegraph's ``VariantPackError`` and the ONNX Runtime class, so neither kind of
``except`` clause is surprised.
"""

from __future__ import annotations

from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

from fusegraph.errors import VariantPackError


class InvalidFeedError(VariantPackError, InvalidArgument):  # type: ignore[misc]
    """A feed or output name ONNX Runtime would reject with INVALID_ARGUMENT."""


class MissingFeedError(VariantPackError, ValueError):
    """Required inputs missing from the feed (ONNX Runtime raises ValueError)."""
