"""An attention whose query or key is computed by a matmul with a batch-broadcast weight:
IREE 3.13 compiled these graphs and returned wrong numbers (relative errors 0.07-0.7; fuzz
seed 11681 of a local 2,911-graph run on commit 66a0ea2: sdpa -> matmul -> tanh -> sdpa ->
rmsnorm, minimized to a[1,2,5,2] @ w[1,1,2,7] as the query). A weight not broadcast, or the
product as the value, was exact. Fixed by fencing a query or key computed by a contraction
(FusionGuards.attention_operand_from_a_contraction). Compared with the float64 reference;
torch runs the same graphs as a control."""

from __future__ import annotations

import numpy as np
import pytest
from reference_checks import agrees_with_reference

import fusegraph as fg
from fusegraph.dtypes import DataType

pytestmark = pytest.mark.usefixtures("own_cache")


def _graph(case: str) -> fg.Graph:
    g = fg.Graph(f"attention_operand_{case}", io_data_type=DataType.FLOAT)
    if case == "projection":  # a transformer's: x @ Wq (2-D), split into heads, then attention
        x = g.tensor("x", [2, 6, 16])
        q = g.transpose(g.reshape(g.matmul(x, g.tensor("wq", [16, 16])), [2, 6, 2, 8]), [0, 2, 1, 3])
        k, v = g.tensor("k", [2, 2, 6, 8]), g.tensor("v", [2, 2, 6, 8])
        o = g.sdpa(q, k, v)
    else:
        kk, d = (8, 16) if case == "wide" else (2, 7)
        batch_w = [1, 2] if case == "weight_not_broadcast" else [1, 1]
        c = g.matmul(g.tensor("a", [1, 2, 5, kk]), g.tensor("w", [*batch_w, kk, d]))
        q, k, v = (g.tensor(n, [1, 2, 5, d]) for n in "qkv")
        if case == "as_key":
            k = c
        elif case == "as_value":
            v = c
        else:
            q = g.tanh(c) if case == "seed_11681" else c
        o = g.sdpa(q, k, v, attn_scale=0.5)
    o.set_name("o").set_output(True)
    return g.validate()


CASES = ["seed_11681", "as_query", "wide", "as_key", "projection", "weight_not_broadcast", "as_value"]


@pytest.mark.parametrize("case", CASES)
def test_fuzz_iree_attention_operand_from_a_matmul(case: str, rng: np.random.Generator) -> None:
    agrees_with_reference(_graph(case), "iree", rng)


@pytest.mark.parametrize("case", ["seed_11681", "projection"])
def test_fuzz_attention_operand_from_a_matmul_on_torch(case: str, rng: np.random.Generator) -> None:
    agrees_with_reference(_graph(case), "torch", rng)
