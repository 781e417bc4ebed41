"""Non-linear grids (IQ4's table of levels): codes are the nearest levels, the search is never
worse than llama.cpp's own IQ4 search on the same objective, IQ4_XS scales are levels of one fp16
unit per super-block, and GPTQ solves on the table."""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.methods.codebook import IQ4_LEVELS, XS_SCALE_LEVELS, codebook_search, nearest_levels
from quantizer.methods.grid import Storage, quantize_groupwise

NL = Storage(torch.float16, signed_scale=True, codebook=IQ4_LEVELS)
XS = dataclasses.replace(NL, superblock=8)
TABLE = np.array(IQ4_LEVELS, dtype=np.float64)


def brute_nearest(x: np.ndarray) -> np.ndarray:
    """The code of the nearest level, the lower one on a tie."""
    return np.abs(x[..., None] - TABLE).argmin(-1)


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.one_of(st.floats(-400, 400, width=32), st.sampled_from(list((TABLE[1:] + TABLE[:-1]) / 2)),
                                 st.sampled_from(IQ4_LEVELS)), min_size=1, max_size=64))
def test_codes_are_the_nearest_levels_and_a_tie_takes_the_lower(values):
    x = torch.tensor(values, dtype=torch.float32)
    assert np.array_equal(nearest_levels(x, IQ4_LEVELS).numpy(), brute_nearest(x.double().numpy()))


def llama_iq4_nl_error(g: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per group, the weighted squared error of llama.cpp's IQ4_NL search (``quantize_row_iq4_nl_impl``,
    ntry 7) run on the weights ``w``: the extreme value at level -127 + t for t in -7..7, each
    scale refitted by least squares for its codes, the best stored as fp16 with its codes (or the
    nearest codes on it, whichever is closer)."""
    out = np.empty(g.shape[0])
    for i, (x, wx) in enumerate(zip(g, w)):
        top = x[np.abs(x).argmax()]
        if top == 0:
            out[i] = 0.0
            continue
        best_d, best = None, -1.0
        for inv in [-TABLE[0] / top] + [(t + TABLE[0]) / top for t in range(-7, 8)]:
            u = TABLE[brute_nearest(inv * x)]
            sumqx, sumq2 = (wx * u * x).sum(), (wx * u * u).sum()
            if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                best_d, best, codes = sumqx / sumq2, sumqx * sumqx / sumq2, u
        d = float(np.float16(best_d))
        out[i] = min((wx * (u * d - x) ** 2).sum() for u in (codes, TABLE[brute_nearest(x / d)]))
    return out


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale_exp=st.integers(-10, 3), weighted=st.booleans())
def test_the_iq4_nl_search_is_never_worse_than_llama_cpps_on_its_objective(seed, scale_exp, weighted):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 128, generator=gen) * 2.0 ** scale_exp
    column_weights = torch.rand(128, generator=gen) if weighted else torch.ones(128)
    gq = quantize_groupwise(w, 32, symmetric=True, storage=NL, column_weights=column_weights if weighted else None)
    groups = w.reshape(-1, 32).double().numpy()
    cw = np.tile(column_weights.reshape(4, 32).double().numpy(), (6, 1))
    mine = (cw * (gq.dequantize().reshape(-1, 32).double().numpy() - groups) ** 2).sum(-1)
    assert np.all(mine <= llama_iq4_nl_error(groups, cw) * (1 + 1e-5) + 1e-30)
    assert gq.levels == IQ4_LEVELS and bool((gq.zero == 0).all())
    units = groups / np.where(gq.scale.double().numpy() == 0, 1, gq.scale.double().numpy()).reshape(-1, 1)
    assert np.array_equal(gq.codes.reshape(-1, 32).numpy(), brute_nearest(units))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), supers=st.integers(1, 3), scale_exp=st.integers(-10, 3))
def test_iq4_xs_scales_are_levels_of_one_fp16_unit_per_super_block(seed, supers, scale_exp):
    from quantizer.methods.superblock import fp16_units

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(5, 256 * supers, generator=gen) * 2.0 ** scale_exp
    gq = quantize_groupwise(w, 32, symmetric=True, storage=XS)
    assert bool(fp16_units(gq.scale.double().reshape(5, supers, 8), XS_SCALE_LEVELS)[2].all())
    units = w.reshape(5, -1, 32) / torch.where(gq.scale == 0, 1.0, gq.scale.float()).unsqueeze(-1)
    assert np.array_equal(gq.codes.reshape(5, -1, 32).numpy(), brute_nearest(units.double().numpy()))


def test_a_row_super_blocks_do_not_fill_takes_iq4_nl_grids_and_a_flat_group_is_exact():
    w = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
    w[1, :32] = 0.0
    a, b = quantize_groupwise(w, 32, True, storage=XS), quantize_groupwise(w, 32, True, storage=NL)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale.float(), b.scale.float())
    assert bool((a.dequantize()[1, :32] == 0).all())


def test_gptq_solves_on_the_table_and_beats_nearest_rounding_on_its_objective():
    from quantizer.methods.gptq import error_objective, gptq_quantize

    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(32, 512, generator=gen), torch.randn(1024, 512, generator=gen)
    x[:, ::2] += x[:, 1::2]  # correlated inputs: where error feedback pays
    H = x.T @ x / x.shape[0]
    for storage in (NL, XS):
        gq, info = gptq_quantize(w, H, 32, symmetric=True, storage=storage)
        nearest = quantize_groupwise(w, 32, True, storage=storage)
        assert gq.levels == IQ4_LEVELS
        mine = error_objective(w - gq.dequantize(), H)
        assert mine == pytest.approx(info.objective, rel=1e-3)
        assert mine < 0.9 * error_objective(w - nearest.dequantize(), H)


def test_the_search_is_the_same_on_any_row_chunking():
    w = torch.randn(40, 512, generator=torch.Generator().manual_seed(2))
    whole = codebook_search(w.reshape(40, 16, 32), torch.ones(16, 32), XS)
    parts = [codebook_search(w[r].reshape(-1, 16, 32), torch.ones(16, 32), XS) for r in (slice(0, 13), slice(13, 40))]
    for a, b in zip(whole, zip(*parts)):
        assert torch.equal(a, torch.cat(b))
