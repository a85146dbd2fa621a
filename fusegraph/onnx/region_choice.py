"""The region layer's settings for an ONNX session (issue 24): whether its claimed units run
region by region (``wanted``, ``unavailable``), the bar a region must clear there
(``incumbent_for``: the same nodes op by op on PyTorch, never ONNX Runtime's CPU provider
for a GPU session), and the ``Chooser`` that decides each region (``chooser_for``): its
builder (with ``precision=tf32`` a plan with its engine's ``tf32`` knob on; with
``fp32_matmul=auto`` on CUDA a torch-engine plan holding a float32 matmul rebuilt with the
engine's ``fp32_matmul=bf16x3`` knob), its timing
(device time on a GPU, where the unit replays as one CUDA graph), its verdict store and the
keys that keep a precision's verdicts apart.

Why a module: these are what a session *asks* of the region layer, read by the session
plan (plan.py, ``wanted``) and by the unit that runs the regions (plan_regions.py); tests
replace ``chooser_for`` here to fake the incumbent or the clock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fusegraph.engines.base import ExecutionPlan
from fusegraph.errors import FusegraphError, UnsupportedError
from fusegraph.graph.graph import Graph
from fusegraph.onnx.precision import Precision, tf32_allowed
from fusegraph.onnx.units import engine_cache
from fusegraph.regions.choose import Chooser
from fusegraph.regions.incumbent import Incumbent, TorchOpByOp
from fusegraph.regions.split import Region
from fusegraph.regions.verdicts import VerdictStore
from fusegraph.runtime.handle import Handle

if TYPE_CHECKING:
    from fusegraph.onnx.options import ProviderOptions
    from fusegraph.onnx.plan import SessionPlan

log = logging.getLogger("fusegraph.onnx")

# The region floor's timing (select/timing.py's time_candidates): a bounded warm-up, as the
# torch front door's (a model's regions are many and small; setup is what users wait for).
TIMING: dict[str, Any] = {"warmup_s": 0.2, "min_rounds": 5}


def wanted(opts: ProviderOptions, handle: Handle) -> bool:
    """Whether claimed units run region by region: ``regions=on``, or ``auto`` on a GPU or
    with fp16 / bf16 asked for (reduced precision is a property of the regions)."""
    reduced = Precision(opts.precision).reduced is not None
    return opts.regions == "on" or (opts.regions == "auto" and (handle.device.is_gpu or reduced))


def unavailable() -> str:
    """Why the region path cannot run here ('' when it can): its steps pass torch tensors and
    its incumbent is PyTorch."""
    from fusegraph.engines.registry import REGISTRY

    try:
        state = REGISTRY.get("torch").available()
    except Exception as exc:  # a registry without the torch engine
        return f"the torch engine is not registered ({exc})"
    return "" if state else f"the torch engine is unavailable ({state.reason})"


def incumbent_for(handle: Handle, *, tf32: bool = False) -> Incumbent:
    """The bar a region must clear on ``handle``'s device: the same nodes op by op on PyTorch,
    at the session's precision (``tf32``: TF32 allowed, as PyTorch allows it by default for
    convolutions)."""
    return TorchOpByOp(handle, tf32=tf32)


def chooser_for(plan: SessionPlan) -> Chooser:
    """The region layer's settings for this session (tests replace the incumbent or the
    timer of the chooser it returns, as tests/test_regions.py does)."""
    handle = plan.handle
    floor = plan.floor_budget > 0
    engine = plan.engine.name if plan.engine is not None else None
    cache_dir = plan.opts.cache_dir
    compiled = plan.engine is not None and any(e.name != "reference" for e in plan.engine.candidates)

    tf32 = plan.opts.precision == "tf32"
    split = split_wanted(plan.opts, handle)

    def build(region: Region, split: bool = split) -> ExecutionPlan:
        """fusegraph's plan; any failure of an engine is the region's refusal (with its
        reason), never the unit's. ``split``: a torch-engine plan with a float32 matmul
        rebuilt with split products (the plan as selected is then the fallback candidate)."""
        try:
            with engine_cache(cache_dir), tf32_allowed(tf32):
                first = _cudnn_tf32(region.graph, handle) if tf32 and engine is None else None
                built: ExecutionPlan = first or region.graph.build(handle=handle, engine=engine)
                if tf32 and first is None:
                    built = _with_tf32(built, region.graph, handle)
                if split:
                    built = _with_split(built, region.graph, handle)
        except FusegraphError:
            raise
        except Exception as exc:
            raise UnsupportedError(f"building failed: {type(exc).__name__}: {exc}") from exc
        if built.engine == "reference" and engine is None and compiled:
            raise UnsupportedError("only the float64 reference engine builds it (a correctness oracle, not a runner)")
        return built

    sync: Callable[[], None] | None = None
    timing_options: dict[str, Any] = dict(TIMING)
    key_options: dict[str, Any] = {}
    if handle.device.is_gpu:
        import torch

        from fusegraph.select.cuda_clock import CudaClock

        device = torch.device(str(handle.device))
        sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
        # the unit replays as one CUDA graph, regions and incumbent steps alike, so a region's
        # host cost is paid once at capture: both sides are timed on device time
        timing_options["device_clock"] = CudaClock(device)
        key_options["clock"] = "device"
    options = build_options(plan.opts, handle)

    def folded(region: Region) -> ExecutionPlan:
        """The preferred candidate on a GPU: the region with its border reshapes and output
        transposes folded into views on a kernel engine -- a layer norm exported as [B, S, F]
        and transposed for the attention after it (ViT-B/16) reaches the Triton row kernel
        instead of an Inductor compile of its own (seconds of setup each, and Inductor's
        import in every new process)."""
        from fusegraph.regions.views import folded_kernel_plan

        with engine_cache(cache_dir), tf32_allowed(tf32):  # the unit's steps take outputs in any strides
            return folded_kernel_plan(region.graph, handle, transposes=True)

    return Chooser(handle, incumbent_for(handle, tf32=plan.opts.precision == "tf32"), floor=floor, engine=engine,
                   store=VerdictStore(cache_dir) if floor else None, sync=sync,
                   timing_options=timing_options, builder=build, build_options=options, key_options=key_options,
                   preferred=folded if handle.device.is_gpu and engine is None else None,
                   # where the split plan loses, the float32 plan it replaced is measured too
                   fallbacks=(("fp32_matmul=ieee", lambda region: build(region, False)),) if split else (),
                   fallback_when=per_content(lambda region: _splittable(region.graph, handle)) if split else None,
                   budget_s=region_budget(plan.opts),
                   # a deferred session (region_upgrade.py) builds every stored winner later
                   build_later=lambda v: True)


def per_content(ask: Callable[[Region], bool]) -> Callable[[Region], bool]:
    """``ask`` answered once per region content key: the chooser asks it of every region on
    each lookup of its verdicts (twice or more per region in a warm open), and a model's
    repeated layers are regions of one content (ViT-B/16: 88 regions, 9 contents)."""
    known: dict[str, bool] = {}

    def asked(region: Region) -> bool:
        found = known.get(region.key)
        if found is None:
            found = known[region.key] = ask(region)
        return found

    return asked


def split_wanted(opts: ProviderOptions, handle: Handle) -> bool:
    """Whether torch-engine regions holding a float32 matmul are also built with the
    engine's ``fp32_matmul=bf16x3`` knob: ``fp32_matmul=auto`` in an fp32 session on a GPU
    (a tf32 session keeps TF32: the two are never combined; the floor keeps the split only
    where it beats the incumbent)."""
    return opts.fp32_matmul == "auto" and opts.precision == "fp32" and handle.device.is_gpu


def build_options(opts: ProviderOptions, handle: Handle) -> dict[str, Any]:
    """What the regions' plans are built with, as far as a verdict's key must tell them
    apart: a precision's verdicts are its own (fp16 / bf16 regions also differ in content;
    tf32's do not), and so are the split's (``fp32_matmul=auto`` on a GPU) -- never read by
    an ``fp32_matmul=ieee`` session, nor the other way round."""
    options: dict[str, Any] = {} if opts.precision == "fp32" else {"precision": opts.precision}
    if split_wanted(opts, handle):
        options["fp32_matmul"] = "bf16x3"
    return options


def region_budget(opts: ProviderOptions) -> float | None:
    """``floor`` given as seconds bounds the regions' first measurement too (a model of many
    distinct regions -- DenseNet-121 on an H200 took over three minutes -- is measured over
    several sessions); ``on`` / ``auto`` measure every region in the first session."""
    if opts.floor in ("auto", "on", "off"):
        return None
    return opts.floor_budget(pinned=False) or None


def _cudnn_tf32(graph: Graph, handle: Handle) -> ExecutionPlan | None:
    """With ``precision=tf32`` on a GPU: a region holding a convolution, matmul or attention
    built on the cudnn engine with its ``tf32`` knob on (the selection never picks cudnn for
    such a float32 graph: its TF32-free plans refuse float32 matmuls); None where cudnn is
    absent, has no such knob for the graph, or the build fails (then the selection decides)."""
    from fusegraph.engines.base import EngineConfig
    from fusegraph.engines.registry import REGISTRY
    from fusegraph.graph.ops import CONVOLUTIONS, OpKind

    if not handle.device.is_gpu or not any(n.kind in CONVOLUTIONS | {OpKind.MATMUL, OpKind.SDPA} for n in graph.nodes):
        return None
    try:
        engine = REGISTRY.get("cudnn")
        if not engine.available() or not any(k.name == "tf32" for k in engine.knobs(graph, handle)):
            return None
        plan: ExecutionPlan = engine.build(graph, handle, EngineConfig("cudnn", (("tf32", True),)))
    except Exception as exc:
        log.info("no cudnn TF32 plan of %s: %s", graph.name, exc)
        return None
    return plan


def _with_tf32(built: ExecutionPlan, graph: Graph, handle: Handle) -> ExecutionPlan:
    """``built`` rebuilt with its engine's ``tf32`` knob on, where the engine has one (the
    cudnn engine's, for float32 graphs); as it was where not, or where that build fails."""
    from fusegraph.engines.base import EngineConfig
    from fusegraph.engines.registry import REGISTRY

    try:
        engine = REGISTRY.get(built.engine)
        if not any(k.name == "tf32" for k in engine.knobs(graph, handle)):
            return built
        knobs = (*(kv for kv in built.config.knobs if kv[0] != "tf32"), ("tf32", True))
        tf32: ExecutionPlan = engine.build(graph, handle, EngineConfig(built.engine, knobs))
    except Exception as exc:  # TF32 is an allowance: the float32 plan stands
        log.info("no TF32 plan of %s on %s: %s", graph.name, built.engine, exc)
        return built
    return tf32


def _splittable(graph: Graph, handle: Handle) -> bool:
    """Whether the torch engine offers its ``fp32_matmul`` knob for ``graph`` (a float32 matmul
    on CUDA): the regions whose plan ``_with_split`` may replace, so the only ones with a
    float32 plan left to fall back to."""
    from fusegraph.engines.registry import REGISTRY

    try:
        return any(k.name == "fp32_matmul" for k in REGISTRY.get("torch").knobs(graph, handle))
    except Exception:  # no torch engine here: nothing was split
        return False


def _with_split(built: ExecutionPlan, graph: Graph, handle: Handle) -> ExecutionPlan:
    """``built``, where it is a torch-engine plan holding a float32 matmul on CUDA, rebuilt
    with the engine's ``fp32_matmul="bf16x3"`` knob (split_products.py: three bf16
    tensor-core products, ~4.6e-5 |A||B| at worst); as it was elsewhere, or where that build
    fails (float32 as declared stands). The chooser then measures it like any plan."""
    from fusegraph.engines.base import EngineConfig
    from fusegraph.engines.registry import REGISTRY

    if built.engine != "torch" or not _splittable(graph, handle):
        return built
    try:
        engine = REGISTRY.get("torch")
        knobs = (*(kv for kv in built.config.knobs if kv[0] != "fp32_matmul"), ("fp32_matmul", "bf16x3"))
        split: ExecutionPlan = engine.build(graph, handle, EngineConfig("torch", knobs))
    except Exception as exc:  # the split is an offer: the float32 plan stands
        log.info("no bf16x3 plan of %s: %s: %s", graph.name, type(exc).__name__, exc)
        return built
    return split


__all__ = ["TIMING", "build_options", "chooser_for", "incumbent_for", "per_content", "region_budget", "split_wanted",
           "unavailable", "wanted"]
