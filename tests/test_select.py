"""Selection: heuristic order, modes, preferred engine and FUSEGRAPH_ENGINE, the plan-list
API, partial support (splitting) and the never-the-reference-on-a-GPU rule."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from engine_fakes import (
    FakeEngine,
    chain_graph,
    conv_graph,
    layernorm_graph,
    matmul_chain_graph,
    registry_with,
    rel_error,
)

import fusegraph as fg
from fusegraph import BuildPlanPolicy, HeurMode
from fusegraph.engines.base import EngineConfig, Knob, Support
from fusegraph.engines.registry import using
from fusegraph.errors import ExecutionError, UnsupportedError
from fusegraph.graph.ops import OpKind
from fusegraph.select import api, heuristics
from fusegraph.select.autotune import random_inputs
from fusegraph.select.partition import PARTITION, PartitionPlan, extract, split

CPU = fg.Handle("cpu")
GPU = fg.Handle("cuda:0")  # a handle needs no GPU; engines decide whether they can use it

COMPILE_KNOB = Knob("compile", False, (False, True))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FUSEGRAPH_ENGINE", raising=False)


def _fakes() -> tuple[FakeEngine, FakeEngine]:
    """Stand-ins named like the built-ins, so the built-in rules apply to them."""
    return FakeEngine("iree"), FakeEngine("torch", knobs=[COMPILE_KNOB])


def _order(g: fg.Graph) -> list[str]:
    return [str(c.config) for c in g._selection.candidates]


# ---- graph features and rules ------------------------------------------------------------------
def test_features_classify_graphs() -> None:
    assert heuristics.features(conv_graph()).op_class == "compute"
    assert heuristics.features(layernorm_graph()).op_class == "reduction"
    f = heuristics.features(chain_graph(5))
    assert (f.op_class, f.n_pointwise) == ("pointwise", 5)
    conv = heuristics.features(conv_graph(n=1, c=8, hw=8, k=8))
    assert conv.flops == 2 * 8 * 8 * 8 * 8 * 9  # 2 x outputs x C x 3 x 3


@pytest.mark.parametrize(
    ("graph", "handle", "expected"),
    [
        (conv_graph, GPU, ["torch", "iree"]),
        (matmul_chain_graph, GPU, ["torch", "iree"]),
        (layernorm_graph, GPU, ["torch[compile=True]", "torch", "iree"]),
        (lambda: chain_graph(6), GPU, ["torch[compile=True]", "iree", "torch"]),
        (lambda: chain_graph(2), GPU, ["torch", "iree"]),
        (conv_graph, CPU, ["torch", "iree", "reference"]),
        (matmul_chain_graph, CPU, ["iree", "torch", "reference"]),
        (layernorm_graph, CPU, ["torch", "iree", "reference"]),
        (lambda: chain_graph(6), CPU, ["iree", "torch", "reference"]),
    ],
)
def test_mode_a_order_follows_the_rule_table(graph, handle, expected) -> None:  # type: ignore[no-untyped-def]
    reg = registry_with(*_fakes())
    g = graph()
    with using(reg):
        g.create_execution_plans([HeurMode.A, HeurMode.FALLBACK], handle)
    assert _order(g) == expected
    assert g._selection.candidates[0].source in ("heuristic:A",)


def test_rule_steps_with_missing_knobs_are_skipped() -> None:
    reg = registry_with(FakeEngine("iree"), FakeEngine("torch"))  # no compile knob here
    g = layernorm_graph()
    with using(reg):
        g.create_execution_plans([HeurMode.A], GPU)
    assert _order(g) == ["torch", "iree"]


def test_mode_b_lists_every_knob_setting_after_the_a_choices() -> None:
    reg = registry_with(FakeEngine("iree", knobs=[Knob("tiling", True, (False, True))]), FakeEngine("torch", knobs=[COMPILE_KNOB]))
    g = chain_graph(6)
    with using(reg):
        g.create_execution_plans([HeurMode.B], GPU)
    assert _order(g) == ["torch[compile=True]", "iree", "torch", "iree[tiling=False]"]
    assert all(c.source == "heuristic:B" for c in g._selection.candidates)


def test_fallback_adds_the_reference_only_on_cpu() -> None:
    reg = registry_with(FakeEngine("other"))
    g = chain_graph()
    with using(reg):
        g.create_execution_plans([HeurMode.FALLBACK], CPU)
        assert _order(g) == ["other", "reference"]
        g.create_execution_plans([HeurMode.FALLBACK], GPU)
        assert _order(g) == ["other"]
        g.create_execution_plans([HeurMode.A], CPU)
        assert "reference" not in _order(g)


def test_explain_names_the_rule_and_its_numbers() -> None:
    text = api.explain(conv_graph(), GPU)
    assert text.startswith("gpu.compute") and "ms" in text


def test_cpu_attention_rule_sets_an_iree_knob_when_iree_has_it() -> None:
    g = fg.Graph("attn", io_data_type=fg.DataType.FLOAT)
    q = g.tensor("q", [1, 2, 8, 4])
    g.sdpa(q, q, q).set_output(True)
    g.validate()
    attn_knob = Knob("attention", "fused", ("fused", "decomposed"))
    with using(registry_with(FakeEngine("iree", knobs=[attn_knob]), FakeEngine("torch"))):
        g.create_execution_plans([HeurMode.A], CPU)
        assert _order(g) == ["iree[attention=decomposed]", "torch"]
    with using(registry_with(FakeEngine("iree"), FakeEngine("torch"))):  # no such knob: defaults
        g.create_execution_plans([HeurMode.A], CPU)
        assert _order(g) == ["iree", "torch"]


# ---- preferred engine, env var, pinned config -----------------------------------------------
def test_preferred_engine_goes_first() -> None:
    reg = registry_with(*_fakes())
    g = conv_graph()
    with using(reg):
        plan = g.build(CPU, preferred_engine="torch")
    assert plan.engine == "torch"
    assert g._selection.candidates[0].source == "preferred"
    assert _order(g)[1] == "iree"  # the rest stays in heuristic order


def test_env_var_prefers_an_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = registry_with(*_fakes())
    monkeypatch.setenv("FUSEGRAPH_ENGINE", "torch")
    g = conv_graph()
    with using(reg):
        assert g.build(CPU).engine == "torch"
        assert g._selection.candidates[0].source == "preferred ($FUSEGRAPH_ENGINE)"
        # an explicit argument beats the variable
        assert g.build(CPU, preferred_engine="iree").engine == "iree"


def test_env_var_naming_no_engine_is_ignored_with_a_warning(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    reg = registry_with(*_fakes())
    monkeypatch.setenv("FUSEGRAPH_ENGINE", "nosuch")
    with using(reg), caplog.at_level(logging.WARNING, "fusegraph.select"):
        assert conv_graph().build(CPU).engine == "torch"  # the heuristic's choice
    assert "FUSEGRAPH_ENGINE=nosuch names no engine" in caplog.text


def test_preferred_engine_that_cannot_run_the_graph_falls_back() -> None:
    reg = registry_with(FakeEngine("iree"), FakeEngine("torch", ops={OpKind.POINTWISE}))
    g = conv_graph()
    with using(reg):
        plan = g.build(CPU, preferred_engine="torch")
    assert plan.engine == "iree"
    assert any(c.config.engine == "torch" for c in g._selection.rejected)


def test_explicit_engine_is_strict() -> None:
    reg = registry_with(FakeEngine("iree"), FakeEngine("torch", ops={OpKind.POINTWISE}))
    g = conv_graph()
    with using(reg), pytest.raises(UnsupportedError) as info:
        g.build(CPU, engine="torch")
    assert "torch cannot run conv_fprop" in str(info.value)
    with using(reg), pytest.raises(UnsupportedError, match="no engine named 'nosuch'"):
        g.build(CPU, engine="nosuch")


def test_pinned_config_is_used_as_given() -> None:
    reg = registry_with(*_fakes())
    g = chain_graph()
    with using(reg):
        plan = g.build(CPU, config={"engine": "torch", "knobs": {"compile": True}})
    assert plan.config == EngineConfig("torch", (("compile", True),))
    assert [c.source for c in g._selection.candidates] == ["pinned"]


def test_execute_uses_the_built_plan_for_that_handle(rng: np.random.Generator) -> None:
    iree, torch = _fakes()
    reg = registry_with(iree, torch)
    g = chain_graph()
    pack = random_inputs(g, rng)
    with using(reg):
        g.build(CPU, preferred_engine="torch")
        out = g.execute(pack, handle=CPU)["y"]
        assert (torch.calls, iree.calls) == (1, 0)
        g.execute(pack, handle=CPU)
        assert torch.builds == 1  # built once, reused
        ref = g.execute(pack, engine="reference")["y"]
    assert rel_error(out, ref) < 1e-6


def test_execute_without_build_builds_the_heuristic_default(rng: np.random.Generator) -> None:
    iree, torch = _fakes()
    reg = registry_with(iree, torch)
    g = conv_graph()
    with using(reg):
        g.execute(random_inputs(g, rng))
    assert torch.calls == 1 and iree.calls == 0  # rule cpu.conv: oneDNN first


def test_a_graph_change_drops_built_plans() -> None:
    reg = registry_with(*_fakes())
    g = chain_graph()
    with using(reg):
        g.build(CPU)
    assert g.plans
    g.tensor_by_name("y").set_output(True)  # any edit
    assert not g.plans and g._selection is None


# ---- the plan list API -------------------------------------------------------------------------
def test_plan_list_api_builds_and_runs_every_plan(rng: np.random.Generator) -> None:
    reg = registry_with(*_fakes())
    g = chain_graph(4)
    pack = random_inputs(g, rng)
    ref = g.execute(pack, engine="reference")["y"]
    with using(reg):
        g.create_execution_plans([HeurMode.B, HeurMode.FALLBACK], CPU)
        g.check_support()
        g.build_plans(BuildPlanPolicy.ALL)
        n = g.get_execution_plan_count()
        assert n == 4  # iree, torch, torch[compile=True], reference
        for i in range(n):
            assert rel_error(g.execute_plan_at_index(pack, i)["y"], ref) < 1e-6
        with pytest.raises(ExecutionError, match="no index 4"):
            g.execute_plan_at_index(pack, n)


def test_heuristics_choice_builds_one_plan() -> None:
    reg = registry_with(*_fakes())
    g = chain_graph()
    with using(reg):
        g.create_execution_plans([HeurMode.A, HeurMode.FALLBACK], CPU).check_support().build_plans(BuildPlanPolicy.HEURISTICS_CHOICE)
    assert g.get_execution_plan_count() == 1


def test_a_failing_build_moves_on_to_the_next_candidate(caplog) -> None:  # type: ignore[no-untyped-def]
    class Broken(FakeEngine):
        def build(self, graph, handle, config=None):  # type: ignore[no-untyped-def]
            raise fg.CompileError("boom")

    reg = registry_with(Broken("torch"), FakeEngine("iree"))
    with using(reg), caplog.at_level(logging.WARNING):
        plan = conv_graph().build(CPU)
    assert plan.engine == "iree"
    assert "building torch" in caplog.text and "boom" in caplog.text


def test_check_support_keeps_the_reasons() -> None:
    reg = registry_with(FakeEngine("iree"), FakeEngine("torch", ops={OpKind.POINTWISE}))
    g = conv_graph()
    with using(reg):
        g.create_execution_plans([HeurMode.A, HeurMode.FALLBACK], CPU)
        g.check_support()
    rejected = {str(c.config): c.support.reason for c in g._selection.rejected if c.support is not None}
    assert "torch cannot run conv_fprop" in rejected["torch"]


def test_no_engine_at_all_raises_with_every_reason() -> None:
    reg = registry_with(FakeEngine("iree", gpu=False), FakeEngine("torch", gpu=False))
    g = conv_graph()
    with using(reg), pytest.raises(UnsupportedError) as info:
        g.build(GPU)
    msg = str(info.value)
    assert "iree: iree has no GPU backend" in msg
    assert "torch: torch has no GPU backend" in msg
    assert "reference: the reference engine runs on the host only" in msg


def test_reference_is_never_chosen_on_a_gpu_handle() -> None:
    reg = registry_with()  # only the reference engine
    g = chain_graph()
    with using(reg):
        with pytest.raises(UnsupportedError, match="host only"):
            g.build(GPU)
        with pytest.raises(UnsupportedError, match="host only"):
            g.build(GPU, engine="reference")
        g.create_execution_plans([HeurMode.A, HeurMode.B, HeurMode.FALLBACK], GPU)
        assert "reference" not in _order(g)


def test_real_engines_on_a_gpu_handle_here_refuse_with_reasons() -> None:
    """Without a GPU, building for cuda:0 fails naming every engine's reason; on the GPU
    machine the same build succeeds."""
    g = conv_graph()
    if _cuda_available():
        assert g.build("cuda:0").engine in ("torch", "iree")
        return
    with pytest.raises(UnsupportedError) as info:
        g.build("cuda:0")
    msg = str(info.value)
    assert "reference:" in msg and "torch:" in msg and "iree:" in msg


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


# ---- partial support ----------------------------------------------------------------------------
def test_extract_makes_boundary_tensors_inputs_and_outputs() -> None:
    g = matmul_chain_graph()
    sub = extract(g, ["act", "mm2"])
    assert sorted(t.name for t in sub.inputs()) == sorted([g.node_by_name("mm1").outputs["c"].name, "w2"])
    assert [t.name for t in sub.outputs()] == [g.node_by_name("mm2").outputs["c"].name]
    assert sub.key() != g.key()


def test_split_takes_maximal_runs_per_engine() -> None:
    mm = FakeEngine("torch", ops={OpKind.MATMUL})
    pw = FakeEngine("iree", ops={OpKind.POINTWISE})
    pieces = split(matmul_chain_graph(), GPU, [pw, mm])
    assert [(p.engine, p.nodes) for p in pieces] == [
        ("torch", ["mm1"]), ("iree", ["act"]), ("torch", ["mm2"]), ("iree", ["addb"])
    ]
    both = FakeEngine("torch", ops={OpKind.MATMUL, OpKind.POINTWISE})
    assert [p.nodes for p in split(matmul_chain_graph(), GPU, [both])] == [["mm1", "act", "mm2", "addb"]]


def test_split_groups_independent_nodes_of_one_engine() -> None:
    g = fg.Graph("branches", io_data_type=fg.DataType.FLOAT)
    a = g.tensor("a", [4, 4])
    m1 = g.matmul(a, a, name="m1")
    r1 = g.relu(a, name="r1")
    m2 = g.matmul(r1, a, name="m2")
    r2 = g.tanh(m1, name="r2")
    g.add(m2, r2, name="sum").set_output(True)
    g.validate()
    pieces = split(g, GPU, [FakeEngine("iree", ops={OpKind.POINTWISE}), FakeEngine("torch", ops={OpKind.MATMUL})])
    assert [(p.engine, p.nodes) for p in pieces] == [
        ("torch", ["m1"]), ("iree", ["r1", "r2"]), ("torch", ["m2"]), ("iree", ["sum"])
    ]
    # pieces form a valid order: each reads only graph inputs or earlier pieces' outputs
    seen = {t.name for t in g.inputs()}
    for p in pieces:
        assert set(p.inputs) <= seen, (p.nodes, p.inputs, seen)
        seen |= set(p.outputs)


def test_partitioned_plan_on_gpu_handle_matches_reference(rng: np.random.Generator) -> None:
    mm = FakeEngine("torch", ops={OpKind.MATMUL})
    pw = FakeEngine("iree", ops={OpKind.POINTWISE})
    reg = registry_with(pw, mm)
    g = matmul_chain_graph()
    pack = random_inputs(g, rng)
    ref = g.execute(pack, engine="reference")["y"]
    with using(reg):
        plan = g.build(GPU)
        assert isinstance(plan, PartitionPlan)
        assert plan.config.engine == PARTITION
        assert [p.engine for p in plan.plans] == ["torch", "iree", "torch", "iree"]
        out = g.execute(pack, handle=GPU)["y"]
        given = np.empty_like(ref)
        g.execute({**pack, "y": given}, handle=GPU)
    assert rel_error(out, ref) < 1e-6
    assert rel_error(given, ref) < 1e-6
    assert mm.calls == 4 and pw.calls == 4


def test_partition_on_gpu_never_uses_the_reference() -> None:
    reg = registry_with(FakeEngine("iree", ops={OpKind.POINTWISE}))  # nobody does matmul
    g = matmul_chain_graph()
    with using(reg), pytest.raises(UnsupportedError) as info:
        g.build(GPU)
    msg = str(info.value)
    assert "node 'mm1'" in msg and "iree cannot run matmul" in msg
    assert "reference: the reference engine runs on the host only" in msg


def test_partition_on_cpu_may_use_the_reference_for_leftovers(rng: np.random.Generator) -> None:
    reg = registry_with(FakeEngine("iree", ops={OpKind.POINTWISE}))
    g = matmul_chain_graph()
    pack = random_inputs(g, rng)
    with using(reg):
        plan = g.build(CPU)
        assert isinstance(plan, PartitionPlan)
        assert [p.engine for p in plan.plans] == ["reference", "iree", "reference", "iree"]
        # without FALLBACK the reference takes no part
        with pytest.raises(UnsupportedError):
            g.build(CPU, modes=[HeurMode.A])
        out = g.execute(pack, handle=CPU)["y"]
    assert rel_error(out, g.execute(pack, engine="reference")["y"]) < 1e-6


def test_partition_with_real_torch_and_a_restricted_engine(rng: np.random.Generator) -> None:
    """Real torch for the matmuls; the plugin-like fake takes the pointwise ops."""
    from fusegraph.engines.registry import REGISTRY

    torch = REGISTRY.get("torch")
    if not torch.available():
        pytest.skip(f"torch unavailable: {torch.available().reason}")

    class MatmulOnlyTorch:
        name, version = "torch", torch.version

        def available(self):  # type: ignore[no-untyped-def]
            return torch.available()

        def supports(self, graph, handle):  # type: ignore[no-untyped-def]
            if any(n.kind != OpKind.MATMUL for n in graph.nodes):
                return Support.no("restricted to matmul in this test")
            return torch.supports(graph, handle)

        def knobs(self, graph, handle):  # type: ignore[no-untyped-def]
            return []

        def build(self, graph, handle, config=None):  # type: ignore[no-untyped-def]
            return torch.build(graph, handle, config)

    reg = registry_with(MatmulOnlyTorch(), FakeEngine("iree", ops={OpKind.POINTWISE}), reference=False)
    g = matmul_chain_graph()
    pack = random_inputs(g, rng)
    with using(reg):
        plan = g.build(CPU)
    assert [type(p).__name__ for p in plan.plans] == ["TorchPlan", "FakePlan", "TorchPlan", "FakePlan"]
    assert rel_error(plan.execute(pack)["y"], g.execute(pack, engine="reference")["y"]) < 1e-5



@pytest.mark.parametrize("engine", ["reference", "torch", "iree"])
def test_serialized_plans_load_back(engine: str, rng: np.random.Generator) -> None:
    from fusegraph.engines.registry import REGISTRY

    e = REGISTRY.get(engine) if engine in REGISTRY.names() else None
    if e is None or not e.available():
        pytest.skip(f"{engine} not available here")
    g = conv_graph()
    plan = g.build(CPU, engine=engine)
    data = plan.serialize()
    assert isinstance(data, bytes)
    again = api.load_plan(data, CPU)
    pack = random_inputs(g, rng)
    assert rel_error(again.execute(pack)["y"], plan.execute(pack)["y"]) < 1e-6


def test_tuning_never_tries_a_knob_that_changes_the_numbers() -> None:
    """TF32 rounding is faster and ~1e-3 off: the tuner keeps such a knob at its default (a
    caller pins it), so a tuned float32 graph never comes back at TF32's precision."""
    from fusegraph.engines.base import Knob
    from fusegraph.select.heuristics import knob_configs

    knobs = [Knob("tf32", False, (False, True), numerics=True), Knob("split", 1, (1, 2))]
    assert knob_configs(knobs) == [(), (("split", 2),)]


def test_the_torch_engine_offers_tf32_only_where_it_changes_something() -> None:
    pytest.importorskip("torch", reason="the torch engine needs torch")
    from fusegraph.engines.registry import REGISTRY

    engine = REGISTRY.get("torch")
    f32 = fg.Graph("mm32", io_data_type=fg.DataType.FLOAT)
    f32.matmul(f32.tensor("a", [4, 8]), f32.tensor("b", [8, 4])).set_output(True)
    f16 = fg.Graph("mm16", io_data_type=fg.DataType.HALF)
    f16.matmul(f16.tensor("a", [4, 8]), f16.tensor("b", [8, 4])).set_output(True)
    gpu, cpu = fg.Handle("cuda:0"), fg.Handle("cpu")
    tf32 = [k for k in engine.knobs(f32.validate(), gpu) if k.name == "tf32"]
    assert len(tf32) == 1 and tf32[0].numerics and tf32[0].default is False
    assert not any(k.name == "tf32" for k in engine.knobs(f32, cpu))
    assert not any(k.name == "tf32" for k in engine.knobs(f16.validate(), gpu))


def test_an_engine_config_takes_its_knobs_as_pairs_or_a_mapping() -> None:
    a = EngineConfig("triton", {"num_warps": 8, "rows_per_program": 2})
    assert a == EngineConfig("triton", (("num_warps", 8), ("rows_per_program", 2))) and a.get("num_warps") == 8
    with pytest.raises(TypeError, match="knobs must be"):
        EngineConfig("triton", ("num_warps", 8))  # type: ignore[arg-type]
