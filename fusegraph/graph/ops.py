"""The op table: the one source of truth every layer reads.

The frontend, the shape inference, the reference engine, every emitter and the ONNX
partitioner key on :class:`OpKind`, on the mode enums and on the named groups below.
No other module re-lists ops; to add one, add it here and to each per-op table that the
tests say is incomplete.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from fusegraph.dtypes import DataType


class OpKind(enum.Enum):
    CONV_FPROP = "conv_fprop"
    CONV_DGRAD = "conv_dgrad"
    CONV_WGRAD = "conv_wgrad"
    MATMUL = "matmul"
    POINTWISE = "pointwise"
    REDUCTION = "reduction"
    BATCHNORM_INFERENCE = "batchnorm_inference"
    BATCHNORM = "batchnorm"
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"
    POOLING = "pooling"
    SDPA = "sdpa"
    SOFTMAX = "softmax"
    RESHAPE = "reshape"
    TRANSPOSE = "transpose"
    CONCATENATE = "concatenate"
    SLICE = "slice"
    # backward (training) ops, in cuDNN frontend's terms
    BATCHNORM_BACKWARD = "batchnorm_backward"
    LAYERNORM_BACKWARD = "layernorm_backward"
    RMSNORM_BACKWARD = "rmsnorm_backward"
    SDPA_BACKWARD = "sdpa_backward"
    # indexing: ONNX Gather (an embedding lookup) and its backward (embedding backward)
    GATHER = "gather"
    GATHER_BACKWARD = "gather_backward"
    # pooling's backward (cuDNN frontend's resample backward): dx from dy and the forward's x
    POOLING_BACKWARD = "pooling_backward"


class PointwiseMode(enum.Enum):
    # binary arithmetic
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"
    MAX = "max"
    MIN = "min"
    POW = "pow"
    # unary math
    ABS = "abs"
    NEG = "neg"
    EXP = "exp"
    LOG = "log"
    SQRT = "sqrt"
    RSQRT = "rsqrt"
    RECIPROCAL = "reciprocal"
    SIN = "sin"
    COS = "cos"
    ERF = "erf"
    FLOOR = "floor"
    CEIL = "ceil"
    IDENTITY = "identity"
    # activations (forward)
    RELU_FWD = "relu_fwd"
    TANH_FWD = "tanh_fwd"
    SIGMOID_FWD = "sigmoid_fwd"
    GELU_FWD = "gelu_fwd"
    GELU_APPROX_TANH_FWD = "gelu_approx_tanh_fwd"
    ELU_FWD = "elu_fwd"
    SWISH_FWD = "swish_fwd"
    SOFTPLUS_FWD = "softplus_fwd"
    # comparisons (boolean output)
    CMP_EQ = "cmp_eq"
    CMP_NEQ = "cmp_neq"
    CMP_GT = "cmp_gt"
    CMP_GE = "cmp_ge"
    CMP_LT = "cmp_lt"
    CMP_LE = "cmp_le"
    # logic (boolean inputs and output)
    LOGICAL_AND = "logical_and"
    LOGICAL_OR = "logical_or"
    LOGICAL_NOT = "logical_not"
    # select: out = a where c else b (c is boolean)
    BINARY_SELECT = "binary_select"
    # activation backward: (dy, x) -> dx
    RELU_BWD = "relu_bwd"
    GELU_BWD = "gelu_bwd"
    TANH_BWD = "tanh_bwd"
    SIGMOID_BWD = "sigmoid_bwd"
    ELU_BWD = "elu_bwd"
    GELU_APPROX_TANH_BWD = "gelu_approx_tanh_bwd"
    SOFTPLUS_BWD = "softplus_bwd"
    SWISH_BWD = "swish_bwd"


@dataclass(frozen=True)
class PointwiseSpec:
    """What the table knows of one pointwise mode."""

    arity: int
    params: tuple[tuple[str, float], ...] = ()  # name and default, in canonical order
    output: str = "same"  # "same": the promoted input type; "bool": boolean
    inputs: str = "numeric"  # "numeric", "bool" (logical ops), "float" (transcendentals)
    commutative: bool = False  # f(a, b) == f(b, a) exactly, NaNs and rounding included


_INF = float("inf")
_RELU_PARAMS = (
    ("relu_lower_clip", 0.0),
    ("relu_upper_clip", _INF),
    ("relu_lower_clip_slope", 0.0),
)

POINTWISE: dict[PointwiseMode, PointwiseSpec] = {
    PointwiseMode.ADD: PointwiseSpec(2, commutative=True),
    PointwiseMode.SUB: PointwiseSpec(2),
    PointwiseMode.MUL: PointwiseSpec(2, commutative=True),
    PointwiseMode.DIV: PointwiseSpec(2),
    PointwiseMode.MAX: PointwiseSpec(2, commutative=True),
    PointwiseMode.MIN: PointwiseSpec(2, commutative=True),
    PointwiseMode.POW: PointwiseSpec(2, inputs="float"),
    PointwiseMode.ABS: PointwiseSpec(1),
    PointwiseMode.NEG: PointwiseSpec(1),
    PointwiseMode.EXP: PointwiseSpec(1, inputs="float"),
    PointwiseMode.LOG: PointwiseSpec(1, inputs="float"),
    PointwiseMode.SQRT: PointwiseSpec(1, inputs="float"),
    PointwiseMode.RSQRT: PointwiseSpec(1, inputs="float"),
    PointwiseMode.RECIPROCAL: PointwiseSpec(1, inputs="float"),
    PointwiseMode.SIN: PointwiseSpec(1, inputs="float"),
    PointwiseMode.COS: PointwiseSpec(1, inputs="float"),
    PointwiseMode.ERF: PointwiseSpec(1, inputs="float"),
    PointwiseMode.FLOOR: PointwiseSpec(1, inputs="float"),
    PointwiseMode.CEIL: PointwiseSpec(1, inputs="float"),
    PointwiseMode.IDENTITY: PointwiseSpec(1, inputs="any"),
    PointwiseMode.RELU_FWD: PointwiseSpec(1, params=_RELU_PARAMS),
    PointwiseMode.TANH_FWD: PointwiseSpec(1, inputs="float"),
    PointwiseMode.SIGMOID_FWD: PointwiseSpec(1, inputs="float"),
    PointwiseMode.GELU_FWD: PointwiseSpec(1, inputs="float"),
    PointwiseMode.GELU_APPROX_TANH_FWD: PointwiseSpec(1, inputs="float"),
    PointwiseMode.ELU_FWD: PointwiseSpec(1, params=(("elu_alpha", 1.0),), inputs="float"),
    PointwiseMode.SWISH_FWD: PointwiseSpec(1, params=(("swish_beta", 1.0),), inputs="float"),
    PointwiseMode.SOFTPLUS_FWD: PointwiseSpec(
        1, params=(("softplus_beta", 1.0),), inputs="float"
    ),
    PointwiseMode.CMP_EQ: PointwiseSpec(2, output="bool", inputs="any", commutative=True),
    PointwiseMode.CMP_NEQ: PointwiseSpec(2, output="bool", inputs="any", commutative=True),
    PointwiseMode.CMP_GT: PointwiseSpec(2, output="bool"),
    PointwiseMode.CMP_GE: PointwiseSpec(2, output="bool"),
    PointwiseMode.CMP_LT: PointwiseSpec(2, output="bool"),
    PointwiseMode.CMP_LE: PointwiseSpec(2, output="bool"),
    PointwiseMode.LOGICAL_AND: PointwiseSpec(2, output="bool", inputs="bool", commutative=True),
    PointwiseMode.LOGICAL_OR: PointwiseSpec(2, output="bool", inputs="bool", commutative=True),
    PointwiseMode.LOGICAL_NOT: PointwiseSpec(1, output="bool", inputs="bool"),
    PointwiseMode.BINARY_SELECT: PointwiseSpec(3, inputs="any"),
    PointwiseMode.RELU_BWD: PointwiseSpec(2, params=(("relu_lower_clip", 0.0),)),
    PointwiseMode.GELU_BWD: PointwiseSpec(2, inputs="float"),
    PointwiseMode.TANH_BWD: PointwiseSpec(2, inputs="float"),
    PointwiseMode.SIGMOID_BWD: PointwiseSpec(2, inputs="float"),
    PointwiseMode.ELU_BWD: PointwiseSpec(2, params=(("elu_alpha", 1.0),), inputs="float"),
    PointwiseMode.GELU_APPROX_TANH_BWD: PointwiseSpec(2, inputs="float"),
    PointwiseMode.SOFTPLUS_BWD: PointwiseSpec(2, params=(("softplus_beta", 1.0),), inputs="float"),
    PointwiseMode.SWISH_BWD: PointwiseSpec(2, params=(("swish_beta", 1.0),), inputs="float"),
}

POINTWISE_UNARY = frozenset(m for m, s in POINTWISE.items() if s.arity == 1)
POINTWISE_BINARY = frozenset(m for m, s in POINTWISE.items() if s.arity == 2)
POINTWISE_COMPARE = frozenset(
    m for m, s in POINTWISE.items() if s.output == "bool" and s.inputs != "bool"
)
# Activation backward: (dy, x) -> dy * f'(x), x being the forward's input.
POINTWISE_BACKWARD = frozenset(
    {PointwiseMode.RELU_BWD, PointwiseMode.GELU_BWD, PointwiseMode.TANH_BWD,
     PointwiseMode.SIGMOID_BWD, PointwiseMode.ELU_BWD, PointwiseMode.GELU_APPROX_TANH_BWD,
     PointwiseMode.SOFTPLUS_BWD, PointwiseMode.SWISH_BWD}
)


class ReductionMode(enum.Enum):
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    AMAX = "amax"  # max of absolute values
    AVG = "avg"
    MUL = "mul"
    NORM1 = "norm1"
    NORM2 = "norm2"


class PoolingMode(enum.Enum):
    MAX = "max"
    AVG_INCLUDE_PAD = "avg_include_pad"
    AVG_EXCLUDE_PAD = "avg_exclude_pad"


class NormFwdPhase(enum.Enum):
    INFERENCE = "inference"
    TRAINING = "training"


CONVOLUTIONS = frozenset({OpKind.CONV_FPROP, OpKind.CONV_DGRAD, OpKind.CONV_WGRAD})
NORMS = frozenset(
    {OpKind.BATCHNORM_INFERENCE, OpKind.BATCHNORM, OpKind.LAYERNORM, OpKind.RMSNORM}
)
NORM_BACKWARD = frozenset(
    {OpKind.BATCHNORM_BACKWARD, OpKind.LAYERNORM_BACKWARD, OpKind.RMSNORM_BACKWARD}
)
BACKWARD = NORM_BACKWARD | {OpKind.SDPA_BACKWARD}
DATA_MOVEMENT = frozenset(
    {OpKind.RESHAPE, OpKind.TRANSPOSE, OpKind.CONCATENATE, OpKind.SLICE}
)
# Ops whose result depends on the values of an integer index tensor, not only on shapes:
# engines that compile for static shapes alone (cuDNN, the Triton row kernels) never see them.
INDEXING = frozenset({OpKind.GATHER, OpKind.GATHER_BACKWARD})


# ---- attributes: one frozen dataclass per op family -------------------------------------


@dataclass(frozen=True)
class ConvAttrs:
    pre_padding: tuple[int, ...]
    post_padding: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    compute_data_type: DataType | None = None


@dataclass(frozen=True)
class MatmulAttrs:
    compute_data_type: DataType | None = None


@dataclass(frozen=True)
class PointwiseAttrs:
    mode: PointwiseMode
    params: tuple[tuple[str, float], ...] = ()
    compute_data_type: DataType | None = None

    def param(self, name: str) -> float:
        for key, value in self.params:
            if key == name:
                return value
        raise KeyError(name)


@dataclass(frozen=True)
class ReductionAttrs:
    mode: ReductionMode
    compute_data_type: DataType | None = None


@dataclass(frozen=True)
class NormAttrs:
    phase: NormFwdPhase = NormFwdPhase.INFERENCE
    compute_data_type: DataType | None = None


@dataclass(frozen=True)
class NormBwdAttrs:
    compute_data_type: DataType | None = None


@dataclass(frozen=True)
class PoolingAttrs:
    mode: PoolingMode
    window: tuple[int, ...]
    stride: tuple[int, ...]
    pre_padding: tuple[int, ...]
    post_padding: tuple[int, ...]
    compute_data_type: DataType | None = None


@dataclass(frozen=True)
class SdpaAttrs:
    """Attention, forward and backward. ``dropout_probability`` > 0 needs the ``seed`` and
    ``offset`` inputs (the mask is fusegraph's Philox stream: reference/dropout.py)."""

    attn_scale: float | None = None
    causal: bool = False
    compute_data_type: DataType | None = None
    # Added after format version 1 was fixed: left out of the JSON (and so of the graph's
    # key) at its default, so graphs without dropout keep their keys.
    dropout_probability: float = field(default=0.0, metadata={"omit_if_default": True})


@dataclass(frozen=True)
class SoftmaxAttrs:
    axis: int
    log: bool = False
    compute_data_type: DataType | None = None


@dataclass(frozen=True)
class ReshapeAttrs:
    pass


@dataclass(frozen=True)
class TransposeAttrs:
    permutation: tuple[int, ...]


@dataclass(frozen=True)
class ConcatAttrs:
    axis: int


@dataclass(frozen=True)
class SliceAttrs:
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    steps: tuple[int, ...]


@dataclass(frozen=True)
class GatherAttrs:
    """ONNX Gather: ``y = take(data, indices, axis)``; negative indices count from the end."""

    axis: int = 0


@dataclass(frozen=True)
class GatherBackwardAttrs:
    """Embedding backward: ``d_data`` has ``num_rows`` rows along ``axis`` (0 only), each the
    sum of the ``dy`` slices whose index names it; row ``padding_idx`` gets none."""

    num_rows: int
    padding_idx: int | None = None
    axis: int = 0
    compute_data_type: DataType | None = None


OpAttrs = (
    ConvAttrs
    | MatmulAttrs
    | PointwiseAttrs
    | ReductionAttrs
    | NormAttrs
    | NormBwdAttrs
    | PoolingAttrs
    | SdpaAttrs
    | SoftmaxAttrs
    | ReshapeAttrs
    | TransposeAttrs
    | ConcatAttrs
    | SliceAttrs
    | GatherAttrs
    | GatherBackwardAttrs
)


@dataclass(frozen=True)
class OpSpec:
    """Ports and attribute type of one op kind. A trailing ``*`` marks a variadic port."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: type[Any]
    optional_inputs: frozenset[str] = field(default_factory=frozenset)
    optional_outputs: frozenset[str] = field(default_factory=frozenset)


OPS: dict[OpKind, OpSpec] = {
    OpKind.CONV_FPROP: OpSpec(("x", "w"), ("y",), ConvAttrs),
    OpKind.CONV_DGRAD: OpSpec(("dy", "w"), ("dx",), ConvAttrs),
    OpKind.CONV_WGRAD: OpSpec(("x", "dy"), ("dw",), ConvAttrs),
    OpKind.MATMUL: OpSpec(("a", "b"), ("c",), MatmulAttrs),
    OpKind.POINTWISE: OpSpec(
        ("a", "b", "c"), ("y",), PointwiseAttrs, optional_inputs=frozenset({"b", "c"})
    ),
    OpKind.REDUCTION: OpSpec(("x",), ("y",), ReductionAttrs),
    OpKind.BATCHNORM_INFERENCE: OpSpec(
        ("x", "scale", "bias", "mean", "var", "epsilon"), ("y",), NormAttrs
    ),
    OpKind.BATCHNORM: OpSpec(
        ("x", "scale", "bias", "epsilon", "in_running_mean", "in_running_var", "momentum"),
        ("y", "mean", "inv_var", "next_running_mean", "next_running_var"),
        NormAttrs,
        optional_inputs=frozenset({"in_running_mean", "in_running_var", "momentum"}),
        optional_outputs=frozenset({"next_running_mean", "next_running_var"}),
    ),
    OpKind.LAYERNORM: OpSpec(
        ("x", "scale", "bias", "epsilon"),
        ("y", "mean", "inv_var"),
        NormAttrs,
        optional_outputs=frozenset({"mean", "inv_var"}),
    ),
    OpKind.RMSNORM: OpSpec(
        ("x", "scale", "bias", "epsilon"),
        ("y", "inv_rms"),
        NormAttrs,
        optional_inputs=frozenset({"bias"}),
        optional_outputs=frozenset({"inv_rms"}),
    ),
    OpKind.POOLING: OpSpec(("x",), ("y",), PoolingAttrs),
    OpKind.SDPA: OpSpec(
        ("q", "k", "v", "mask", "seed", "offset"),
        ("o", "stats"),
        SdpaAttrs,
        optional_inputs=frozenset({"mask", "seed", "offset"}),
        optional_outputs=frozenset({"stats"}),
    ),
    OpKind.SOFTMAX: OpSpec(("x",), ("y",), SoftmaxAttrs),
    OpKind.RESHAPE: OpSpec(("x",), ("y",), ReshapeAttrs),
    OpKind.TRANSPOSE: OpSpec(("x",), ("y",), TransposeAttrs),
    OpKind.CONCATENATE: OpSpec(("x*",), ("y",), ConcatAttrs),
    OpKind.SLICE: OpSpec(("x",), ("y",), SliceAttrs),
    OpKind.BATCHNORM_BACKWARD: OpSpec(
        ("dy", "x", "scale", "mean", "inv_var"), ("dx", "dscale", "dbias"), NormBwdAttrs
    ),
    OpKind.LAYERNORM_BACKWARD: OpSpec(
        ("dy", "x", "scale", "mean", "inv_var"), ("dx", "dscale", "dbias"), NormBwdAttrs
    ),
    OpKind.RMSNORM_BACKWARD: OpSpec(
        ("dy", "x", "scale", "inv_rms"),
        ("dx", "dscale", "dbias"),
        NormBwdAttrs,
        optional_outputs=frozenset({"dbias"}),
    ),
    OpKind.SDPA_BACKWARD: OpSpec(
        ("q", "k", "v", "o", "do", "stats", "mask", "seed", "offset"),
        ("dq", "dk", "dv"),
        SdpaAttrs,
        optional_inputs=frozenset({"mask", "seed", "offset"}),
    ),
    OpKind.GATHER: OpSpec(("data", "indices"), ("y",), GatherAttrs),
    OpKind.GATHER_BACKWARD: OpSpec(("dy", "indices"), ("d_data",), GatherBackwardAttrs),
    OpKind.POOLING_BACKWARD: OpSpec(("dy", "x"), ("dx",), PoolingAttrs),
}
