"""Placing int4q's rows where llama.cpp's converter puts them: any reordering or stacking of whole
rows is followed; anything that touches columns or values is refused."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.errors import InputError
from quantizer.formats.gguf.assemble import QuantizedWeight, RowMap
from quantizer.formats.gguf.blocks import Q4_0


def row_map(*shapes):
    return RowMap({f"w{i}": QuantizedWeight(s, Q4_0, lambda: None) for i, s in enumerate(shapes)})


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 40), k=st.sampled_from([32, 64]), seed=st.integers(0, 2**31 - 1))
def test_a_row_permutation_of_one_weight_is_followed(n, k, seed):
    rm = row_map((7, k), (n, k))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    assert [(name, rows.tolist()) for name, rows in rm.rows("x", rm.index("w1")[perm])] == [("w1", perm.tolist())]


def test_stacked_weights_give_one_run_each_in_output_order():
    rm = row_map((3, 32), (3, 32))
    stacked = torch.stack([rm.index("w1"), rm.index("w0")])  # [2, 3, 32], as experts are stacked
    assert [(name, rows.tolist()) for name, rows in rm.rows("x", stacked)] == [("w1", [0, 1, 2]), ("w0", [0, 1, 2])]


@pytest.mark.parametrize("change", [
    lambda t: t.flip(-1),  # columns reordered
    lambda t: t.t().contiguous(),  # transposed
    lambda t: t.to(torch.float32) * 2,  # values changed
])
def test_a_transform_that_is_not_a_row_reordering_is_refused(change):
    rm = row_map((64, 64))
    with pytest.raises(InputError, match="only place its blocks on whole rows"):
        rm.rows("blk.0.x.weight", change(rm.index("w0")).to(torch.float64))
