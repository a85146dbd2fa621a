"""The builder methods of the backward (training) ops, in cuDNN frontend's names and
argument order: ``layernorm_backward``, ``rmsnorm_backward``, ``batchnorm_backward`` and
``sdpa_backward``.

A mixin of ``graph.Graph``, like graph/builder.py. Each takes what the forward saved (the
norms' mean and inverse variance / inverse RMS, attention's output and log-sum-exp
statistics) and returns the gradients of the forward's inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fusegraph.graph.builder_base import NodeAdder
from fusegraph.graph.ops import NormBwdAttrs, OpKind, SdpaAttrs
from fusegraph.graph.tensor import TensorAttr

Dropout = tuple[float, TensorAttr, TensorAttr]


class BackwardBuilder(NodeAdder):
    """The backward-op methods of ``Graph`` (a mixin: the IR half is ``graph.Graph``)."""

    if TYPE_CHECKING:  # provided by graph/builder.py

        def _sdpa_attrs(
            self, attn_scale: float | None, causal: bool, dropout: Dropout | None, compute_data_type: Any,
            name: str | None,
        ) -> SdpaAttrs: ...

        def _rng(self, dropout: Dropout | None, name: str | None) -> dict[str, TensorAttr | None]: ...

    def _norm_bwd(
        self, kind: OpKind, ins: Mapping[str, TensorAttr | None], ports: Sequence[str], compute_data_type: Any,
        name: str | None,
    ) -> dict[str, TensorAttr]:
        attrs = NormBwdAttrs(self._compute_default(compute_data_type))
        return self._add_node(kind, attrs, ins, name, outputs=ports).outputs

    def layernorm_backward(
        self,
        grad: TensorAttr,
        input: TensorAttr,
        scale: TensorAttr,
        mean: TensorAttr,
        inv_variance: TensorAttr,
        *,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> tuple[TensorAttr, TensorAttr, TensorAttr]:
        """(dx, dscale, dbias) of ``layernorm`` from its saved mean and inverse variance."""
        ins = {"dy": grad, "x": input, "scale": scale, "mean": mean, "inv_var": inv_variance}
        o = self._norm_bwd(OpKind.LAYERNORM_BACKWARD, ins, ("dx", "dscale", "dbias"), compute_data_type, name)
        return o["dx"], o["dscale"], o["dbias"]

    def rmsnorm_backward(
        self,
        grad: TensorAttr,
        input: TensorAttr,
        scale: TensorAttr,
        inv_variance: TensorAttr,
        has_dbias: bool = False,
        *,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> tuple[TensorAttr, TensorAttr, TensorAttr | None]:
        """(dx, dscale, dbias) of ``rmsnorm`` from its saved inverse RMS; dbias (the sum of
        ``grad`` over rows) only with ``has_dbias``, else None."""
        ins = {"dy": grad, "x": input, "scale": scale, "inv_rms": inv_variance}
        ports = ("dx", "dscale", "dbias") if has_dbias else ("dx", "dscale")
        o = self._norm_bwd(OpKind.RMSNORM_BACKWARD, ins, ports, compute_data_type, name)
        return o["dx"], o["dscale"], o.get("dbias")

    def batchnorm_backward(
        self,
        grad: TensorAttr,
        input: TensorAttr,
        scale: TensorAttr,
        mean: TensorAttr,
        inv_variance: TensorAttr,
        *,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> tuple[TensorAttr, TensorAttr, TensorAttr]:
        """(dx, dscale, dbias) of training ``batchnorm`` from its saved mean and inverse variance."""
        ins = {"dy": grad, "x": input, "scale": scale, "mean": mean, "inv_var": inv_variance}
        o = self._norm_bwd(OpKind.BATCHNORM_BACKWARD, ins, ("dx", "dscale", "dbias"), compute_data_type, name)
        return o["dx"], o["dscale"], o["dbias"]

    def sdpa_backward(
        self,
        q: TensorAttr,
        k: TensorAttr,
        v: TensorAttr,
        o: TensorAttr,
        dO: TensorAttr,
        stats: TensorAttr,
        attn_scale: float | None = None,
        causal: bool = False,
        mask: TensorAttr | None = None,
        *,
        dropout: Dropout | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> tuple[TensorAttr, TensorAttr, TensorAttr]:
        """(dq, dk, dv) of ``sdpa``: give the forward's output ``o``, its statistics (from
        ``sdpa(..., generate_stats=True)``) and the same scale, causal flag, mask and
        dropout (probability, seed, offset) as the forward. With grouped-query attention,
        dk and dv sum over the query heads that share each key/value head."""
        attrs = self._sdpa_attrs(attn_scale, causal, dropout, compute_data_type, name)
        ins = {"q": q, "k": k, "v": v, "o": o, "do": dO, "stats": stats, "mask": mask, **self._rng(dropout, name)}
        out = self._add_node(OpKind.SDPA_BACKWARD, attrs, ins, name).outputs
        return out["dq"], out["dk"], out["dv"]
