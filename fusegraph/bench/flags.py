"""Driver command lines: one parser per family, with MIOpenDriver's flags and meanings.

A conv line copied from MIOpen's documentation (``MIOpenDriver conv -n 32 -c 64 -H 56 -W 56
-k 64 -y 3 -x 3 -p 1 -q 1 -u 1 -v 1 -F 1 -t 1``) parses unchanged: the program name is
dropped, ``conv`` / ``convfp16`` / ``convbfp16`` pick the data type as MIOpen's do, every
flag keeps its short and long spelling and its default. Flags that ask for something the
driver cannot do (data files, transposed convolution, casts) are refused by name rather than
ignored; flags that only steer MIOpen's own machinery (``-w``, ``-P``, ``-S``, ``-G``...)
are accepted and have no effect.

The options every family shares (``--engine``, ``--compare``, ``--device``...) sit on the
``bench`` parser and again on each family's, there with no default, so that a value given
before or after the family name counts, and, in a ``--from-file`` run, the outer command
line's values are every line's defaults.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Sequence
from typing import Any, NoReturn

from fusegraph.dtypes import DataType

DTYPES: dict[str, DataType] = {
    "f32": DataType.FLOAT, "fp32": DataType.FLOAT, "float": DataType.FLOAT,
    "f16": DataType.HALF, "fp16": DataType.HALF, "half": DataType.HALF,
    "bf16": DataType.BFLOAT16, "bfp16": DataType.BFLOAT16, "bfloat16": DataType.BFLOAT16,
}
ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "tanh", "sigmoid", "silu", "elu", "leaky_relu")
BASELINES = ("eager", "compile", "cudnn", "ort")
# The family names a line may start with; MIOpen's conv drivers name the data type.
CONV_ALIASES = {"conv": None, "convfp16": "f16", "convbfp16": "bf16"}
FAMILIES = ("conv", "convfp16", "convbfp16", "matmul", "gemm", "layernorm", "rmsnorm", "softmax", "sdpa", "graph")


class UsageError(ValueError):
    """A driver line that cannot be acted on as written (exit status 2)."""


class Parser(argparse.ArgumentParser):
    """Raises UsageError instead of exiting, so a ``--from-file`` run can name the line and
    go on to the next."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _int01(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _dims(text: str) -> tuple[int, ...]:
    """MIOpen's tensor flags: ``100x3x32x32`` (commas accepted too)."""
    try:
        dims = tuple(int(p) for p in text.replace(",", "x").split("x") if p)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected dims like 32x128x768, got {text!r}") from None
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"expected positive dims like 32x128x768, got {text!r}")
    return dims


def _positive(text: str) -> int:
    v = _int01(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return v


def _nonneg(text: str) -> int:
    v = _int01(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def _dtype(text: str) -> str:
    if text.lower() not in DTYPES:
        raise argparse.ArgumentTypeError(f"expected one of f32, f16, bf16, got {text!r}")
    return text.lower()


def _compare(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [n for n in names if n not in BASELINES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown baseline {bad[0]!r} (known: {', '.join(BASELINES)})")
    return names


def add_common(p: argparse.ArgumentParser, *, suppress: bool) -> None:
    """The options of every family; ``suppress``: no defaults (a family's parser)."""

    def d(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    g = p.add_argument_group("what to time and how")
    g.add_argument("--engine", default=d("auto"),
                   help="auto: the engine fusegraph picks; NAME[,NAME]: those engines; all: every engine "
                        "that supports the graph, with each refusal's reason (default auto)")
    g.add_argument("--compare", type=_compare, default=d(()), metavar="eager,compile,cudnn,ort",
                   help="baselines timed beside fusegraph, interleaved: PyTorch eager, torch.compile, "
                        "cuDNN's frontend called directly, ONNX Runtime (each where available)")
    g.add_argument("--tune", action="store_true", default=d(False),
                   help="run the autotuner first and report the untuned and the tuned pick")
    g.add_argument("--tune-budget", type=float, default=d(30.0), metavar="S", help="autotuning budget (default 30 s)")
    g.add_argument("-V", "--verify", type=_int01, nargs="?", const=1, default=d(0), metavar="0|1",
                   help="check every result against the float64 reference on the same inputs "
                        "(MIOpen's -V; off by default here: the reference is slow on big shapes)")
    g.add_argument("--device", default=d("cpu"), help="cpu (default) or cuda:N")
    g.add_argument("-i", "--iter", type=_positive, default=d(10), metavar="N",
                   help="timed rounds per contender (MIOpen's iterations; default 10)")
    g.add_argument("--budget", type=float, default=d(None), metavar="S",
                   help="keep timing rounds until this many seconds per case (default: just --iter rounds)")
    g.add_argument("--warmup", type=float, default=d(1.0), metavar="S",
                   help="most seconds one contender may warm up before it is timed (default 1)")
    g.add_argument("--seed", type=_nonneg, default=d(0), help="seed of the random inputs (default 0)")
    g.add_argument("-t", "--time", type=_int01, default=d(1), metavar="0|1", help="accepted for MIOpen's sake; always timed")
    g.add_argument("-w", "--wall", type=_int01, default=d(0), metavar="0|1|2", help="accepted for MIOpen's sake (no effect)")
    o = p.add_argument_group("output")
    o.add_argument("--csv", default=d(None), metavar="FILE", help="one row per case and contender")
    o.add_argument("--json", default=d(None), metavar="FILE", help="everything, with the environment")
    o.add_argument("--plot", default=d(None), metavar="FILE.png", help="a chart of the ratios to the fastest baseline (matplotlib)")
    o.add_argument("--dump", default=d(None), metavar="DIR",
                   help="keep each case's graph, compiled artifacts and reproducers under DIR")


def _conv(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("-F", "--forw", type=_int01, default=0,
      help="0 fwd+bwd+wrw (default), 1 fwd, 2 bwd data, 4 bwd weight, 3 fwd+bwd, 5 fwd+wrw, 6 bwd+wrw")
    a("-n", "--batchsize", type=_positive, default=100, help="mini-batch size (default 100)")
    a("-c", "--in_channels", type=_positive, default=3, help="input channels (default 3)")
    a("-H", "--in_h", type=_positive, default=32, help="input height (default 32)")
    a("-W", "--in_w", type=_positive, default=32, help="input width (default 32)")
    a("-!", "--in_d", type=_positive, default=32, help="input depth, with --spatial_dim 3 (default 32)")
    a("-k", "--out_channels", type=_positive, default=32, help="output channels (default 32)")
    a("-y", "--fil_h", type=_positive, default=3, help="filter height (default 3)")
    a("-x", "--fil_w", type=_positive, default=3, help="filter width (default 3)")
    a("-@", "--fil_d", type=_positive, default=3, help="filter depth (default 3)")
    a("-p", "--pad_h", type=_nonneg, default=0, help="zero padding of the height (default 0)")
    a("-q", "--pad_w", type=_nonneg, default=0, help="zero padding of the width (default 0)")
    a("-$", "--pad_d", type=_nonneg, default=0, help="zero padding of the depth (default 0)")
    a("-u", "--conv_stride_h", type=_positive, default=1, help="stride of the height (default 1)")
    a("-v", "--conv_stride_w", type=_positive, default=1, help="stride of the width (default 1)")
    a("-#", "--conv_stride_d", type=_positive, default=1, help="stride of the depth (default 1)")
    a("-l", "--dilation_h", type=_positive, default=1, help="filter dilation of the height (default 1)")
    a("-j", "--dilation_w", type=_positive, default=1, help="filter dilation of the width (default 1)")
    a("-^", "--dilation_d", type=_positive, default=1, help="filter dilation of the depth (default 1)")
    a("-g", "--group_count", type=_positive, default=1, help="groups (default 1)")
    a("-_", "--spatial_dim", type=int, choices=(2, 3), default=2, help="2 (default) or 3 spatial dims")
    a("-I", "--in_layout", default="", help="NCHW (default) or NHWC; NCDHW / NDHWC in 3-D")
    a("-O", "--out_layout", default="", help="NCHW (default) or NHWC; NCDHW / NDHWC in 3-D")
    a("-f", "--fil_layout", default="", help="NCHW (default) or NHWC (i.e. KYXC); NCDHW / NDHWC in 3-D")
    a("-m", "--mode", default="conv", choices=("conv", "trans"),
      help="conv (default) or trans: a transposed convolution (-F 1), the filter [C, K/g, ...]")
    a("-z", "--pad_mode", default="default", choices=("default", "same", "valid"), help="MIOpen's padding modes")
    a("-r", "--pad_val", type=int, default=0, help="padding value (only 0)")
    a("-b", "--bias", type=_int01, nargs="?", const=1, default=0, metavar="0|1", help="add a per-channel bias (fused epilogue)")
    a("--activation", default="none", choices=ACTIVATIONS, help="a fused activation after the (biased) convolution")
    a("--dtype", type=_dtype, default=None, help="f32 (default for conv), f16, bf16")
    a("-s", "--search", type=_int01, default=0, metavar="0|1", help="MIOpen's search: 1 = --tune")
    for short, long in (("-d", "--in_data"), ("-e", "--weights"), ("-D", "--dout_data"), ("-a", "--in_bias")):
        a(short, long, default="", help="refused: inputs are random (--seed)")
    for short, long in (("-U", "--in_cast_type"), ("-T", "--out_cast_type"), ("-R", "--wei_cast_type")):
        a(short, long, default="-1", help="refused unless -1: no cast types")
    for short, long in (("-Y", "--trans_output_pad_h"), ("-X", "--trans_output_pad_w"), ("-%", "--trans_output_pad_d")):
        a(short, long, type=_nonneg, default=0, help="-m trans: output padding (default 0)")
    for short, long, dflt in (("-Z", "--tensor_vect", 0), ("-L", "--vector_length", 1)):
        a(short, long, type=int, default=dflt, help="accepted at its default only")
    for short, long, text in (("-P", "--printconv", "1"), ("-o", "--dump_output", "0"), ("-S", "--solution", "-1"),
                              ("-G", "--gpualloc", "0"), ("-C", "--verification_cache", "")):
        a(short, long, default=text, help="accepted for MIOpen's sake (no effect)")


def _matmul(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("-m", "-M", "--m", dest="m", type=_positive, default=1024, help="rows of A and C (default 1024)")
    a("-n", "-N", "--n", dest="n", type=_positive, default=1024, help="columns of B and C (default 1024)")
    a("-k", "-K", "--k", dest="k", type=_positive, default=1024, help="the reduced dim (default 1024)")
    a("--batch", "--batch_count", dest="batch", type=_positive, default=1, help="batch count (default 1)")
    a("--transA", "--transa", dest="trans_a", default="N", type=str.upper, choices=("N", "T", "0", "1"),
      help="A stored transposed (T or 1)")
    a("--transB", "--transb", dest="trans_b", default="N", type=str.upper, choices=("N", "T", "0", "1"),
      help="B stored transposed (T or 1)")
    a("--bias", type=_int01, nargs="?", const=1, default=0, metavar="0|1", help="add a bias row (fused epilogue)")
    a("--activation", default="none", choices=ACTIVATIONS, help="a fused activation")
    a("--dtype", type=_dtype, default="f32", help="f32 (default), f16, bf16")


def _norm(p: argparse.ArgumentParser, what: str) -> None:
    a = p.add_argument
    a("-X", "--input", type=_dims, default=(100, 3, 32, 32), help="input dims, e.g. 32x128x768 (default 100x3x32x32)")
    a("-o", "--normalized_dim", type=int, default=None,
      help="the first normalized axis: dims from it on are normalized together (default: the last axis)")
    a("-e", "--eps", type=float, default=1e-5, help="epsilon (default 1e-5)")
    a("-m", "--mode", type=int, default=0, choices=(0, 1), help=f"MIOpen's {what} mode (both have scale and bias here)")
    a("-F", "--forw", type=int, default=1, choices=(1,), help="forward only (1)")
    a("--activation", default="none", choices=ACTIVATIONS, help="a fused activation after the norm")
    a("--dtype", type=_dtype, default="f32", help="f32 (default), f16, bf16")


def _softmax(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("-n", "--batchsize", type=_positive, default=100, help="MIOpen's N (default 100)")
    a("-c", "--in_channels", type=_positive, default=3, help="MIOpen's C (default 3)")
    a("-H", "--in_h", type=_positive, default=32, help="MIOpen's H (default 32)")
    a("-W", "--in_w", type=_positive, default=32, help="MIOpen's W (default 32)")
    a("-m", "--mode", type=int, default=1, choices=(0, 1),
      help="0: over C*H*W per N (instance), 1: over C at each N, H, W (channel; MIOpen's default)")
    a("-a", "--algorithm", type=int, default=1, choices=(0, 1, 2), help="0 fast, 1 accurate (same here), 2 log-softmax")
    a("-F", "--forw", type=int, default=1, choices=(1,), help="forward only (1)")
    a("-X", "--input", type=_dims, default=None, help="instead of -n -c -H -W: any dims, softmax over --axis")
    a("--axis", type=int, default=-1, help="with --input: the softmax axis (default -1)")
    a("--dtype", type=_dtype, default="f32", help="f32 (default), f16, bf16")


def _sdpa(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("-b", "--batch", type=_positive, default=1, help="batch (default 1)")
    a("--heads", "--heads_q", dest="heads", type=_positive, default=16, help="query heads (default 16)")
    a("--heads_kv", "--kv-heads", dest="heads_kv", type=_positive, default=None,
      help="key/value heads, dividing the query heads (GQA; default: as many as the query)")
    a("-s", "--seq_q", "--seq", dest="seq_q", type=_positive, default=1024, help="query sequence length (default 1024)")
    a("--seq_kv", dest="seq_kv", type=_positive, default=None, help="key/value sequence length (default: --seq_q)")
    a("-d", "--head_dim", type=_positive, default=128, help="head dim (default 128)")
    a("--causal", action="store_true", help="causal (upper-left aligned)")
    a("--mask", default="none", choices=("none", "bool", "additive"), help="an explicit [1,1,Sq,Skv] mask input")
    a("--scale", type=float, default=None, help="attention scale (default 1/sqrt(head_dim))")
    a("--dtype", type=_dtype, default="f16", help="f16 (default), bf16, f32")


def _graph(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a serialized fusegraph graph (Graph.to_json)")


def build(p: argparse.ArgumentParser) -> None:
    """Fills the ``bench`` parser: its common options, ``--from-file``, the families."""
    add_common(p, suppress=False)
    p.add_argument("--from-file", default=None, metavar="FILE",
                   help="one driver command line per line (a MIOpenDriver or `fusegraph bench` line), run in one "
                        "process; options given here are every line's defaults")
    sub = p.add_subparsers(dest="family", metavar="FAMILY")
    helps = {
        "conv": "convolution forward / backward data / backward weight (MIOpenDriver's conv flags)",
        "convfp16": "conv in f16 (MIOpenDriver's name)", "convbfp16": "conv in bf16 (MIOpenDriver's name)",
        "matmul": "batched matmul with bias and activation", "gemm": "the same as matmul",
        "layernorm": "layer norm (MIOpenDriver's layernorm flags)", "rmsnorm": "RMS norm (same flags)",
        "softmax": "softmax / log-softmax (MIOpenDriver's softmax flags)",
        "sdpa": "scaled dot-product attention (GQA, causal, masks)", "graph": "any serialized fusegraph graph",
    }
    for name in FAMILIES:
        f = sub.add_parser(name, help=helps[name], description=helps[name])
        if name in CONV_ALIASES:
            _conv(f)
        elif name in ("matmul", "gemm"):
            _matmul(f)
        elif name in ("layernorm", "rmsnorm"):
            _norm(f, name)
        elif name == "softmax":
            _softmax(f)
        elif name == "sdpa":
            _sdpa(f)
        else:
            _graph(f)
        add_common(f, suppress=True)


def line_parser() -> Parser:
    """A standalone parser for ``--from-file`` lines (and tests): errors raise UsageError."""
    p = Parser(prog="fusegraph bench", add_help=False)
    build(p)
    return p


def split_line(line: str) -> list[str] | None:
    """A file line's arguments: None for blank lines and ``#`` comments; a leading program
    name (``MIOpenDriver``, ``./bin/MIOpenDriver``, ``fusegraph bench``) is dropped. A comment
    is a word that starts with ``#`` and the rest of the line (``-#``, MIOpen's depth
    stride, is a flag)."""
    line = re.sub(r"(^|\s)#.*$", "", line)
    try:
        tokens = shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"cannot split the line: {exc}") from None
    if not tokens:
        return None
    if tokens[0].rsplit("/", 1)[-1].lower().startswith("miopendriver"):
        tokens = tokens[1:]
    elif tokens[:2] == ["fusegraph", "bench"]:
        tokens = tokens[2:]
    return tokens or None


def parse_line(tokens: Sequence[str], defaults: argparse.Namespace | None = None) -> argparse.Namespace:
    """One line's options over ``defaults`` (the outer command line's common options)."""
    ns = argparse.Namespace(**vars(defaults)) if defaults is not None else argparse.Namespace()
    for k in ("family", "from_file"):
        if hasattr(ns, k):
            delattr(ns, k)
    args = line_parser().parse_args(list(tokens), namespace=ns)
    if getattr(args, "family", None) is None:
        raise UsageError("fusegraph bench: a line must name a family (conv, matmul, layernorm, rmsnorm, softmax, sdpa, graph)")
    if getattr(args, "from_file", None):
        raise UsageError("fusegraph bench: --from-file inside a --from-file line")
    return args
