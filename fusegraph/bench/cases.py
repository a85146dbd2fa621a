"""A parsed driver line as cases: the fusegraph graph, its work (FLOPs, bytes), and the same
computation as PyTorch calls it and as an ONNX model, for the baselines.

Every graph uses the line's data type for its inputs and outputs and f32 for computing and
intermediates (as benchmarks/bench_gpu.py's graphs and cuDNN's frontend samples do).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fusegraph as fg
from fusegraph.bench.flags import CONV_ALIASES, DTYPES, UsageError
from fusegraph.dtypes import DataType
from fusegraph.graph.layout import strides_for

# (tensors) -> result: PyTorch tensors in, one tensor out
TorchFn = Callable[[dict[str, Any]], Any]


@dataclass
class Case:
    """One thing to time. ``eager`` is the PyTorch form (None: there is none, ``no_eager``
    says why); ``onnx`` makes the ONNX model for ONNX Runtime (None: ``no_onnx`` says why)."""

    name: str
    family: str
    command: str
    graph: fg.Graph
    dtype: DataType
    flops: float = 0.0
    bytes: float = 0.0
    eager: TorchFn | None = None
    no_eager: str = ""
    onnx: Callable[[], Any] | None = None
    no_onnx: str = ""
    notes: list[str] = field(default_factory=list)
    tune: bool = False


def cases_of(args: argparse.Namespace, command: str) -> list[Case]:
    """The cases of one parsed line (conv ``-F 0`` gives three)."""
    family = args.family
    if family in CONV_ALIASES:
        return _conv_cases(args, command)
    builders: dict[str, Callable[[argparse.Namespace, str], Case]] = {
        "matmul": _matmul, "gemm": _matmul, "layernorm": _norm, "rmsnorm": _norm,
        "softmax": _softmax, "sdpa": _sdpa, "graph": _graph_file,
    }
    return [builders[family](args, command)]


def _new_graph(name: str, dt: DataType) -> fg.Graph:
    inter = DataType.FLOAT
    return fg.Graph(name, io_data_type=dt, intermediate_data_type=inter, compute_data_type=DataType.FLOAT)


def _io_bytes(g: fg.Graph) -> float:
    total = 0
    for t in [*g.inputs(), *g.outputs()]:
        if not t.is_scalar:
            total += math.prod(t.shape) * t.dtype.itemsize
    return float(total)


def _activate(g: fg.Graph, y: Any, act: str) -> Any:
    if act == "none":
        return y
    fns: dict[str, Callable[[Any], Any]] = {
        "relu": g.relu, "gelu": g.gelu, "gelu_tanh": g.gelu_approx_tanh, "tanh": g.tanh, "sigmoid": g.sigmoid,
        "silu": g.swish, "elu": g.elu, "leaky_relu": g.leaky_relu,
    }
    return fns[act](y)


def torch_activation(act: str) -> Callable[[Any], Any]:
    """The PyTorch function of an activation name (the eager baselines' epilogue)."""
    import torch.nn.functional as F

    table: dict[str, Callable[[Any], Any]] = {
        "none": lambda t: t, "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "tanh": lambda t: t.tanh(), "sigmoid": lambda t: t.sigmoid(), "silu": F.silu, "elu": F.elu,
        "leaky_relu": F.leaky_relu,
    }
    return table[act]


# ---- convolution ---------------------------------------------------------------------------------
DIRECTIONS = {0: ("fwd", "bwd", "wrw"), 1: ("fwd",), 2: ("bwd",), 4: ("wrw",), 3: ("fwd", "bwd"),
              5: ("fwd", "wrw"), 6: ("bwd", "wrw"), 7: ("fwd", "bwd", "wrw")}


@dataclass(frozen=True)
class ConvShape:
    n: int
    c: int
    k: int
    groups: int
    spatial: tuple[int, ...]
    filt: tuple[int, ...]
    pad: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    in_layout: str
    fil_layout: str
    out_layout: str

    @property
    def out_spatial(self) -> tuple[int, ...]:
        return tuple((i + 2 * p - d * (f - 1) - 1) // s + 1
                     for i, p, d, f, s in zip(self.spatial, self.pad, self.dilation, self.filt, self.stride, strict=True))

    @property
    def x_dims(self) -> list[int]:
        return [self.n, self.c, *self.spatial]

    @property
    def w_dims(self) -> list[int]:
        return [self.k, self.c // self.groups, *self.filt]

    @property
    def y_dims(self) -> list[int]:
        return [self.n, self.k, *self.out_spatial]

    @property
    def flops(self) -> float:
        return 2.0 * self.n * self.k * math.prod(self.out_spatial) * (self.c // self.groups) * math.prod(self.filt)

    def label(self) -> str:
        names = "dhw"[3 - len(self.spatial):]
        sp = "".join(f"{a}{v}" for a, v in zip(names, self.spatial, strict=True))
        fl = "".join(f"{a}{v}" for a, v in zip("tyx"[3 - len(self.filt):], self.filt, strict=True))
        extra = ""
        if any(p for p in self.pad):
            extra += "_p" + "x".join(map(str, self.pad))
        if any(s != 1 for s in self.stride):
            extra += "_s" + "x".join(map(str, self.stride))
        if any(d != 1 for d in self.dilation):
            extra += "_d" + "x".join(map(str, self.dilation))
        if self.groups != 1:
            extra += f"_g{self.groups}"
        return f"n{self.n}c{self.c}{sp}_k{self.k}{fl}{extra}"


def _layout(text: str, rank: int, flag: str) -> str:
    default = "NCHW" if rank == 4 else "NCDHW"
    name = (text or default).upper()
    if rank == 5:
        name = {"NCHW": "NCDHW", "NHWC": "NDHWC"}.get(name, name)
    allowed = ("NCHW", "NHWC") if rank == 4 else ("NCDHW", "NDHWC")
    if name not in allowed:
        raise UsageError(f"{flag} {text!r}: expected {' or '.join(allowed)}")
    return name


def conv_shape(args: argparse.Namespace) -> ConvShape:
    """MIOpen's meanings: -p/-q/-$ symmetric zero padding, -z same/valid recomputing it (as
    MIOpen does, only where the dilations or the filter are all 1), -g groups dividing -c
    and -k, the filter [K, C/g, ...]."""
    three = args.spatial_dim == 3
    spatial = (args.in_d, args.in_h, args.in_w) if three else (args.in_h, args.in_w)
    filt = (args.fil_d, args.fil_h, args.fil_w) if three else (args.fil_h, args.fil_w)
    pad: tuple[int, ...] = (args.pad_d, args.pad_h, args.pad_w) if three else (args.pad_h, args.pad_w)
    stride = (args.conv_stride_d, args.conv_stride_h, args.conv_stride_w) if three else (args.conv_stride_h, args.conv_stride_w)
    dil = (args.dilation_d, args.dilation_h, args.dilation_w) if three else (args.dilation_h, args.dilation_w)
    if args.group_count > 1 and (args.in_channels % args.group_count or args.out_channels % args.group_count):
        raise UsageError(f"-g {args.group_count}: the groups must divide -c {args.in_channels} and -k {args.out_channels}")
    if args.pad_mode != "default" and (all(d == 1 for d in dil) or all(f == 1 for f in filt)):
        if args.pad_mode == "valid":
            pad = tuple(0 for _ in pad)
        else:  # "same", MIOpen's formula
            pad = tuple(max(f - s, 0) // 2 if i % s == 0 else max(f - i % s, 0) // 2
                        for i, f, s in zip(spatial, filt, stride, strict=True))
    rank = len(spatial) + 2
    shape = ConvShape(
        args.batchsize, args.in_channels, args.out_channels, args.group_count, spatial, filt, pad, stride, dil,
        _layout(args.in_layout, rank, "--in_layout"), _layout(args.fil_layout, rank, "--fil_layout"),
        _layout(args.out_layout, rank, "--out_layout"),
    )
    if any(o < 1 for o in shape.out_spatial):
        raise UsageError(f"the output would be empty: input {list(spatial)}, filter {list(filt)} (dilation {list(dil)}), "
                         f"padding {list(pad)}, stride {list(stride)} give {list(shape.out_spatial)}")
    return shape


def _refuse_conv_flags(args: argparse.Namespace) -> None:
    if args.mode == "trans" and args.forw != 1:
        raise UsageError(f"-m trans -F {args.forw}: only the transposed forward (-F 1) is built; its backward "
                         "directions are a convolution's forward and weight gradient (-m conv)")
    for flag, value in (("-d/--in_data", args.in_data), ("-e/--weights", args.weights),
                        ("-D/--dout_data", args.dout_data), ("-a/--in_bias", args.in_bias)):
        if value:
            raise UsageError(f"{flag} {value!r}: data files are not read; inputs are random (--seed)")
    for flag, value in (("-U/--in_cast_type", args.in_cast_type), ("-T/--out_cast_type", args.out_cast_type),
                        ("-R/--wei_cast_type", args.wei_cast_type)):
        if value not in ("-1", ""):
            raise UsageError(f"{flag} {value!r}: cast types are not supported")
    if args.pad_val:
        raise UsageError(f"-r/--pad_val {args.pad_val}: only zero padding")
    if args.tensor_vect or args.vector_length != 1:
        raise UsageError("-Z/--tensor_vect, -L/--vector_length: vectorized tensors are not supported")
    if args.forw not in DIRECTIONS:
        raise UsageError(f"-F {args.forw}: expected 0 (all), 1 (fwd), 2 (bwd data), 4 (bwd weight), 3, 5 or 6")


def _conv_cases(args: argparse.Namespace, command: str) -> list[Case]:
    _refuse_conv_flags(args)
    dtype_name = args.dtype or CONV_ALIASES[args.family] or "f32"
    dt = DTYPES[dtype_name]
    if args.mode == "trans":
        case = _trans_case(args, dt, dtype_name, command)
        case.tune = bool(args.tune or args.search)
        return [case]
    shape = conv_shape(args)
    out = []
    for direction in DIRECTIONS[args.forw]:
        case = _conv_case(shape, direction, dt, dtype_name, bool(args.bias), args.activation, command)
        case.tune = bool(args.tune or args.search)
        out.append(case)
    return out


def _conv_case(s: ConvShape, direction: str, dt: DataType, dtn: str, bias: bool, act: str, command: str) -> Case:
    nd = len(s.spatial)
    epilogue = ("_bias" if bias else "") + ("" if act == "none" else f"_{act}")
    lay = s.in_layout if s.in_layout == s.out_layout else f"{s.in_layout}-{s.out_layout}"
    name = f"conv{nd}d_{direction}_{s.label()}{epilogue if direction == 'fwd' else ''}_{lay}_{dtn}"
    g = _new_graph(name, dt)
    xs, ws, ys = (strides_for(s.x_dims, s.in_layout), strides_for(s.w_dims, s.fil_layout), strides_for(s.y_dims, s.out_layout))
    pad, stride, dil = list(s.pad), list(s.stride), list(s.dilation)
    notes = []
    if direction == "fwd":
        x, w = g.tensor("x", s.x_dims, xs), g.tensor("w", s.w_dims, ws)
        y = g.conv_fprop(x, w, padding=pad, stride=stride, dilation=dil, name="conv")
        if bias:
            y = g.bias(y, g.tensor("b", [1, s.k] + [1] * nd), name="bias")
        y = _activate(g, y, act)
        y.set_name("y").set_output(True).set_stride(list(ys))
    elif direction == "bwd":
        dy, w = g.tensor("dy", s.y_dims, ys), g.tensor("w", s.w_dims, ws)
        dx = g.conv_dgrad(dy, w, padding=pad, stride=stride, dilation=dil, name="dgrad")
        dx.set_dim(s.x_dims).set_stride(list(xs)).set_name("dx").set_output(True)
    else:
        x, dy = g.tensor("x", s.x_dims, xs), g.tensor("dy", s.y_dims, ys)
        dw = g.conv_wgrad(x, dy, padding=pad, stride=stride, dilation=dil, name="wgrad")
        dw.set_dim(s.w_dims).set_stride(list(ws)).set_name("dw").set_output(True)
    if direction != "fwd" and (bias or act != "none"):
        notes.append("bias and activation apply to the forward direction only")
    g.validate()
    case = Case(name, "conv", command, g, dt, s.flops, _io_bytes(g), notes=notes)
    case.eager = _conv_eager(s, direction, bias, act)
    if direction == "wrw":
        case.no_onnx = "ONNX has no weight-gradient operator"
    else:
        case.onnx = lambda: _onnx().conv_model(s, direction, dt, bias, act)
    return case


def _trans_case(args: argparse.Namespace, dt: DataType, dtn: str, command: str) -> Case:
    """MIOpen's ``-m trans``: the input [N, C, ...], the filter [C, K/g, ...], the output
    [N, K, ...] of (in - 1) * stride - 2 * pad + dilation * (filter - 1) + 1 + output pad
    (``-Y -X -%``): a convolution's data gradient, which is how fusegraph builds it."""
    three = args.spatial_dim == 3
    spatial = (args.in_d, args.in_h, args.in_w) if three else (args.in_h, args.in_w)
    filt = (args.fil_d, args.fil_h, args.fil_w) if three else (args.fil_h, args.fil_w)
    pad = (args.pad_d, args.pad_h, args.pad_w) if three else (args.pad_h, args.pad_w)
    stride = (args.conv_stride_d, args.conv_stride_h, args.conv_stride_w) if three else (args.conv_stride_h, args.conv_stride_w)
    dil = (args.dilation_d, args.dilation_h, args.dilation_w) if three else (args.dilation_h, args.dilation_w)
    opad = (args.trans_output_pad_d, args.trans_output_pad_h, args.trans_output_pad_w) if three else (
        args.trans_output_pad_h, args.trans_output_pad_w)
    n, c, k, g_ = args.batchsize, args.in_channels, args.out_channels, args.group_count
    if g_ > 1 and (c % g_ or k % g_):
        raise UsageError(f"-g {g_}: the groups must divide -c {c} and -k {k}")
    if any(o >= max(s, d) for o, s, d in zip(opad, stride, dil, strict=True)):
        raise UsageError(f"output padding {list(opad)} must be below the stride {list(stride)} or the dilation {list(dil)}")
    out = tuple((i - 1) * s - 2 * p + d * (f - 1) + 1 + o
                for i, s, p, d, f, o in zip(spatial, stride, pad, dil, filt, opad, strict=True))
    if any(o < 1 for o in out):
        raise UsageError(f"the output would be empty: {list(out)}")
    rank = len(spatial) + 2
    lin, lfil, lout = (_layout(args.in_layout, rank, "--in_layout"), _layout(args.fil_layout, rank, "--fil_layout"),
                       _layout(args.out_layout, rank, "--out_layout"))
    x_dims, w_dims, y_dims = [n, c, *spatial], [c, k // g_, *filt], [n, k, *out]
    bias, act = bool(args.bias), args.activation
    names = "dhw"[3 - len(spatial):]
    sp = "".join(f"{a}{v}" for a, v in zip(names, spatial, strict=True))
    fl = "x".join(map(str, filt))
    epi = ("_bias" if bias else "") + ("" if act == "none" else f"_{act}")
    name = f"conv{len(spatial)}d_trans_n{n}c{c}{sp}_k{k}f{fl}_p{'x'.join(map(str, pad))}_s{'x'.join(map(str, stride))}"
    name += f"{'' if g_ == 1 else f'_g{g_}'}{epi}_{lin if lin == lout else lin + '-' + lout}_{dtn}"
    g = _new_graph(name, dt)
    x, w = g.tensor("x", x_dims, strides_for(x_dims, lin)), g.tensor("w", w_dims, strides_for(w_dims, lfil))
    y = g.conv_dgrad(x, w, padding=list(pad), stride=list(stride), dilation=list(dil), name="trans")
    y.set_dim(y_dims)
    if bias or act != "none":
        y.set_stride(list(strides_for(y_dims, lout)))
    if bias:
        y = g.bias(y, g.tensor("b", [1, k] + [1] * len(spatial)), name="bias")
    y = _activate(g, y, act)
    y.set_name("y").set_output(True).set_stride(list(strides_for(y_dims, lout)))
    g.validate()
    flops = 2.0 * n * c * math.prod(spatial) * (k // g_) * math.prod(filt)
    f = torch_activation(act)

    def eager(t: dict[str, Any]) -> Any:
        import torch.nn.functional as F

        conv_t = F.conv_transpose2d if len(spatial) == 2 else F.conv_transpose3d
        b = t["b"].reshape(-1) if bias else None
        return f(conv_t(t["x"], t["w"], b, list(stride), list(pad), list(opad), g_, list(dil)))

    case = Case(name, "conv", command, g, dt, flops, _io_bytes(g), eager=eager)
    case.onnx = lambda: _onnx().conv_transpose_model(x_dims, w_dims, y_dims, pad, stride, dil, opad, g_, dt, bias, act)
    return case


def _conv_eager(s: ConvShape, direction: str, bias: bool, act: str) -> TorchFn:
    f = torch_activation(act)
    nd = len(s.spatial)
    pad, stride, dil, groups = list(s.pad), list(s.stride), list(s.dilation), s.groups
    holder: dict[str, Any] = {}

    def fwd(t: dict[str, Any]) -> Any:
        import torch.nn.functional as F

        conv = F.conv2d if nd == 2 else F.conv3d
        b = t["b"].reshape(-1) if bias else None
        return f(conv(t["x"], t["w"], b, stride, pad, dil, groups))

    def backward(t: dict[str, Any]) -> Any:
        import torch

        aten = torch.ops.aten
        if direction == "bwd":  # the operand convolution_backward needs only for its shape
            x = holder.get("x")
            if x is None:
                x = holder["x"] = torch.empty_like(t["dy"]).new_empty(s.x_dims)
            return aten.convolution_backward(t["dy"], x, t["w"], None, stride, pad, dil, False, [0] * nd, groups,
                                             [True, False, False])[0]
        w = holder.get("w")
        if w is None:
            w = holder["w"] = t["x"].new_empty(s.w_dims)
        return aten.convolution_backward(t["dy"], t["x"], w, None, stride, pad, dil, False, [0] * nd, groups,
                                         [False, True, False])[1]

    return fwd if direction == "fwd" else backward


def _onnx() -> Any:
    from fusegraph.bench import onnx_models

    return onnx_models


# ---- matmul --------------------------------------------------------------------------------------
def _matmul(args: argparse.Namespace, command: str) -> Case:
    dt = DTYPES[args.dtype]
    b, m, n, k = args.batch, args.m, args.n, args.k
    ta, tb = args.trans_a in ("T", "1"), args.trans_b in ("T", "1")
    epi = ("_bias" if args.bias else "") + ("" if args.activation == "none" else f"_{args.activation}")
    name = f"matmul_b{b}_m{m}n{n}k{k}{'_tA' if ta else ''}{'_tB' if tb else ''}{epi}_{args.dtype}"
    g = _new_graph(name, dt)
    lead = [b] if b > 1 else []

    def operand(tname: str, rows: int, cols: int, transposed: bool) -> Any:
        dims = [*lead, rows, cols]
        if not transposed:
            return g.tensor(tname, dims)
        strides = [rows * cols] * len(lead) + [1, rows]  # stored [.., cols, rows]
        return g.tensor(tname, dims, strides)

    a_t, b_t = operand("a", m, k, ta), operand("b", k, n, tb)
    y = g.matmul(a_t, b_t, name="mm")
    if args.bias:
        y = g.bias(y, g.tensor("bias", [*([1] * len(lead)), 1, n]), name="bias")
    y = _activate(g, y, args.activation)
    y.set_name("y").set_output(True)
    g.validate()
    f = torch_activation(args.activation)
    has_bias = bool(args.bias)

    def eager(t: dict[str, Any]) -> Any:
        import torch

        out = torch.matmul(t["a"], t["b"])
        return f(out + t["bias"] if has_bias else out)

    case = Case(name, "matmul", command, g, dt, 2.0 * b * m * n * k, _io_bytes(g), eager=eager, tune=args.tune)
    case.onnx = lambda: _onnx().matmul_model(g, has_bias, args.activation)
    return case


# ---- norms and softmax ---------------------------------------------------------------------------
def _norm(args: argparse.Namespace, command: str) -> Case:
    dt = DTYPES[args.dtype]
    dims = args.input
    axis = len(dims) - 1 if args.normalized_dim is None else args.normalized_dim
    if not 0 < axis < len(dims):
        raise UsageError(f"-o/--normalized_dim {args.normalized_dim}: expected 1..{len(dims) - 1} for input "
                         f"{'x'.join(map(str, dims))} (the leading axes are the rows)")
    rows, cols = math.prod(dims[:axis]), math.prod(dims[axis:])
    kind = args.family
    act = args.activation
    name = f"{kind}_{'x'.join(map(str, dims))}_o{axis}{'' if act == 'none' else '_' + act}_{args.dtype}"
    g = _new_graph(name, dt)
    x, scale = g.tensor("x", [rows, cols]), g.tensor("scale", [1, cols])
    if kind == "layernorm":
        y, _, _ = g.layernorm(x, scale, g.tensor("bias", [1, cols]), args.eps, name="norm")
    else:
        y, _ = g.rmsnorm(x, scale, args.eps, name="norm")
    y = _activate(g, y, act)
    y.set_name("y").set_output(True)
    g.validate()
    f = torch_activation(act)
    eps = args.eps

    def eager(t: dict[str, Any]) -> Any:
        import torch.nn.functional as F

        if kind == "layernorm":
            return f(F.layer_norm(t["x"], (cols,), t["scale"].reshape(-1), t["bias"].reshape(-1), eps))
        return f(F.rms_norm(t["x"], (cols,), t["scale"].reshape(-1), eps))

    case = Case(name, kind, command, g, dt, 0.0, _io_bytes(g), eager=eager, tune=args.tune)
    case.notes.append(f"the input is seen as [{rows}, {cols}]: rows = the axes before -o {axis}")
    case.onnx = lambda: _onnx().norm_model(kind, rows, cols, dt, eps, act)
    return case


def _softmax(args: argparse.Namespace, command: str) -> Case:
    dt = DTYPES[args.dtype]
    log = args.algorithm == 2
    if args.input is not None:
        dims = list(args.input)
        axis = args.axis if args.axis >= 0 else len(dims) + args.axis
        if not 0 <= axis < len(dims):
            raise UsageError(f"--axis {args.axis}: out of range for input {'x'.join(map(str, dims))}")
        where = f"axis{axis}"
    elif args.mode == 0:  # instance: over C*H*W of each image
        dims, axis, where = [args.batchsize, args.in_channels * args.in_h * args.in_w], 1, "instance"
    else:  # channel: over C at each (n, h, w)
        dims, axis, where = [args.batchsize, args.in_channels, args.in_h, args.in_w], 1, "channel"
    name = f"{'log' if log else ''}softmax_{'x'.join(map(str, dims))}_{where}_{args.dtype}"
    g = _new_graph(name, dt)
    g.softmax(g.tensor("x", dims), axis, log=log, name="softmax").set_name("y").set_output(True)
    g.validate()

    def eager(t: dict[str, Any]) -> Any:
        import torch

        return (torch.log_softmax if log else torch.softmax)(t["x"], axis)

    case = Case(name, "softmax", command, g, dt, 0.0, _io_bytes(g), eager=eager, tune=args.tune)
    case.onnx = lambda: _onnx().softmax_model(dims, axis, log, dt)
    return case


# ---- attention -----------------------------------------------------------------------------------
def _sdpa(args: argparse.Namespace, command: str) -> Case:
    dt = DTYPES[args.dtype]
    b, h, d = args.batch, args.heads, args.head_dim
    hk = args.heads_kv or h
    sq, skv = args.seq_q, args.seq_kv or args.seq_q
    if h % hk:
        raise UsageError(f"--heads_kv {hk}: must divide --heads {h}")
    tag = f"b{b}h{h}{'' if hk == h else f'kv{hk}'}s{sq}{'' if skv == sq else f'kv{skv}'}d{d}"
    mask_kind = args.mask
    name = f"sdpa_{'causal' if args.causal else 'full'}_{tag}{'' if mask_kind == 'none' else '_' + mask_kind + 'mask'}_{args.dtype}"
    g = _new_graph(name, dt)
    q = g.tensor("q", [b, h, sq, d])
    k, v = g.tensor("k", [b, hk, skv, d]), g.tensor("v", [b, hk, skv, d])
    mask = None
    if mask_kind == "bool":
        mask = g.tensor("mask", [1, 1, sq, skv], data_type=DataType.BOOLEAN)
    elif mask_kind == "additive":
        mask = g.tensor("mask", [1, 1, sq, skv])
    g.sdpa(q, k, v, attn_scale=args.scale, causal=args.causal, mask=mask, name="sdpa").set_name("o").set_output(True)
    g.validate()
    causal, scale, gqa = bool(args.causal), args.scale, hk != h

    def eager(t: dict[str, Any]) -> Any:
        import torch.nn.functional as F

        kw: dict[str, Any] = {"is_causal": causal, "scale": scale}
        if gqa:
            kw["enable_gqa"] = True
        return F.scaled_dot_product_attention(t["q"], t["k"], t["v"], attn_mask=t.get("mask"), **kw)

    frac = 0.5 if causal and sq == skv else 1.0
    case = Case(name, "sdpa", command, g, dt, 4.0 * b * h * sq * skv * d * frac, _io_bytes(g), eager=eager, tune=args.tune)
    if gqa:
        case.no_onnx = "the ONNX form of attention here has no grouped key/value heads"
    else:
        case.onnx = lambda: _onnx().sdpa_model(g, causal, scale, mask_kind)
    return case


# ---- a serialized graph --------------------------------------------------------------------------
def _graph_file(args: argparse.Namespace, command: str) -> Case:
    path = Path(args.file)
    if not path.is_file():
        raise UsageError(f"graph {args.file!r}: no such file")
    try:
        g = fg.Graph.from_json(path.read_text(encoding="utf-8"))
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"graph {args.file!r}: not a serialized fusegraph graph ({type(exc).__name__}: {exc})") from None
    g.validate()
    dts = [t.dtype for t in g.outputs()]
    case = Case(g.name or path.stem, "graph", command, g, dts[0] if dts else DataType.FLOAT, 0.0, _io_bytes(g), tune=args.tune)
    case.no_eager = "a serialized graph has no PyTorch form here (time --engine torch instead)"
    case.no_onnx = "a serialized graph has no ONNX form here"
    return case
