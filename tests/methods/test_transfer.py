"""A quantized source's grid onto an output's storage: bit for bit where the storage holds its
scales and zeros, the same codes on the nearest stored values where it does not, and nothing where
the output's groups cut across the source's."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.formats.gguf.blocks import TYPES
from quantizer.methods.grid import BF16, INTEGER_ZERO
from quantizer.methods.transfer import SourceGrid, integer_zero, transfer_grid

Q4_0, Q4_1, Q4_K = (TYPES[n].storage for n in ("Q4_0", "Q4_1", "Q4_K"))


def source(seed: int, rows: int, groups: int, group: int, symmetric: bool, scale_dtype=torch.float16,
           order: torch.Tensor | None = None) -> SourceGrid:
    gen = torch.Generator().manual_seed(seed)
    k = groups * group
    codes = torch.randint(0, 16, (rows, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(rows, groups, generator=gen) * 0.1 + 1e-3).to(scale_dtype).to(torch.float64)
    points = torch.full((rows, groups), 8) if symmetric else torch.randint(1, 16, (rows, groups), generator=gen)
    g = torch.arange(k) // group
    return SourceGrid(codes, scale, integer_zero(points, scale), g if order is None else g[order])


shapes = dict(seed=st.integers(0, 2**16), rows=st.integers(1, 9), groups=st.integers(1, 4),
              group=st.sampled_from([32, 64, 128]))


@settings(max_examples=40, deadline=None)
@given(**shapes)
def test_a_symmetric_fp16_grid_is_q4_0_and_the_gptq_exports_bit_for_bit(seed, rows, groups, group):
    src = source(seed, rows, groups, group, True)
    for storage, symmetric in ((Q4_0, True), (INTEGER_ZERO, True), (INTEGER_ZERO, False), (Q4_1, False)):
        moved = transfer_grid(src, 32, symmetric, storage)
        assert moved.exact and torch.equal(moved.quantized.codes, src.codes)
        assert torch.equal(moved.quantized.dequantize(torch.float32), src.dequantize())


@settings(max_examples=40, deadline=None)
@given(**shapes)
def test_an_asymmetric_grid_keeps_its_codes_and_moves_only_as_far_as_fp16_minimums(seed, rows, groups, group):
    src = source(seed, rows, groups, group, False)
    moved = transfer_grid(src, 32, False, Q4_1)
    got, want = moved.quantized.dequantize(torch.float32), src.dequantize()
    assert torch.equal(moved.quantized.codes, src.codes)
    assert moved.exact == torch.equal(got, want)
    minimum = (src.zero - 8 * src.scale).abs().max().item()
    assert (got - want).abs().max().item() <= minimum * 2**-11 + 1e-7


@settings(max_examples=30, deadline=None)
@given(**shapes)
def test_fp16_scales_into_bf16_are_exact_only_where_bf16_holds_them(seed, rows, groups, group):
    src = source(seed, rows, groups, group, True)
    moved = transfer_grid(src, group, True, BF16)
    assert moved.exact == torch.equal(src.scale.to(torch.bfloat16).double(), src.scale)
    bf16 = source(seed, rows, groups, group, True, torch.bfloat16)
    assert transfer_grid(bf16, group, True, BF16).exact


def test_output_groups_that_cut_across_source_groups_do_not_carry():
    order = torch.randperm(256, generator=torch.Generator().manual_seed(0))
    assert transfer_grid(source(0, 4, 2, 128, True, order=order), 32, True, Q4_0) is None  # act-order
    assert transfer_grid(source(0, 4, 8, 16, True), 32, True, Q4_0) is None  # groups of 16
    assert transfer_grid(source(0, 4, 1, 256, False), 32, True, Q4_0) is None  # nonzero zeros, symmetric type
    assert transfer_grid(source(0, 4, 2, 128, True), 32, True, Q4_K) is None  # shared super-block units


def test_act_order_whose_groups_are_runs_of_32_still_carries_exactly():
    blocks = torch.randperm(8, generator=torch.Generator().manual_seed(1))
    order = (blocks.unsqueeze(1) * 32 + torch.arange(32)).reshape(-1)  # whole runs of 32 permuted
    src = source(2, 3, 2, 128, True, order=order)
    moved = transfer_grid(src, 32, True, Q4_0)
    assert moved.exact and torch.equal(moved.quantized.dequantize(torch.float32), src.dequantize())
