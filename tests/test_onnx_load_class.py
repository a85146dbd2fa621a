"""The machine's load class in whole-model runner verdicts (floor.machine_load, the `load`
provider option): a verdict measured on a busy machine never decides on a quiet one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fusegraph.onnx import floor
from fusegraph.onnx.options import ProviderOptions

REAL_MACHINE_LOAD = floor.machine_load  # conftest pins the class for every other test


@pytest.mark.parametrize(("loadavg", "cores", "want"), [
    (0.0, 2, "quiet"), (0.99, 2, "quiet"), (1.0, 2, "busy"), (5.5, 2, "busy"), (3.9, 8, "quiet"), (4.0, 8, "busy"),
])
def test_machine_load_reads_the_run_queue_per_usable_core(monkeypatch: pytest.MonkeyPatch, loadavg: float,
                                                          cores: int, want: str) -> None:
    from fusegraph.select import device_id

    monkeypatch.setattr(os, "getloadavg", lambda: (loadavg, 0.0, 0.0))
    monkeypatch.setattr(device_id, "usable_cores", lambda: cores)
    assert REAL_MACHINE_LOAD() == want


def test_machine_load_without_a_load_average_is_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> tuple[float, float, float]:
        raise OSError("getloadavg unavailable")

    monkeypatch.setattr(os, "getloadavg", missing)
    assert REAL_MACHINE_LOAD() == "quiet"


def test_a_busy_verdict_does_not_decide_on_a_quiet_machine(tmp_path: Path) -> None:
    busy = ProviderOptions.parse({"cache_dir": str(tmp_path), "runners": "ort-nospin", "load": "busy"})
    quiet = ProviderOptions.parse({"cache_dir": str(tmp_path), "runners": "ort-nospin", "load": "quiet"})
    won = floor.Verdict(False, 4.0, 10.0, "measured", runner="ort-nospin")
    cache = floor.cache_for(busy, "cpu[test x2]")
    cache.record("model-a", won)
    cache.flush()
    assert floor.cache_for(busy, "cpu[test x2]").lookup("model-a") is not None
    assert floor.cache_for(quiet, "cpu[test x2]").lookup("model-a") is None  # measured again there


def test_load_class_keys_only_runner_verdicts(tmp_path: Path) -> None:
    """Without whole-model runners the class is not in the key: unit verdicts stay shared."""
    off = {"cache_dir": str(tmp_path), "runners": "off"}
    a = floor.cache_for(ProviderOptions.parse({**off, "load": "busy"}), "cpu[test x2]")
    b = floor.cache_for(ProviderOptions.parse({**off, "load": "quiet"}), "cpu[test x2]")
    assert a.settings == b.settings and "load=" not in a.settings
    on = {"cache_dir": str(tmp_path), "runners": "ort-nospin"}
    c = floor.cache_for(ProviderOptions.parse({**on, "load": "busy"}), "cpu[test x2]")
    assert "load=busy" in c.settings


def test_auto_reads_the_class_when_the_key_is_made(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(floor, "machine_load", lambda: "busy")
    cache = floor.cache_for(ProviderOptions.parse({"cache_dir": str(tmp_path)}), "cpu[test x2]")
    assert "load=busy" in cache.settings


@pytest.mark.parametrize(("raw", "want"), [("auto", "auto"), ("QUIET", "quiet"), (" busy ", "busy")])
def test_load_option(raw: str, want: str) -> None:
    assert ProviderOptions.parse({"load": raw}).load == want


def test_load_option_refuses_other_values() -> None:
    with pytest.raises(ValueError, match="load='sometimes'"):
        ProviderOptions.parse({"load": "sometimes"})


def test_a_session_reads_the_class_once_and_reports_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import numpy as np
    from onnx import TensorProto, helper

    from fusegraph.onnx import InferenceSession

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    reads = []
    monkeypatch.setattr(floor, "machine_load", lambda: reads.append(1) or "busy")
    sess = InferenceSession(model, providers=["FusegraphExecutionProvider"],
                            provider_options=[{"cache_dir": str(tmp_path), "floor": "off"}])
    assert sess.get_provider_options()["FusegraphExecutionProvider"]["load"] == "busy"
    assert len(reads) == 1
    x = np.random.default_rng().standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], np.maximum(x, 0))
