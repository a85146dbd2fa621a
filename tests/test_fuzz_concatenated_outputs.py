"""A graph output concatenated in a layout other than the one its producer stored:
iree-compile 3.13 failed these valid graphs ("'vector.store' op write affecting operations on
global resources are restricted to workgroup distributed contexts"; fuzz seed 48897765 of the
9,383-graph run on commit b1b85e2: x[2,1,1,5] -> conv (stored channels-last; a graph output)
-> concatenated with x -> batch norm). The permute back to NCHW was one dispatch writing both
the output and the concatenation's slice, the second store outside the distributed loops.
Fixed by concatenating a fenced copy of any graph output (FusionGuards.concatenates_an_output).
Compared with the float64 reference; torch runs the same graphs as a control."""

from __future__ import annotations

import numpy as np
import pytest
from reference_checks import agrees_with_reference

import fusegraph as fg
from fusegraph.dtypes import DataType

pytestmark = pytest.mark.usefixtures("own_cache")



def _graph(reader: str, output: bool) -> fg.Graph:
    g = fg.Graph(f"concat_output_{reader}", io_data_type=DataType.FLOAT)
    x = g.tensor("x", [2, 1, 1, 5])
    w = g.tensor("w", [2, 1, 2, 1])
    y = g.conv_fprop(x, w, pre_padding=[1, 0], post_padding=[1, 0], stride=[1, 1], dilation=[2, 1])
    if output:
        y.set_name("conv").set_output(True)
    c = g.concatenate([x, y], axis=1)
    if reader == "relu":
        z = g.relu(c)
    else:  # seed 48897765
        z, _, _ = g.batchnorm(c, g.tensor("s", [3]), g.tensor("b", [3]), epsilon=1e-3)
    z.set_name("z").set_output(True)
    return g.validate()


@pytest.mark.parametrize("output", [True, False], ids=["output", "virtual"])
@pytest.mark.parametrize("reader", ["relu", "batchnorm"])
def test_fuzz_iree_concatenated_output(reader: str, output: bool, rng: np.random.Generator) -> None:
    agrees_with_reference(_graph(reader, output), "iree", rng)


def test_fuzz_concatenated_output_on_torch(rng: np.random.Generator) -> None:
    agrees_with_reference(_graph("batchnorm", True), "torch", rng)
