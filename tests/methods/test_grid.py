import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.methods.error_stats import ErrorStats
from quantizer.methods.grid import (
    BF16,
    INTEGER_ZERO,
    Storage,
    quantize_groupwise,
    round_to_grid,
    weighted_grid_search,
)

SIGNED = Storage(torch.float16, "integer", signed_scale=True)

BF16_EPS = 2.0**-8


def grid_of(gq):
    """Every group's 16 grid points, fp32 [N, G, 16]."""
    j = torch.arange(16, dtype=torch.float32) - 8.0
    return j * gq.scale.float().unsqueeze(-1) + gq.zero.float().unsqueeze(-1)


def random_weight(n, k, seed, spread=0.05):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * spread + torch.randn(n, 1, generator=g) * spread
    return w.to(torch.bfloat16)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), group=st.sampled_from([32, 64, 128]), sym=st.booleans())
def test_every_code_is_the_nearest_grid_point_of_the_stored_parameters(seed, group, sym):
    w = random_weight(8, 256, seed)
    gq = quantize_groupwise(w, group, symmetric=sym)
    grid = grid_of(gq)  # [N, G, 16]
    x = w.float().reshape(8, -1, group, 1)
    dist = (x - grid.unsqueeze(2)).abs()  # [N, G, group, 16]
    chosen = dist.gather(-1, gq.codes.reshape(8, -1, group, 1).long()).squeeze(-1)
    assert torch.all(chosen <= dist.min(dim=-1).values + 1e-7)


def test_every_element_is_within_half_a_step_plus_bf16_rounding():
    w = random_weight(64, 512, 1)
    gq = quantize_groupwise(w, 64)
    err = (gq.dequantize() - w.float()).reshape(64, 8, 64).abs()
    s, z = gq.scale.float().unsqueeze(-1), gq.zero.float().unsqueeze(-1)
    bound = s / 2 + BF16_EPS * (z.abs() + 8 * s)
    assert torch.all(err <= bound)
    assert torch.all(gq.codes <= 15)


def test_group_extremes_are_reproduced_to_bf16_precision():
    w = random_weight(16, 128, 2)
    gq = quantize_groupwise(w, 32)
    g = w.float().reshape(16, 4, 32)
    codes = gq.codes.reshape(16, 4, 32)
    assert torch.all(codes.gather(-1, g.argmin(-1, keepdim=True)) == 0)
    assert torch.all(codes.gather(-1, g.argmax(-1, keepdim=True)) == 15)
    deq = gq.dequantize().reshape(16, 4, 32)
    tol = BF16_EPS * (g.abs().amax(-1) + 8 * gq.scale.float())
    assert torch.all((deq.amin(-1) - g.amin(-1)).abs() <= tol)
    assert torch.all((deq.amax(-1) - g.amax(-1)).abs() <= tol)


def test_exact_grid_values_quantize_without_error():
    codes = torch.randint(0, 16, (4, 64), generator=torch.Generator().manual_seed(4))
    codes[:, 0], codes[:, 1] = 0, 15  # pin each group's extremes to the grid ends
    codes[:, 32], codes[:, 33] = 0, 15
    w = ((codes.float() - 8) * 0.25 + 1.0).to(torch.bfloat16)
    gq = quantize_groupwise(w, 32)
    assert torch.equal(gq.dequantize(torch.bfloat16), w)


def test_constant_group_gets_code_8_and_is_exact():
    w = torch.full((16, 64), 0.125, dtype=torch.bfloat16)
    w[:, 32:] = -3.0
    gq = quantize_groupwise(w, 32)
    assert torch.all(gq.codes == 8)
    assert torch.equal(gq.dequantize(torch.bfloat16), w)


def test_symmetric_grid_has_zero_offset_and_covers_the_group():
    w = random_weight(16, 128, 5)
    gq = quantize_groupwise(w, 64, symmetric=True)
    assert torch.all(gq.zero == 0)
    g = w.float().reshape(16, 2, 64)
    s = gq.scale.float()
    lo, hi = g.amin(-1), g.amax(-1)
    assert torch.all(-8 * s <= lo + BF16_EPS * lo.abs())
    assert torch.all(7 * s >= hi - BF16_EPS * hi.abs())


@pytest.mark.parametrize("sym", [False, True])
def test_clip_search_never_increases_squared_error(sym):
    w = random_weight(32, 256, 6)
    w[:, 3] *= 8  # outliers make clipping worthwhile
    base = quantize_groupwise(w, 64, symmetric=sym)
    searched = quantize_groupwise(w, 64, symmetric=sym, clip_search=True)
    e_base = (base.dequantize() - w.float()).pow(2).reshape(32, 4, 64).sum(-1)
    e_search = (searched.dequantize() - w.float()).pow(2).reshape(32, 4, 64).sum(-1)
    assert torch.all(e_search <= e_base + 1e-9)
    assert e_search.sum() < e_base.sum()


def test_group_size_must_divide_k():
    with pytest.raises(ValueError, match="multiple of group size"):
        quantize_groupwise(torch.zeros(16, 96), 64)


def test_error_stats_snr_and_max_error():
    ref = torch.ones(10, 10)
    stats = ErrorStats()
    stats.add(ref[:5], ref[:5] + 0.1)
    stats.add(ref[5:], ref[5:])
    assert stats.snr_db == pytest.approx(10 * math.log10(100 / (50 * 0.01)), rel=1e-5)
    assert stats.max_abs_err == pytest.approx(0.1, rel=1e-5)
    exact = ErrorStats()
    exact.add(ref, ref)
    assert exact.as_dict()["snr_db"] is None


def weighted_error(w, gq, weights):
    return ((gq.dequantize() - w.float()).pow(2) * weights).sum().item()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), group=st.sampled_from([32, 64]), sym=st.booleans(),
       storage=st.sampled_from([BF16, INTEGER_ZERO, SIGNED]))
def test_the_weighted_search_is_never_worse_than_min_max_on_its_own_objective(seed, group, sym, storage):
    w = random_weight(16, 128, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    weights = torch.rand(128, generator=gen).pow(4) * 10  # a few columns matter much more
    plain = quantize_groupwise(w, group, symmetric=sym, storage=storage)
    searched = quantize_groupwise(w, group, symmetric=sym, storage=storage, column_weights=weights)
    assert weighted_error(w, searched, weights) <= weighted_error(w, plain, weights) * (1 + 1e-6)
    g = w.float().reshape(16, 128 // group, group)  # codes are the nearest points of the stored grid
    assert torch.equal(searched.codes.reshape(g.shape), round_to_grid(g, searched.scale, searched.zero))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_a_signed_symmetric_grid_gives_the_largest_magnitude_code_0_and_an_eighth_of_it_a_step(seed):
    w = random_weight(16, 64, seed).float()
    gq = quantize_groupwise(w, 32, symmetric=True, storage=SIGNED)
    g = w.reshape(16, 2, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    extreme = torch.where(hi > -lo, hi, lo)  # a tie in magnitude goes to the negative side
    torch.testing.assert_close(gq.scale, (-extreme / 8).to(torch.float16).float(), rtol=0, atol=0)
    codes = gq.codes.reshape(16, 2, 32)
    assert bool((codes[g == extreme.unsqueeze(-1)] == 0).all())


def test_the_weighted_search_gains_where_columns_differ():
    w = random_weight(64, 256, 7)
    weights = torch.ones(256)
    weights[::16] = 100.0
    plain = quantize_groupwise(w, 64)
    searched = quantize_groupwise(w, 64, column_weights=weights)
    assert weighted_error(w, searched, weights) < 0.9 * weighted_error(w, plain, weights)


def test_8_bit_channels_round_to_nearest_on_a_covering_grid():
    from quantizer.methods.grid import quantize_per_channel

    w = random_weight(32, 96, 3).float()
    q = quantize_per_channel(w)
    s = q.scale.float()
    assert q.codes.dtype == torch.int8 and q.scale.shape == (32, 1)
    assert ((q.dequantize() - w).abs() <= s / 2 + 1e-6 * w.abs() + 1e-9).all()
    assert (w.abs().amax(1, keepdim=True) <= 127 * s * (1 + 2**-7)).all()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale_exp=st.integers(-12, 3), positive=st.booleans(), bits=st.sampled_from([4, 5]))
def test_super_block_grids_are_6_bit_multiples_of_two_fp16_units_with_lowest_point_at_most_0(seed, scale_exp, positive,
                                                                                             bits):
    from quantizer.methods.superblock import superblock_grids

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(3, 256, generator=gen) * 2.0**scale_exp
    w = w.abs() if positive else w
    storage = Storage(torch.float16, "min", superblock=8, bits=bits)
    mid = 2 ** (bits - 1)
    free = quantize_groupwise(w, 32, storage=Storage(torch.float32, bits=bits))
    plain = superblock_grids(free.scale, free.zero, storage, False)
    scale, zero = superblock_grids(free.scale, free.zero, storage, False, w.reshape(3, 8, 32))
    for block in torch.cat([scale, mid * scale - zero, plain[0], mid * plain[0] - plain[1]]).reshape(-1, 8):
        assert bool((block >= 0).all())
        units = [(block.max() / top).to(torch.float16).to(torch.float64) for top in range(63, 0, -1)]
        assert block.max() == 0 or any(bool((block / u == (block / u).round()).all()) and (block / u).max() <= 63
                                       for u in units if u > 0)
    got = quantize_groupwise(w, 32, storage=storage)  # K-quant grids are searched, without an importance matrix
    searched = weighted_grid_search(w.reshape(3, 8, 32), None, False, storage)
    assert torch.equal(got.scale, searched[0]) and torch.equal(got.zero, searched[1]) and got.bits == bits
    rel = (got.dequantize() - w).pow(2).sum() / w.pow(2).sum()
    assert rel < 0.02 / 4 ** (bits - 4)
    g = w.reshape(3, 8, 32)
    from quantizer.methods.codes import group_sq_error

    def error(s, z):
        return group_sq_error(g, round_to_grid(g, s, z, bits), s, z, bits=bits)

    assert bool((error(scale, zero) <= error(*plain)).all())  # the level search keeps the plain rounding's pair


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale_exp=st.integers(-12, 3), weighted=st.booleans())
def test_signed_super_block_grids_are_8_bit_levels_of_one_fp16_unit(seed, scale_exp, weighted):
    from quantizer.methods.superblock import superblock_grids

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(3, 512, generator=gen) * 2.0**scale_exp
    column_weights = torch.rand(512, generator=gen) if weighted else None
    storage = Storage(torch.float16, signed_scale=True, superblock=16, bits=6)
    got = quantize_groupwise(w, 16, symmetric=True, storage=storage, column_weights=column_weights)
    assert got.bits == 6 and bool((got.zero == 0).all()) and int(got.codes.max()) <= 63
    for block in got.scale.reshape(-1, 16):
        top = block[block.abs().argmax()]
        units = [(top / level).to(torch.float16).to(torch.float64) for level in range(-128, 128) if level]
        assert any(bool((block / u == (block / u).round()).all()) and -128 <= (block / u).min()
                   and (block / u).max() <= 127 for u in units if u != 0)
    free = quantize_groupwise(w, 16, symmetric=True, storage=Storage(torch.float32, signed_scale=True, bits=6))
    plain = superblock_grids(free.scale, free.zero, storage, True)
    assert bool((plain[0].reshape(-1, 16).abs().amax(-1) > 0).all())
    rel = (got.dequantize() - w).pow(2).sum() / w.pow(2).sum()
    assert rel < 2e-3


@pytest.mark.parametrize("storage, sym, group", [
    (BF16, False, 32), (BF16, True, 32), (INTEGER_ZERO, False, 32), (INTEGER_ZERO, True, 32),
    (Storage(torch.float16, "min", superblock=8), False, 32),
    (Storage(torch.float16, "min", superblock=8, bits=5), False, 32),
    (Storage(torch.float16, signed_scale=True, superblock=16, bits=6), True, 16)])
def test_row_chunks_give_the_same_grids_as_one_pass(monkeypatch, storage, sym, group):
    import quantizer.methods.grid as grid

    g = torch.Generator().manual_seed(3)
    w = torch.randn(37, 512, generator=g) * 0.02
    weights = torch.rand(512, generator=g)
    whole = [quantize_groupwise(w, group, sym, clip_search=True, storage=storage),
             quantize_groupwise(w, group, sym, storage=storage, column_weights=weights)]
    monkeypatch.setattr(grid, "SEARCH_CHUNK", 3 * 512)  # 3 rows a chunk, the last one short
    assert grid.row_chunks(37, 512)[-1] == slice(36, 39)
    chunked = [quantize_groupwise(w, group, sym, clip_search=True, storage=storage),
               quantize_groupwise(w, group, sym, storage=storage, column_weights=weights)]
    for a, b in zip(whole, chunked):
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale) and torch.equal(a.zero, b.zero)
