"""A norm over a single group (every statistic one value) whose result feeds a matmul or a
convolution: iree-compile 3.13 failed these valid graphs ("'iree_linalg_ext.map_store' op
write affecting operations on global resources are restricted to workgroup distributed
contexts"; fuzz seed 2 of the 9,383-graph run on commit b1b85e2: a layernorm of x[1,5,7,5]
-> sigmoid_backward / floor / tanh -> matmul). The normalization and the pack of the
contraction's operand were fused into the dispatch of the single-valued mean. Fixed by
fencing the norm's result (FusionGuards.one_group_into_a_contraction). Compared with the
float64 reference; torch runs the same graphs as a control, and two groups (which compiled
before) stay in as the case the rule leaves alone."""

from __future__ import annotations

import numpy as np
import pytest
from reference_checks import agrees_with_reference

import fusegraph as fg
from fusegraph.dtypes import DataType

pytestmark = pytest.mark.usefixtures("own_cache")



def _graph(case: str) -> fg.Graph:
    g = fg.Graph(f"one_group_{case}", io_data_type=DataType.FLOAT)
    n = 2 if case == "layernorm_two_groups" else 1
    if case.startswith("layernorm"):  # seed 2, minimized
        x = g.tensor("x", [n, 5, 7, 5])
        y, _, _ = g.layernorm(x, g.tensor("s", [1, 5, 7, 5]), g.tensor("b", [1, 5, 7, 5]), epsilon=1e-5)
        if case == "layernorm_floor":
            y = g.floor(y)
        out = g.matmul(y, g.tensor("w", [1, 1, 5, 7]))
    elif case == "layernorm_2d":
        x = g.tensor("x", [1, 12])
        y, _, _ = g.layernorm(x, g.tensor("s", [1, 12]), g.tensor("b", [1, 12]), epsilon=1e-5)
        out = g.matmul(y, g.tensor("w", [12, 4]))
    elif case.startswith("rmsnorm"):
        x = g.tensor("x", [1, 5, 7, 5])
        phase = "training" if case == "rmsnorm_training" else "inference"
        y, _ = g.rmsnorm(x, g.tensor("s", [1, 5, 7, 5]), epsilon=1e-5, phase=phase)
        out = g.matmul(g.tanh(y), g.tensor("w", [1, 1, 5, 7]))
    else:  # batchnorm of one channel into a convolution
        x = g.tensor("x", [2, 1, 6, 6], fg.strides_for([2, 1, 6, 6], "NHWC"))
        y, mean, _ = g.batchnorm(x, g.tensor("s", [1]), g.tensor("b", [1]), epsilon=1e-5)
        mean.set_output(True)
        w = g.tensor("w", [4, 1, 3, 3], fg.strides_for([4, 1, 3, 3], "KRSC"))
        out = g.conv_fprop(y, w, padding=[1, 1])
    out.set_name("y").set_output(True)
    return g.validate()


CASES = ["layernorm", "layernorm_floor", "layernorm_two_groups", "layernorm_2d", "rmsnorm",
         "rmsnorm_training", "batchnorm_conv"]


@pytest.mark.parametrize("case", CASES)
def test_fuzz_iree_one_group_norm_into_a_matmul(case: str, rng: np.random.Generator) -> None:
    agrees_with_reference(_graph(case), "iree", rng)


@pytest.mark.parametrize("case", ["layernorm", "rmsnorm", "batchnorm_conv"])
def test_fuzz_one_group_norm_into_a_matmul_on_torch(case: str, rng: np.random.Generator) -> None:
    agrees_with_reference(_graph(case), "torch", rng)
