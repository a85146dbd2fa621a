"""The fuzzer's random graphs through the border-reshape folding (fusegraph/regions/views.py):
wherever it folds, the folded graph on the float64 reference engine, fed and read through
views by ``FoldedPlan``, must give the original graph's answer on fresh random data. The
GPU front doors run kernel engines on folded region graphs; this checks the transformation
itself on every kind of graph the fuzzer draws (reshapes are among its ops), and that
enough of them fold for the check to mean something."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fuzz_graphs import draw_graph

from fusegraph.reference.inputs import random_inputs
from fusegraph.regions.views import FoldedPlan, fold_border_reshapes

EXAMPLES = 600  # ~2-3% of the fuzzer's graphs have a border reshape to fold
SEEN: Counter[str] = Counter()


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def _fold_and_compare(data: st.DataObject, seed: int) -> None:
    g, _ = draw_graph(data.draw, "reference")
    SEEN["graphs"] += 1
    transposes = data.draw(st.booleans())  # the ONNX door also folds output transposes
    folded = fold_border_reshapes(g, transposes=transposes)
    if folded is None:
        return
    SEEN["folded"] += 1
    SEEN["permuted"] += len(folded.permuted)
    inputs = random_inputs(g, np.random.default_rng(seed))
    want = g.build(engine="reference").execute(dict(inputs))
    got = FoldedPlan(g, folded, folded.graph.build(engine="reference")).execute(dict(inputs))
    assert set(got) == set(want)
    for name, w in want.items():
        w64, g64 = np.asarray(w, np.float64), np.asarray(got[name], np.float64)
        assert g64.shape == w64.shape, (name, g64.shape, w64.shape)
        assert np.array_equal(np.isnan(g64), np.isnan(w64)), name
        ok = ~np.isnan(w64)
        scale = max(float(np.abs(w64[ok]).max(initial=0.0)), 1e-30)
        assert float(np.abs(g64[ok] - w64[ok]).max(initial=0.0)) <= 1e-6 * scale, (name, g.to_json(indent=1))


def test_folded_graphs_give_the_originals_answer() -> None:
    _fold_and_compare()
    print(dict(SEEN))
    assert SEEN["graphs"] >= EXAMPLES  # (hypothesis may draw a few more than it keeps)
    assert SEEN["folded"] >= 12, dict(SEEN)  # the check ran on enough folded graphs
