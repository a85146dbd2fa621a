"""oneDNN Graph for the torch engine on the CPU: the whole plan traced into TorchScript with
its weights frozen in, then partitioned, fused and compiled by oneDNN's graph compiler
(PyTorch's LLGA bridge, ``torch.jit.enable_onednn_fusion``).

Why: in eager mode every oneDNN call pays ~20 us of framework overhead and reads and writes
plain NHWC tensors; a compiled oneDNN Graph partition keeps activations in its own blocked
layouts, fuses conv + bias + add + ReLU chains and pooling, and runs from C++. Hand-built
ResNet-50 in an ad-hoc script, batch 1, f32, 2 cores: eager fused + prepacked 23.0 ms,
oneDNN Graph 19.3 ms; through the ONNX provider, benchmarks/bench_onnx.py: docs/onnx.md.

The bridge is old TorchScript machinery with gaps, so nothing is trusted blindly: a 2-D
matmul is written as ``F.linear`` with a bias (a matmul followed by any elementwise op
crashes the bridge in torch 2.13), a conv as ``F.conv2d`` with its bias and epilogue (the
pattern the bridge fuses best: ResNet-50 20.2 -> 19.5 ms against a separate bias add),
lowerings write no tensor in place (a copy into a view
after a pooling segfaulted it), every graph is first traced and run in a separate process
(``probe``: a crash there costs that process, not the caller's; the verdict is kept in the
cache directory per graph, torch and fusegraph version), the traced plan is checked against
the eager plan on the first call's inputs, and any failure leaves the plan on its eager
path, logged, for good.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fusegraph.engines.torch import steps as torch_fusion
from fusegraph.engines.torch.steps import (
    ChannelShuffle,
    FusedConv,
    FusedLinear,
    ScaleShift,
    TracedStep,
    Unary,
    as_declared,
    conv_args,
    conv_padding,
)
from fusegraph.graph.graph import Graph
from fusegraph.graph.node import Node
from fusegraph.graph.tensor import TensorAttr

log = logging.getLogger("fusegraph.engines.torch")

Tensor = Any
Step = Callable[[dict[str, Tensor]], None]

# The knob's default: off since issue 14 -- the bridge rests on torch.jit.trace (deprecated in
# PyTorch 2.13) and refuses most graphs nobody tuned for; the default CPU path is frozen.py's
# (AOTInductor / Inductor), this one opt-in (tried first where the knob is True).
ONEDNN_GRAPH_DEFAULT = False


def available() -> bool:
    """Whether this torch has the LLGA bridge (CPU builds with oneDNN)."""
    if not torch_fusion.available():
        return False
    import torch

    return hasattr(torch.jit, "enable_onednn_fusion")


_SWITCH = threading.Lock()  # one plan at a time flips the bridge's process-wide switch


@contextlib.contextmanager
def _fusion_on() -> Iterator[None]:
    """The bridge's global switch, on only while this plan is traced and first run (the
    fused plan stays with the frozen function after the switch goes back); plans built on
    several threads take turns, so none sees another's switch go back mid-trace."""
    import torch

    with _SWITCH:
        before = bool(torch._C._jit_llga_enabled())
        torch.jit.enable_onednn_fusion(True)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # TorchScript's deprecation notices
                yield
        finally:
            torch.jit.enable_onednn_fusion(before)


def _linear_step(fl: FusedLinear) -> Step:
    """matmul (+ bias) (+ activation) as F.linear with a bias, the form the bridge runs."""
    import torch
    import torch.nn.functional as F

    a_name, b_name = fl.matmul.inputs["a"].name, fl.matmul.inputs["b"].name
    bias_name = fl.bias.name if fl.bias is not None else None
    n = fl.matmul.inputs["b"].shape[1]
    unary = fl.unary or Unary("none")
    out = fl.out.name
    zeros = torch.zeros(n, dtype=torch.float32)  # the bridge runs linear only with a bias

    def step(env: dict[str, Tensor]) -> None:
        a, w = env[a_name], env[b_name]
        bias = env[bias_name].reshape(-1) if bias_name is not None else zeros
        env[out] = unary.aten(F.linear(a, w.t(), bias))

    return step


def _scale_shift_step(ss: ScaleShift) -> Step:
    """x * scale + shift (+ ReLU) as addcmul (+ relu): aten ops the bridge leaves alone (see
    plan_traced_steps for why)."""
    import torch

    x_name, scale_name, shift_name, relu, out = ss.x.name, ss.scale.name, ss.shift.name, ss.relu, ss.out

    def step(env: dict[str, Tensor]) -> None:
        y = torch.addcmul(env[shift_name], env[x_name], env[scale_name])
        env[out.name] = as_declared(torch.relu(y) if relu else y, out)

    return step


def _shuffle_step(cs: ChannelShuffle) -> Step:
    """torch.channel_shuffle keeps its input's memory format (channels-last stays so)."""
    import torch

    x_name, groups, out = cs.x.name, cs.groups, cs.out

    def step(env: dict[str, Tensor]) -> None:
        env[out.name] = as_declared(torch.channel_shuffle(env[x_name], groups), out)

    return step


def _conv_step(fc: FusedConv) -> Step:
    """conv (+ bias) (+ activation | + residual (+ ReLU)) as F.conv2d with its bias, then
    the epilogue in aten ops: the form the bridge fuses into one partition."""
    import torch
    import torch.nn.functional as F

    conv = fc.conv
    x_name, w_name = conv.inputs["x"].name, conv.inputs["w"].name
    bias_name = fc.bias.name if fc.bias is not None else None
    res_name = fc.residual.name if fc.residual is not None else None
    _, stride, dilation, groups = conv_args(conv)
    pre_pad, pad = conv_padding(conv)
    unary, post_relu, out = fc.unary or Unary("none"), fc.post_relu, fc.out.name

    def step(env: dict[str, Tensor]) -> None:
        x = env[x_name] if pre_pad is None else F.pad(env[x_name], pre_pad)
        b = env[bias_name].reshape(-1) if bias_name is not None else None
        y = F.conv2d(x, env[w_name], b, stride, pad, dilation, groups)
        if res_name is not None:
            y = y + env[res_name]
            if post_relu:
                y = torch.relu(y)
        else:
            y = unary.aten(y)
        env[out] = y

    return step


def trace(
    graph: Graph,
    node_step: Callable[[Node], Step],
    fused: Mapping[str, TracedStep],
    constants: Mapping[str, Tensor],
    scalars: Mapping[str, Tensor],
    example: Sequence[Tensor],
    activations: Sequence[TensorAttr],
) -> Callable[..., tuple[Tensor, ...]]:
    """The graph as a frozen TorchScript function of its activations, fused by oneDNN Graph
    (weights as frozen constants). Raises whatever tracing or the first runs raise."""
    import torch

    swallowed = {id(n) for fl in fused.values() for n in fl.nodes[:-1]}
    steps: list[Step] = []
    for n in graph.topological_order():
        if id(n) in swallowed:
            continue
        fl = fused.get(n.name)
        if fl is None:
            steps.append(node_step(n))
        elif isinstance(fl, FusedLinear):
            steps.append(_linear_step(fl))
        elif isinstance(fl, ChannelShuffle):
            steps.append(_shuffle_step(fl))
        elif isinstance(fl, ScaleShift):
            steps.append(_scale_shift_step(fl))
        else:
            steps.append(_conv_step(fl))
    act_names = [t.name for t in activations]
    const_names = list(constants)
    out_names = [t.name for t in graph.outputs()]

    class _Plan(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for i, name in enumerate(const_names):
                self.register_buffer(f"c{i}", constants[name])

        def forward(self, *xs: Tensor) -> tuple[Tensor, ...]:
            env: dict[str, Tensor] = dict(scalars)
            env.update(zip(act_names, xs, strict=True))
            for i, name in enumerate(const_names):
                env[name] = getattr(self, f"c{i}")
            for step in steps:
                step(env)
            return tuple(env[o] for o in out_names)

    jit: Any = torch.jit
    with _fusion_on(), torch.no_grad():
        frozen = jit.freeze(jit.trace(_Plan().eval(), tuple(example), check_trace=False))
        for _ in range(3):  # the profiling executor specializes, then the bridge fuses
            frozen(*example)
    return frozen  # type: ignore[no-any-return]


def agrees(got: Sequence[Tensor], want: Sequence[Tensor], tol: float = 1e-4) -> str:
    """'' when every output matches the eager plan's to ``tol`` (relative L2), else why not."""
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        if tuple(g.shape) != tuple(w.shape):
            return f"output {k}: shape {tuple(g.shape)} vs {tuple(w.shape)}"
        g64, w64 = g.detach().double().numpy(), w.detach().double().numpy()
        if not np.array_equal(np.isnan(g64), np.isnan(w64)) or not np.array_equal(np.isinf(g64), np.isinf(w64)):
            return f"output {k}: NaN / inf where the eager plan has none, or the other way round"
        g64, w64 = np.nan_to_num(g64, posinf=0.0, neginf=0.0), np.nan_to_num(w64, posinf=0.0, neginf=0.0)
        err = float(np.linalg.norm(g64 - w64)) / max(float(np.linalg.norm(w64)), 1e-30)
        if err > tol:
            return f"output {k}: relative error {err:.1e} against the eager plan"
    return ""


# ---- the crash-isolated probe ------------------------------------------------------------------
VERDICTS = "onednn-graph-verdicts.json"
RECIPE = 5  # how a plan is written for the bridge; part of the verdict key (bump on change)
PROBE_TIMEOUT_S = 300.0
_LOCK = threading.Lock()


def _verdict_key(graph: Graph, bound: Sequence[str], knobs: Sequence[tuple[str, Any]]) -> str:
    import torch

    from fusegraph import __version__

    return (f"{graph.key()}|bound={','.join(sorted(bound))}|{sorted(knobs)!r}|torch {torch.__version__}"
            f"|{__version__}|recipe {RECIPE}")


def probe(graph: Graph, bound: Sequence[str], knobs: Sequence[tuple[str, Any]]) -> str:
    """'' when tracing and running this graph through oneDNN Graph works (in a child process,
    on random values, ``bound`` inputs frozen in as constants), else why not; cached."""
    from fusegraph.runtime.cache_dir import cache_enabled, cache_root, read_table, update_table

    key = _verdict_key(graph, bound, knobs)
    path = cache_root() / VERDICTS
    if cache_enabled():
        with _LOCK:
            known = read_table(path).get(key)
        if known is not None:
            return str(known)
    verdict, definitive = _run_probe(graph, bound, knobs)
    if cache_enabled() and definitive:
        with _LOCK:
            try:  # under the table's file lock: concurrent probes keep each other's verdicts
                update_table(path, lambda table: table.__setitem__(key, verdict))
            except OSError as exc:  # a read-only cache: the verdict is still used now
                log.info("could not record the oneDNN Graph verdict in %s: %s", path, exc)
    return verdict


def _run_probe(graph: Graph, bound: Sequence[str], knobs: Sequence[tuple[str, Any]]) -> tuple[str, bool]:
    """The child's verdict and whether it is definitive (worth caching): a verdict the child
    wrote, or its death by a signal; not a child that failed to start."""
    import sys

    from fusegraph.runtime.bounded import default_memory_ceiling, run_bounded

    with tempfile.TemporaryDirectory(prefix="fusegraph-probe-") as tmp:
        spec = Path(tmp) / "probe.json"
        result = Path(tmp) / "result.json"
        spec.write_text(json.dumps({"graph": graph.to_json(), "bound": list(bound), "knobs": [list(k) for k in knobs]}))
        cmd = [sys.executable, "-m", "fusegraph.engines.torch.onednn_graph", str(spec), str(result)]
        # bounded like a compile (runtime/bounded.py): a probe that runs away costs the probe
        ceiling = default_memory_ceiling()
        proc = run_bounded(cmd, memory_bytes=ceiling, seconds=PROBE_TIMEOUT_S)
        if proc.stopped == "time":
            return f"the probe process did not finish in {PROBE_TIMEOUT_S:.0f} s", True
        if proc.stopped == "memory":
            return (f"the probe process passed its memory ceiling ({ceiling / 2**20:.0f} MiB resident) "
                    "and was stopped"), True
        try:
            return str(json.loads(result.read_text())["verdict"]), True
        except (OSError, ValueError, KeyError):
            if proc.returncode < 0:
                return f"the probe process died (signal {-proc.returncode}) tracing or running the graph", True
            tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
            return f"the probe process failed (exit code {proc.returncode}): {tail[0]}", False


def _probe_child(spec_path: str, result_path: str) -> None:
    """In the child: the plan built as the parent would, on random values; the verdict written."""
    from fusegraph.engines.base import EngineConfig
    from fusegraph.engines.torch.engine import TorchEngine
    from fusegraph.reference.inputs import random_inputs
    from fusegraph.runtime.handle import Handle

    spec = json.loads(Path(spec_path).read_text())
    graph = Graph.from_json(spec["graph"]).validate()
    knobs = tuple((str(k), v) for k, v in spec["knobs"])
    plan: Any = TorchEngine().build(graph, Handle("cpu"), EngineConfig("torch", knobs))
    pack = random_inputs(graph, np.random.default_rng(0))
    plan.bind_constants({k: pack[k] for k in spec["bound"]})
    why = plan.onednn_graph_verdict(pack, probe=False)
    Path(result_path).write_text(json.dumps({"verdict": why}))


__all__ = ["agrees", "available", "probe", "trace"]

if __name__ == "__main__":  # the probe's child process: python -m ... SPEC RESULT
    import sys

    _probe_child(sys.argv[1], sys.argv[2])
