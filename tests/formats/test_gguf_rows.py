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
    runs = rm.rows("x", rm.tagged("w1")[perm], rm.positions("w1")[perm])
    assert [(name, rows.tolist()) for name, rows in runs] == [("w1", perm.tolist())]


def test_llamas_query_permutation_is_followed_through_reshapes():
    heads, n, k = 4, 32, 64
    rm = row_map((n, k))

    def permute(w):  # convert_hf_to_gguf's LlamaModel.permute
        return w.reshape(heads, 2, n // heads // 2, k).swapaxes(1, 2).reshape(n, k)

    expected = permute(torch.arange(n, dtype=torch.float64)[:, None].expand(n, k))[:, 0]
    runs = rm.rows("x", permute(rm.tagged("w0")), permute(rm.positions("w0")))
    assert [(name, rows.tolist()) for name, rows in runs] == [("w0", expected.long().tolist())]


def test_stacked_weights_give_one_run_each_in_output_order():
    rm = row_map((3, 32), (3, 32))
    def stack(index):  # [2, 3, 32], as experts are stacked
        return torch.stack([index("w1"), index("w0")])

    runs = rm.rows("x", stack(rm.tagged), stack(rm.positions))
    assert [(name, rows.tolist()) for name, rows in runs] == [("w1", [0, 1, 2]), ("w0", [0, 1, 2])]


@pytest.mark.parametrize("change", [
    lambda t: t.flip(-1),  # columns reordered
    lambda t: t.t().contiguous(),  # transposed
    lambda t: t * 2,  # values scaled
    lambda t: t + 1,  # values shifted
    lambda t: (t + t.roll(1, 0)) / 2,  # rows mixed
    lambda t: t.to(torch.float32).to(torch.float64),  # precision lost
    lambda t: t.reshape(128, 32),  # rows split
])
def test_a_transform_that_is_not_a_row_reordering_is_refused(change):
    rm = row_map((64, 64))
    with pytest.raises(InputError, match="only place its blocks on whole rows"):
        rm.rows("blk.0.x.weight", change(rm.tagged("w0")), change(rm.positions("w0")))


def test_the_index_tensors_of_a_weight_take_no_memory_until_a_transform_copies_them():
    rm = row_map((1 << 20, 1 << 16))  # 2**36 elements: 512 GiB were they real fp64 tensors
    assert [(name, len(rows)) for name, rows in rm.rows("x", rm.tagged("w0"), rm.positions("w0"))] == [("w0", 1 << 20)]
