"""The builder methods users write graphs with (cuDNN frontend names and signatures).

Each method checks its arguments, packs them into the op's frozen attribute dataclass
(graph/ops.py) and hands the node to ``Graph._add_node``; inference and validation live
with the IR in graph/graph.py. Kept apart so that the IR reads on one screen and a new
op's method has one obvious home. The pointwise methods are in graph/builder_pointwise.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, overload

from fusegraph.dtypes import DataType
from fusegraph.errors import ValidationError
from fusegraph.graph.builder_base import NodeAdder
from fusegraph.graph.ops import (
    ConcatAttrs,
    ConvAttrs,
    MatmulAttrs,
    NormAttrs,
    NormFwdPhase,
    OpKind,
    PoolingAttrs,
    PoolingMode,
    ReductionAttrs,
    ReductionMode,
    ReshapeAttrs,
    SdpaAttrs,
    SliceAttrs,
    SoftmaxAttrs,
    TransposeAttrs,
)
from fusegraph.graph.tensor import TensorAttr

Ints = Sequence[int]
Epsilon = float | TensorAttr
Dropout = tuple[float, TensorAttr, TensorAttr]


def _name_of(t: Any) -> str | None:
    return t.name if isinstance(t, TensorAttr) else None


class GraphBuilder(NodeAdder):
    """The op-adding methods of ``Graph`` (a mixin: the IR half is ``graph.Graph``)."""

    # ---- convolutions ---------------------------------------------------------------------
    def _conv_attrs(
        self,
        nsp: int,
        padding: Ints | None,
        stride: Ints | None,
        dilation: Ints | None,
        pre_padding: Ints | None,
        post_padding: Ints | None,
        compute_data_type: Any,
    ) -> ConvAttrs:
        pad = tuple(padding) if padding is not None else (0,) * nsp
        return ConvAttrs(
            pre_padding=tuple(int(p) for p in (pre_padding if pre_padding is not None else pad)),
            post_padding=tuple(int(p) for p in (post_padding if post_padding is not None else pad)),
            stride=tuple(int(s) for s in (stride if stride is not None else (1,) * nsp)),
            dilation=tuple(int(d) for d in (dilation if dilation is not None else (1,) * nsp)),
            compute_data_type=self._compute_default(compute_data_type),
        )

    @staticmethod
    def _nsp(a: Any, b: Any, *given: Ints | None) -> int:
        """Spatial axes of a convolution, from whichever operand already has dims (a
        dgrad output gets its dims only later), else from the lengths the caller gave."""
        for t in (a, b):
            if isinstance(t, TensorAttr) and t._dim is not None:
                return max(len(t._dim) - 2, 0)
        for values in given:
            if values is not None:
                return len(values)
        return 0

    def conv_fprop(
        self,
        image: TensorAttr,
        weight: TensorAttr,
        padding: Ints | None = None,
        stride: Ints | None = None,
        dilation: Ints | None = None,
        *,
        pre_padding: Ints | None = None,
        post_padding: Ints | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> TensorAttr:
        """y = conv(image, weight); groups = image channels / weight.dim[1]."""
        attrs = self._conv_attrs(
            self._nsp(image, weight, padding, stride, dilation, pre_padding, post_padding),
            padding, stride, dilation, pre_padding, post_padding, compute_data_type,
        )
        return self._add_node(OpKind.CONV_FPROP, attrs, {"x": image, "w": weight}, name).outputs["y"]

    def conv_dgrad(
        self,
        loss: TensorAttr,
        filter: TensorAttr,
        padding: Ints | None = None,
        stride: Ints | None = None,
        dilation: Ints | None = None,
        *,
        pre_padding: Ints | None = None,
        post_padding: Ints | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> TensorAttr:
        """dx of a convolution; set its dims with ``.set_dim(...)`` before validate()."""
        attrs = self._conv_attrs(
            self._nsp(loss, filter, padding, stride, dilation, pre_padding, post_padding),
            padding, stride, dilation, pre_padding, post_padding, compute_data_type,
        )
        return self._add_node(OpKind.CONV_DGRAD, attrs, {"dy": loss, "w": filter}, name).outputs["dx"]

    def conv_wgrad(
        self,
        image: TensorAttr,
        loss: TensorAttr,
        padding: Ints | None = None,
        stride: Ints | None = None,
        dilation: Ints | None = None,
        *,
        pre_padding: Ints | None = None,
        post_padding: Ints | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> TensorAttr:
        """dw of a convolution; set its dims with ``.set_dim(...)`` before validate()."""
        attrs = self._conv_attrs(
            self._nsp(image, loss, padding, stride, dilation, pre_padding, post_padding),
            padding, stride, dilation, pre_padding, post_padding, compute_data_type,
        )
        return self._add_node(OpKind.CONV_WGRAD, attrs, {"x": image, "dy": loss}, name).outputs["dw"]

    # ---- matmul -----------------------------------------------------------------------------
    def matmul(
        self, A: TensorAttr, B: TensorAttr, *, compute_data_type: Any = None, name: str | None = None
    ) -> TensorAttr:
        """C[..., M, N] = A[..., M, K] @ B[..., K, N]; batch dims broadcast."""
        attrs = MatmulAttrs(self._compute_default(compute_data_type))
        return self._add_node(OpKind.MATMUL, attrs, {"a": A, "b": B}, name).outputs["c"]

    # ---- reductions, norms, pooling, attention ------------------------------------------------
    def reduction(
        self,
        input: TensorAttr,
        mode: ReductionMode = ReductionMode.SUM,
        dim: Ints | None = None,
        *,
        axes: Ints | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> TensorAttr:
        """Reduce to ``dim`` (same rank, 1 on reduced axes), or over ``axes``."""
        attrs = ReductionAttrs(mode, self._compute_default(compute_data_type))
        node = self._add_node(OpKind.REDUCTION, attrs, {"x": input}, name)
        y = node.outputs["y"]
        if dim is not None and axes is not None:
            raise ValidationError("give dim= or axes=, not both", node=node.name)
        if axes is not None:
            if input._dim is None:
                raise ValidationError(
                    "reduction: axes= needs the input's dims, which are not known yet; pass dim=",
                    node=node.name,
                    tensor=input.name,
                )
            rank = len(input.dim)
            if any(not -rank <= int(a) < rank for a in axes):
                raise ValidationError(
                    f"reduction: axes {list(axes)} out of range for input dims {input.dim}",
                    node=node.name,
                    tensor=input.name,
                )
            ax = {int(a) % rank for a in axes}
            dim = [1 if i in ax else d for i, d in enumerate(input.dim)]
        if dim is not None:
            y.set_dim(dim)
            self._try_infer(node)
        return y

    def _eps(self, epsilon: Epsilon, node: str | None = None) -> TensorAttr:
        if isinstance(epsilon, TensorAttr):
            return epsilon
        try:
            value = float(epsilon)
        except (TypeError, ValueError):
            raise ValidationError(f"epsilon must be a number, got {epsilon!r}", node=node) from None
        if not (math.isfinite(value) and value >= 0.0):
            # NaN makes every y NaN, +inf makes it 0, a negative one takes sqrt of a negative
            raise ValidationError(f"epsilon must be finite and >= 0, got {value}", node=node)
        return self.scalar(value, DataType.FLOAT)

    def batchnorm_inference(
        self,
        input: TensorAttr,
        scale: TensorAttr,
        bias: TensorAttr,
        mean: TensorAttr,
        var: TensorAttr,
        epsilon: Epsilon = 1e-5,
        *,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> TensorAttr:
        """y = (x - mean) / sqrt(var + eps) * scale + bias, per channel (axis 1)."""
        attrs = NormAttrs(NormFwdPhase.INFERENCE, self._compute_default(compute_data_type))
        ins = {"x": input, "scale": scale, "bias": bias, "mean": mean, "var": var, "epsilon": self._eps(epsilon, name)}
        return self._add_node(OpKind.BATCHNORM_INFERENCE, attrs, ins, name).outputs["y"]

    @overload
    def batchnorm(
        self,
        input: TensorAttr,
        scale: TensorAttr,
        bias: TensorAttr,
        epsilon: Epsilon = 1e-5,
        *,
        in_running_mean: None = None,
        in_running_var: None = None,
        momentum: Epsilon | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> tuple[TensorAttr, TensorAttr, TensorAttr]: ...

    @overload
    def batchnorm(
        self,
        input: TensorAttr,
        scale: TensorAttr,
        bias: TensorAttr,
        epsilon: Epsilon = 1e-5,
        *,
        in_running_mean: TensorAttr,
        in_running_var: TensorAttr,
        momentum: Epsilon | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> tuple[TensorAttr, TensorAttr, TensorAttr, TensorAttr, TensorAttr]: ...

    def batchnorm(
        self,
        input: TensorAttr,
        scale: TensorAttr,
        bias: TensorAttr,
        epsilon: Epsilon = 1e-5,
        *,
        in_running_mean: TensorAttr | None = None,
        in_running_var: TensorAttr | None = None,
        momentum: Epsilon | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> tuple[TensorAttr, ...]:
        """Training batchnorm over (N, spatial): returns (y, saved_mean, saved_inv_var), and
        with the running statistics given (cuDNN's ``in_running_mean``, ``in_running_var``,
        ``momentum``, default 0.1) also (next_running_mean, next_running_var):
        ``next = (1 - momentum) * running + momentum * batch``, the batch variance unbiased
        (divided by count - 1) as PyTorch and cuDNN keep it."""
        attrs = NormAttrs(NormFwdPhase.TRAINING, self._compute_default(compute_data_type))
        ins: dict[str, TensorAttr | None] = {
            "x": input, "scale": scale, "bias": bias, "epsilon": self._eps(epsilon, name)
        }
        ports = ["y", "mean", "inv_var"]
        if (in_running_mean is None) != (in_running_var is None):
            raise ValidationError(
                "batchnorm: give in_running_mean and in_running_var together", node=name,
                tensor=_name_of(in_running_mean or in_running_var),
            )
        if in_running_mean is not None:
            ins |= {
                "in_running_mean": in_running_mean,
                "in_running_var": in_running_var,
                "momentum": self._momentum(0.1 if momentum is None else momentum, name),
            }
            ports += ["next_running_mean", "next_running_var"]
        elif momentum is not None:
            raise ValidationError("batchnorm: momentum without running statistics", node=name)
        o = self._add_node(OpKind.BATCHNORM, attrs, ins, name, outputs=ports).outputs
        return tuple(o[p] for p in ports)

    def _momentum(self, momentum: Epsilon, node: str | None) -> TensorAttr:
        if isinstance(momentum, TensorAttr):
            return momentum
        try:
            value = float(momentum)
        except (TypeError, ValueError):
            raise ValidationError(f"momentum must be a number, got {momentum!r}", node=node) from None
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise ValidationError(f"momentum must be in [0, 1], got {value}", node=node)
        return self.scalar(value, DataType.FLOAT)

    def layernorm(
        self,
        input: TensorAttr,
        scale: TensorAttr,
        bias: TensorAttr,
        epsilon: Epsilon = 1e-5,
        phase: NormFwdPhase = NormFwdPhase.INFERENCE,
        *,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> tuple[TensorAttr, TensorAttr | None, TensorAttr | None]:
        """Normalizes over every dim but the first; (y, mean, inv_var), stats at TRAINING only."""
        phase = NormFwdPhase(phase)
        attrs = NormAttrs(phase, self._compute_default(compute_data_type))
        ins = {"x": input, "scale": scale, "bias": bias, "epsilon": self._eps(epsilon, name)}
        ports = ("y", "mean", "inv_var") if phase == NormFwdPhase.TRAINING else ("y",)
        o = self._add_node(OpKind.LAYERNORM, attrs, ins, name, outputs=ports).outputs
        return o["y"], o.get("mean"), o.get("inv_var")

    def rmsnorm(
        self,
        input: TensorAttr,
        scale: TensorAttr,
        epsilon: Epsilon = 1e-5,
        phase: NormFwdPhase = NormFwdPhase.INFERENCE,
        *,
        bias: TensorAttr | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> tuple[TensorAttr, TensorAttr | None]:
        """y = x / rms(x) * scale (+ bias) over every dim but the first; (y, inv_rms)."""
        phase = NormFwdPhase(phase)
        attrs = NormAttrs(phase, self._compute_default(compute_data_type))
        ins = {"x": input, "scale": scale, "bias": bias, "epsilon": self._eps(epsilon, name)}
        ports = ("y", "inv_rms") if phase == NormFwdPhase.TRAINING else ("y",)
        o = self._add_node(OpKind.RMSNORM, attrs, ins, name, outputs=ports).outputs
        return o["y"], o.get("inv_rms")

    def pooling(
        self,
        input: TensorAttr,
        mode: PoolingMode = PoolingMode.MAX,
        window: Ints = (2, 2),
        stride: Ints | None = None,
        padding: Ints | None = None,
        *,
        pre_padding: Ints | None = None,
        post_padding: Ints | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> TensorAttr:
        """Max / average pooling over the spatial axes; stride defaults to the window."""
        attrs = self._pooling_attrs(mode, window, stride, padding, pre_padding, post_padding, compute_data_type)
        return self._add_node(OpKind.POOLING, attrs, {"x": input}, name).outputs["y"]

    def pooling_backward(
        self,
        dy: TensorAttr,
        x: TensorAttr,
        mode: PoolingMode = PoolingMode.MAX,
        window: Ints = (2, 2),
        stride: Ints | None = None,
        padding: Ints | None = None,
        *,
        pre_padding: Ints | None = None,
        post_padding: Ints | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> TensorAttr:
        """The gradient ``dx`` of ``pooling(x, ...)`` (same attributes) given ``dy``, dims of
        x (cuDNN frontend's resample backward). Max pooling sends each window's gradient to
        the window's first maximum in row-major window order (PyTorch's rule on ties), so no
        indices are kept: they are recomputed from ``x``. Average pooling spreads it evenly
        over the window (include-pad divides by the whole window, exclude-pad by its real
        elements)."""
        attrs = self._pooling_attrs(mode, window, stride, padding, pre_padding, post_padding, compute_data_type)
        return self._add_node(OpKind.POOLING_BACKWARD, attrs, {"dy": dy, "x": x}, name).outputs["dx"]

    def _pooling_attrs(
        self,
        mode: PoolingMode,
        window: Ints,
        stride: Ints | None,
        padding: Ints | None,
        pre_padding: Ints | None,
        post_padding: Ints | None,
        compute_data_type: Any,
    ) -> PoolingAttrs:
        win = tuple(int(w) for w in window)
        pad = tuple(padding) if padding is not None else (0,) * len(win)
        return PoolingAttrs(
            mode=PoolingMode(mode),
            window=win,
            stride=tuple(int(s) for s in (stride if stride is not None else win)),
            pre_padding=tuple(int(p) for p in (pre_padding if pre_padding is not None else pad)),
            post_padding=tuple(int(p) for p in (post_padding if post_padding is not None else pad)),
            compute_data_type=self._compute_default(compute_data_type),
        )

    @overload
    def sdpa(
        self,
        q: TensorAttr,
        k: TensorAttr,
        v: TensorAttr,
        attn_scale: float | None = None,
        causal: bool = False,
        mask: TensorAttr | None = None,
        *,
        generate_stats: Literal[False] = False,
        dropout: Dropout | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> TensorAttr: ...

    @overload
    def sdpa(
        self,
        q: TensorAttr,
        k: TensorAttr,
        v: TensorAttr,
        attn_scale: float | None = None,
        causal: bool = False,
        mask: TensorAttr | None = None,
        *,
        generate_stats: Literal[True],
        dropout: Dropout | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> tuple[TensorAttr, TensorAttr]: ...

    def sdpa(
        self,
        q: TensorAttr,
        k: TensorAttr,
        v: TensorAttr,
        attn_scale: float | None = None,
        causal: bool = False,
        mask: TensorAttr | None = None,
        *,
        generate_stats: bool = False,
        dropout: Dropout | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> TensorAttr | tuple[TensorAttr, TensorAttr]:
        """softmax(q kᵀ · scale + mask) v on [batch, heads, seq, dim]; k/v heads may divide q's.

        ``generate_stats=True`` (cuDNN's name) also returns the statistics the backward
        reads: the log-sum-exp of each query row's scaled, masked scores, [b, h, s_q, 1].
        ``dropout=(probability, seed, offset)`` drops probabilities after the softmax and
        scales the kept ones by 1 / (1 - probability); the mask is reference/dropout.py's
        Philox stream of (seed, offset), the same on every engine that runs it.
        """
        attrs = self._sdpa_attrs(attn_scale, causal, dropout, compute_data_type, name)
        ins = {"q": q, "k": k, "v": v, "mask": mask, **self._rng(dropout, name)}
        ports = ("o", "stats") if generate_stats else ("o",)
        o = self._add_node(OpKind.SDPA, attrs, ins, name, outputs=ports).outputs
        return (o["o"], o["stats"]) if generate_stats else o["o"]

    def _sdpa_attrs(
        self, attn_scale: float | None, causal: bool, dropout: Dropout | None, compute_data_type: Any, name: str | None
    ) -> SdpaAttrs:
        p = 0.0
        if dropout is not None:
            if not isinstance(dropout, tuple | list) or len(dropout) != 3:
                raise ValidationError(
                    f"dropout must be (probability, seed tensor, offset tensor), got {dropout!r}", node=name
                )
            try:
                p = float(dropout[0])
            except (TypeError, ValueError):
                raise ValidationError(f"dropout probability must be a number, got {dropout[0]!r}", node=name) from None
            if not (math.isfinite(p) and 0.0 <= p < 1.0):
                raise ValidationError(f"dropout probability must be in [0, 1), got {p}", node=name)
        return SdpaAttrs(
            None if attn_scale is None else float(attn_scale),
            bool(causal),
            self._compute_default(compute_data_type),
            dropout_probability=p,
        )

    def _rng(self, dropout: Dropout | None, name: str | None) -> dict[str, TensorAttr | None]:
        if dropout is None:
            return {}
        seed, offset = dropout[1], dropout[2]
        for what, t in (("seed", seed), ("offset", offset)):
            if not isinstance(t, TensorAttr):
                raise ValidationError(
                    f"dropout {what} must be a tensor (an INT64 graph input or g.scalar(value, INT64)), "
                    f"got {type(t).__name__}",
                    node=name,
                )
        return {"seed": seed, "offset": offset}

    def softmax(
        self, input: TensorAttr, axis: int = -1, log: bool = False, *, name: str | None = None
    ) -> TensorAttr:
        """Softmax (or log-softmax) along one axis."""
        attrs = SoftmaxAttrs(axis=int(axis), log=bool(log))
        return self._add_node(OpKind.SOFTMAX, attrs, {"x": input}, name).outputs["y"]

    # ---- data movement ---------------------------------------------------------------------
    def reshape(self, input: TensorAttr, dim: Ints, name: str | None = None) -> TensorAttr:
        """Row-major reshape of the logical dims; one dim may be -1."""
        dims = [int(d) for d in dim]
        if dims.count(-1) > 1:
            raise ValidationError("reshape: at most one -1 in dims", node=name, tensor=input.name)
        if -1 in dims:
            if not isinstance(input, TensorAttr) or input._dim is None:
                raise ValidationError(
                    "reshape: -1 needs the input's dims, which are not known yet (set them first)",
                    node=name,
                    tensor=_name_of(input),
                )
            known = math.prod(d for d in dims if d != -1)
            total = math.prod(input.dim)
            if known == 0 or total % known:
                raise ValidationError(
                    f"reshape: cannot infer -1 in {dims} from {input.dim}", node=name, tensor=input.name
                )
            dims[dims.index(-1)] = total // known
        node = self._add_node(OpKind.RESHAPE, ReshapeAttrs(), {"x": input}, name)
        y = node.outputs["y"]
        y.set_dim(dims)
        self._try_infer(node)
        return y

    def transpose(self, input: TensorAttr, permutation: Ints, name: str | None = None) -> TensorAttr:
        """Logical transpose: output dim i is input dim permutation[i]."""
        attrs = TransposeAttrs(tuple(int(p) for p in permutation))
        return self._add_node(OpKind.TRANSPOSE, attrs, {"x": input}, name).outputs["y"]

    def concatenate(self, inputs: Sequence[TensorAttr], axis: int, name: str | None = None) -> TensorAttr:
        rank = len(inputs[0].dim) if inputs else 0
        axis = int(axis) + rank if axis < 0 else int(axis)
        ins = {f"x{i}": t for i, t in enumerate(inputs)}
        return self._add_node(OpKind.CONCATENATE, ConcatAttrs(axis), ins, name).outputs["y"]

    def slice(
        self,
        input: TensorAttr,
        starts: Ints,
        ends: Ints,
        steps: Ints | None = None,
        axes: Ints | None = None,
        name: str | None = None,
    ) -> TensorAttr:
        """Python/NumPy slicing per axis (negative and out-of-range indices clamp); steps >= 1."""
        if not isinstance(input, TensorAttr) or input._dim is None:
            raise ValidationError(
                "slice: the input's dims must be known first (set them with .set_dim())",
                node=name,
                tensor=_name_of(input),
            )
        dims = input.dim
        rank = len(dims)
        if axes is not None and any(not -rank <= int(a) < rank for a in axes):
            raise ValidationError(
                f"slice: axes {list(axes)} out of range for rank {rank}", node=name, tensor=input.name
            )
        ax = [int(a) % rank for a in axes] if axes is not None else list(range(len(starts)))
        st = list(steps) if steps is not None else [1] * len(ax)
        if not (len(ax) == len(starts) == len(ends) == len(st)) or len(set(ax)) != len(ax) or len(ax) > rank:
            raise ValidationError(
                "slice: starts, ends, steps and axes must have one entry per sliced axis "
                f"(got {len(starts)}, {len(ends)}, {len(st)}, axes {ax}) for rank {rank}",
                node=name,
                tensor=input.name,
            )
        s_all, e_all, k_all = [0] * rank, list(dims), [1] * rank
        for a, s, e, k in zip(ax, starts, ends, st, strict=True):
            if int(k) < 1:
                raise ValidationError(f"slice: step {k} on axis {a} must be >= 1", node=name, tensor=input.name)
            lo, hi, _ = slice(int(s), int(e), int(k)).indices(dims[a])
            s_all[a], e_all[a], k_all[a] = lo, max(hi, lo), int(k)
        attrs = SliceAttrs(tuple(s_all), tuple(e_all), tuple(k_all))
        return self._add_node(OpKind.SLICE, attrs, {"x": input}, name).outputs["y"]
