"""A Dynamo graph's stored verdict (graph_floor.inductors_own_key) is keyed by the global
state its step time depends on: the same graph code under bf16 autocast and in float32, or
with TF32 on and off, is timed once each, never served the other's verdict."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch.compile backend needs torch")

from test_torch_graph_floor import clock  # noqa: E402, F401  (the virtual clock fixture)
from test_torch_incumbent_path import FLOOR, LNBlock, regions_lose  # noqa: E402, F401
from test_torch_step_floor import step_clock, step_timer  # noqa: E402, F401

from fusegraph.torch.compile_backend import STORED_EAGER, collecting  # noqa: E402
from fusegraph.torch.graph_floor import inductors_own_key  # noqa: E402

OPTIONS = {**FLOOR, "warmup_s": 0.0}


def _graph() -> tuple[Any, list[Any]]:
    """One Dynamo graph and its example inputs, as the backend receives them."""
    seen: list[tuple[Any, list[Any]]] = []

    def backend(gm: Any, example_inputs: list[Any]) -> Any:
        seen.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(LNBlock().eval(), backend=backend)(torch.randn(2, 8, 32))
    assert len(seen) == 1
    return seen[0]


def test_the_key_changes_with_autocast_and_tf32_only() -> None:
    gm, inputs = _graph()
    key = inductors_own_key(gm, inputs, {}, "dev", {})
    assert inductors_own_key(gm, inputs, {}, "dev", {}) == key
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = inductors_own_key(gm, inputs, {}, "dev", {})
    with torch.autocast("cpu", dtype=torch.float16):
        f16 = inductors_own_key(gm, inputs, {}, "dev", {})
    assert len({key, bf16, f16}) == 3
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = not before
        assert inductors_own_key(gm, inputs, {}, "dev", {}) != key
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert inductors_own_key(gm, inputs, {}, "dev", {}) == key


@pytest.mark.usefixtures("regions_lose")
def test_a_float32_verdict_is_not_served_under_autocast(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inference, nothing kept. In float32 eager is forced the fastest and stored; the same
    model under bf16 autocast (Dynamo compiles it again: its guards see the autocast state)
    is timed again, and there Inductor's own is forced the fastest and runs."""
    step = step_timer(monkeypatch, tmp_path)
    step["eager_ms"] = 0.5
    model = LNBlock().eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusegraph", options=OPTIONS)
    x = torch.randn(2, 8, 32)
    with torch.no_grad(), collecting() as rows:
        got = compiled(x)
    assert torch.equal(got, model(x))
    assert step["calls"] == 1 and rows and all(r.where == "torch.eager" for r in rows), rows[0].why
    step["eager_ms"] = 3.0  # now Inductor's own (1 ms) is the fastest
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), collecting() as rows:
        got = compiled(x)
        want = model(x)
    assert step["calls"] == 2, "the bf16 graph was served the float32 graph's verdict"
    assert got.dtype == want.dtype
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert rel < 2e-2, rel
    assert rows and all(r.where == "inductor" and not r.why.startswith(STORED_EAGER) for r in rows), rows[0].why


def test_each_checked_step_casts_the_weights_afresh_under_autocast() -> None:
    """The step check runs inside the caller's one autocast context, where autocast keeps the
    casts of leaves that require grad until the context exits; a user's steps each enter
    their own. So each checked step starts with the cache cleared: a weight changed between
    two steps is cast again (kept, the second step would read the first one's bf16 copy)."""
    from fusegraph.torch.step_floor import _Step

    outs: list[Any] = []

    def fn(x: Any, w: Any) -> Any:
        y = torch.mm(x, w)
        outs.append(y)
        return y

    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        step = _Step(fn, [x, w])
        assert step.args[1].is_leaf and step.args[1].requires_grad
        step()
        step.args[1].add_(1.0)
        step()
    assert outs[1].dtype == torch.bfloat16
    want = torch.mm(step.args[0].bfloat16(), step.args[1].detach().bfloat16())
    assert torch.equal(outs[1], want)
    assert not torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("flag", ["matmul_tf32", "cudnn_tf32", "deterministic"])
def test_region_and_aten_graph_keys_hold_the_math_settings(flag: str) -> None:
    """A region's verdict (the chooser's key settings) and an ATen graph's (graph_floor's
    key) were taken under TF32 and deterministic settings neither graph's code shows: each
    setting keys verdicts of its own."""
    from fusegraph.torch import graph_floor, partition

    gm, inputs = _graph()

    def keys() -> tuple[Any, str]:
        chooser = partition._chooser(partition.Options.of({}), torch.device("cpu"))
        return dict(chooser.key_options), graph_floor._key(gm, inputs, [], 0.03, "dev", {})

    before_options, before_key = keys()
    get, set_ = {
        "matmul_tf32": (lambda: torch.backends.cuda.matmul.allow_tf32,
                        lambda v: setattr(torch.backends.cuda.matmul, "allow_tf32", v)),
        "cudnn_tf32": (lambda: torch.backends.cudnn.allow_tf32, lambda v: setattr(torch.backends.cudnn, "allow_tf32", v)),
        "deterministic": (torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms),
    }[flag]
    was = get()
    try:
        set_(not was)
        options, key = keys()
    finally:
        set_(was)
    assert options != before_options and key != before_key
    assert options[flag] == (not was) and before_options[flag] == was
    assert keys() == (before_options, before_key)  # restored: the same keys again
