"""Correlated rounding: codes move off their nearest grid point only where that lowers the
block objective, stay on their grids, and do nothing where the inputs are uncorrelated."""

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.methods.codebook import IQ4_LEVELS
from quantizer.methods.grid import Storage, quantize_groupwise
from quantizer.methods.rounding import block_objective, refine_codes
from quantizer.methods.weighted import BlockSecondMoment


def problem(rows, k, seed, correlated=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, k, generator=g) * 0.05
    mix = torch.randn(k, k, generator=g) if correlated else torch.eye(k)
    x = torch.randn(512, k, generator=g) @ mix * torch.logspace(-1, 1, k)[torch.randperm(k, generator=g)]
    acc = BlockSecondMoment(k)
    acc.add(x[:300])
    acc.add(x[300:])
    return w, acc


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), blocks=st.integers(1, 4), seed=st.integers(0, 2**16),
       grid=st.sampled_from([(16, False, 4), (32, True, 4), (32, False, 5), (16, True, 6)]))
def test_refined_codes_stay_on_their_grids_and_never_raise_a_rows_objective(rows, blocks, seed, grid):
    group, symmetric, bits = grid
    w, acc = problem(rows, 64 * blocks, seed)
    storage = Storage(torch.float16, "min" if not symmetric else "integer", signed_scale=symmetric, bits=bits)
    nearest = quantize_groupwise(w, group, symmetric, storage=storage, column_weights=acc.value)
    refined = refine_codes(w, nearest, acc.blocks)
    assert torch.equal(refined.scale, nearest.scale) and torch.equal(refined.zero, nearest.zero)
    assert refined.bits == bits and int(refined.codes.max()) < 2**bits
    assert int((refined.codes.int() - nearest.codes.int()).abs().max()) <= 4  # one step per sweep at most
    before, after = (block_objective(w, q, acc.blocks) for q in (nearest, refined))
    assert bool((after <= before * (1 + 1e-5) + 1e-12).all())


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 40), blocks=st.integers(1, 4), seed=st.integers(0, 2**16),
       superblock=st.sampled_from([None, 8]))
def test_codes_on_a_table_of_levels_move_to_neighbouring_levels_and_never_raise_a_rows_objective(
        rows, blocks, seed, superblock):
    w, acc = problem(rows, 256 * blocks, seed)
    storage = Storage(torch.float16, "float", 32, signed_scale=True, superblock=superblock, codebook=IQ4_LEVELS)
    nearest = quantize_groupwise(w, 32, True, storage=storage, column_weights=acc.value)
    refined = refine_codes(w, nearest, acc.blocks)
    assert refined.levels == IQ4_LEVELS and torch.equal(refined.scale, nearest.scale)
    assert int((refined.codes.int() - nearest.codes.int()).abs().max()) <= 4 and int(refined.codes.max()) < 16
    before, after = (block_objective(w, q, acc.blocks) for q in (nearest, refined))
    assert bool((after <= before * (1 + 1e-5) + 1e-12).all())
    assert float(after.sum()) < 0.95 * float(before.sum())  # correlated inputs: the descent finds moves


def test_correlated_inputs_lower_the_objective_and_uncorrelated_ones_keep_the_nearest_codes():
    w, acc = problem(64, 256, 7)
    storage = Storage(torch.float16, "integer", signed_scale=True)
    nearest = quantize_groupwise(w, 32, True, storage=storage, column_weights=acc.value)
    refined = refine_codes(w, nearest, acc.blocks)
    assert block_objective(w, refined, acc.blocks).sum() < 0.9 * block_objective(w, nearest, acc.blocks).sum()
    w, acc = problem(64, 256, 7, correlated=False)
    acc.sum *= torch.eye(acc.sum.shape[-1], dtype=acc.sum.dtype)  # exactly uncorrelated columns
    nearest = quantize_groupwise(w, 32, True, storage=storage)
    assert torch.equal(refine_codes(w, nearest, acc.blocks).codes, nearest.codes)


def test_the_second_moment_blocks_are_the_inputs_gram_blocks_and_its_diagonal_the_mean_square():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 96, generator=g)
    acc = BlockSecondMoment(96)
    acc.add(x[:1])
    acc.add(x[1:])
    flat = x.reshape(-1, 96).double()
    full = flat.T @ flat / flat.shape[0]
    assert acc.blocks.shape == (3, 32, 32) and acc.n == 150
    for i in range(3):
        torch.testing.assert_close(acc.blocks[i].double(), full[32 * i:32 * i + 32, 32 * i:32 * i + 32], rtol=1e-5,
                                   atol=1e-6)
    torch.testing.assert_close(acc.value.double(), flat.pow(2).mean(0), rtol=1e-5, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 70), groups=st.integers(1, 3), b=st.sampled_from([1, 16, 32, 64]),
       levels=st.sampled_from([tuple(range(16)), tuple(range(32)), tuple(range(64)), IQ4_LEVELS]),
       seed=st.integers(0, 2**16))
def test_the_native_descent_gives_the_torch_loops_bits(rows, groups, b, levels, seed):
    from quantizer.methods import rounding

    native = rounding.KERNEL.native()
    if native is None:
        pytest.skip("no native library here")
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(groups, b, b, generator=g)
    blocks = (mix @ mix.transpose(1, 2) / b).contiguous()
    codes = torch.randint(0, len(levels), (rows, groups, b), generator=g, dtype=torch.int16)
    step = (torch.rand(rows, groups, b, generator=g) - 0.3) * 0.1  # IQ4's scales take either sign
    pull = torch.einsum("gij,ngj->ngi", blocks, torch.randn(rows, groups, b, generator=g) * 0.05).contiguous()
    results = []
    for kernel in (native, rounding.torch_descend):
        c, p = codes.clone(), pull.clone()
        kernel(c, step, p, blocks, *rounding.step_tables(levels), rounding.SWEEPS)
        results.append((c, p))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_a_descent_kernel_that_computes_wrongly_is_not_used(caplog):
    from quantizer.methods import rounding

    def wrong(codes, step, pull, blocks, rise, fall, sweeps):
        rounding.torch_descend(codes, step, pull, blocks, rise, fall, sweeps)
        codes[0, 0, 0] = rise.numel() - 1 - codes[0, 0, 0]

    with caplog.at_level(logging.WARNING):
        assert rounding.KERNEL.checked(wrong) is None
    assert "correlated rounding gives other results" in caplog.text
