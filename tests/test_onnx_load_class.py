"""The machine's load class (floor.machine_load, the `load` provider option): every verdict
records the class it was measured in, the verdict key does not hold it (a model is evaluated
once per machine and device), and a whole-model runner's win applies in its own class only
(direct.as_allowed): in the other one the caller's session runs the model, unmeasured again."""

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


def test_a_busy_verdict_is_found_on_a_quiet_machine_and_its_runner_set_aside(tmp_path: Path) -> None:
    from fusegraph.onnx import direct

    busy = ProviderOptions.parse({"cache_dir": str(tmp_path), "runners": "ort-nospin", "load": "busy"})
    quiet = ProviderOptions.parse({"cache_dir": str(tmp_path), "runners": "ort-nospin", "load": "quiet"})
    won = floor.Verdict(False, 4.0, 10.0, "measured", runner="ort-nospin")
    cache = floor.cache_for(busy, "cpu[test x2]")
    cache.record("model-a", won)
    cache.flush()
    seen = floor.cache_for(quiet, "cpu[test x2]").lookup("model-a")  # one key: not measured again
    assert seen is not None and seen.load == "busy" and seen.runner == "ort-nospin"
    assert "measured on a busy machine" in seen.describe()
    assert direct.as_allowed(seen, None, "busy").runner == "ort-nospin"
    there = direct.as_allowed(seen, None, "quiet")
    assert there.runner == "" and "on a quiet one the caller's session" in there.why
    assert direct.as_allowed(floor.Verdict(False, 4.0, 10.0, runner="ort-nospin"), None, "quiet").runner == "ort-nospin"


def test_the_load_class_is_never_in_the_key(tmp_path: Path) -> None:
    for runners in ("off", "ort-nospin"):
        base = {"cache_dir": str(tmp_path), "runners": runners}
        a = floor.cache_for(ProviderOptions.parse({**base, "load": "busy"}), "cpu[test x2]")
        b = floor.cache_for(ProviderOptions.parse({**base, "load": "quiet"}), "cpu[test x2]")
        assert a.settings == b.settings and "load=" not in a.settings
        assert (a.load, b.load) == ("busy", "quiet")


def test_auto_reads_the_class_for_the_verdicts_it_records(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(floor, "machine_load", lambda: "busy")
    cache = floor.cache_for(ProviderOptions.parse({"cache_dir": str(tmp_path)}), "cpu[test x2]")
    assert cache.load == "busy" and "load=" not in cache.settings
    cache.record("m", floor.Verdict(False, 1.0, 2.0, "measured"))
    cache.flush()
    got = floor.cache_for(ProviderOptions.parse({"cache_dir": str(tmp_path), "load": "quiet"}), "cpu[test x2]").lookup("m")
    assert got is not None and got.load == "busy"


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
