"""What each GPU engine claims, for the graph fuzzer (tests/test_fuzz_graphs.py).

Drawn from the whole op table, 98% of graphs are refused by the cudnn and triton engines,
so a long run mostly tests refusals. A profile narrows the drawing to the io types, op
families and memory layouts an engine claims -- and still draws, at rate ``odd``, a layout
or op mix it must refuse cleanly, so that the refusals stay tested too. A profile only
shapes what is drawn: every graph is compared with the float64 reference as before, and a
refusal is counted, never passed off as a run.

The layouts are written here from the engines' documented claims, not imported from the
engines' own rules, so that a rule that is wrong shows up as a mismatch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fusegraph.dtypes import DataType

# Memory orders (outermost first) by name, as functions of the rank.
ORDERS: dict[str, Callable[[int], tuple[int, ...]]] = {
    "row-major": lambda r: tuple(range(r)),
    "channels-last": lambda r: (0, *range(2, r), 1) if r >= 3 else tuple(range(r)),
    "transposed": lambda r: (*range(r - 2), r - 1, r - 2) if r >= 2 else tuple(range(r)),
    "heads-interleaved": lambda r: (0, 2, 1, 3) if r == 4 else tuple(range(r)),
}

# The op families of Fuzz.step (the op_* methods), by what they make.
MAIN_KINDS = frozenset({"matmul", "conv", "dgrad", "wgrad", "sdpa"})
FLOATS = (DataType.FLOAT, DataType.HALF, DataType.BFLOAT16)


@dataclass(frozen=True)
class Profile:
    """One engine's claims: see the module docstring."""

    name: str
    io_types: tuple[DataType, ...]
    kinds: tuple[str, ...]
    # role of an input ("any", "image", "matmul", "sdpa") -> the layouts drawn for it
    layouts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    odd: int = 10  # one layout draw in ``odd`` is one the engine need not claim
    odd_kinds: int = 40  # one step in ``odd_kinds`` draws from the whole op table
    one_main: bool = False  # at most one of ``main_kinds`` per graph
    main_kinds: frozenset[str] = MAIN_KINDS
    trailing_rows: bool = False  # reductions over trailing dims, softmax over the last axis
    broadcast_one_in: int = 6  # one input in this many is a broadcast (stride-0 or size-1) view
    first: tuple[str, ...] = ()  # the op families of the first step, where they must come first
    full_norm_params: bool = False  # norm scales and biases one value per normalized element
    live_only: bool = False  # every computed value that no node reads is read out (no dead branch)
    chain: bool = False  # each op reads the last result (one chain: no forks, no side branches)
    one_family: bool = False  # one image layout (NCHW-ordered or channels-last) per graph

    def orders(self, role: str, rank: int) -> list[tuple[int, ...]]:
        names = self.layouts.get(role) or self.layouts.get("any") or ("row-major",)
        out: list[tuple[int, ...]] = []
        for n in names:
            o = ORDERS[n](rank)
            if o not in out:
                out.append(o)
        return out


PROFILES: dict[str, Profile] = {
    # cuDNN graphs: one main op (conv fprop/dgrad/wgrad, matmul or sdpa) with pointwise
    # prologues and epilogues, or norms, in NCHW or NHWC (matmul operands also transposed,
    # attention's tensors also [b, s, h, d]).
    "cudnn": Profile(
        "cudnn",
        io_types=FLOATS,
        kinds=("unary", "unary", "binary", "binary", "matmul", "conv", "conv", "dgrad", "wgrad",
               "batchnorm_inference", "batchnorm", "layernorm", "rmsnorm", "sdpa", "sdpa",
               "compare_select", "backward", "discrete", "reduction"),
        layouts={"any": ("row-major", "channels-last"), "image": ("row-major", "channels-last"),
                 "matmul": ("row-major", "transposed"), "sdpa": ("row-major", "heads-interleaved")},
        one_main=True,
        main_kinds=MAIN_KINDS | {"layernorm", "rmsnorm", "batchnorm"},
        broadcast_one_in=12,
        full_norm_params=True,
        live_only=True,
        chain=True,
        one_family=True,
        first=("matmul", "conv", "conv", "dgrad", "wgrad", "sdpa", "layernorm", "rmsnorm", "batchnorm"),
    ),
    # The torch engine with fp32_matmul=bf16x3 (test_fuzz_graphs.VARIANTS): float32 graphs
    # that start with a matmul (2-D, broadcast weight or batched; operands also transposed),
    # with pointwise neighbours and reductions, and more matmuls after.
    "bf16x3": Profile(
        "bf16x3",
        io_types=(DataType.FLOAT,),
        kinds=("unary", "binary", "binary", "matmul", "matmul", "reduction"),
        layouts={"any": ("row-major",), "matmul": ("row-major", "transposed")},
        first=("matmul",),
    ),
    # The torch engine as a GPU region unit's provisional pieces run it (test_fuzz_graphs.VARIANTS
    # "untimed"): graphs that start with a convolution (grouped and depthwise among them) in
    # either image layout, with pointwise neighbours and reductions.
    "untimed": Profile(
        "untimed",
        io_types=FLOATS,
        kinds=("unary", "binary", "binary", "conv", "conv", "reduction"),
        layouts={"any": ("row-major", "channels-last"), "image": ("row-major", "channels-last")},
        first=("conv",),
    ),
    # Triton row kernels: softmax, norms and reductions over trailing dims with their
    # pointwise neighbours, on row-major tensors.
    "triton": Profile(
        "triton",
        io_types=FLOATS,
        kinds=("unary", "binary", "binary", "reduction", "softmax", "softmax", "layernorm", "layernorm",
               "rmsnorm", "rmsnorm", "compare_select", "backward", "discrete"),
        layouts={"any": ("row-major",)},
        trailing_rows=True,
        one_main=True,  # one row op: several must share one frame to be one kernel
        main_kinds=frozenset({"reduction", "softmax", "layernorm", "rmsnorm"}),
        broadcast_one_in=12,
        first=("reduction", "softmax", "layernorm", "rmsnorm"),
    ),
}
