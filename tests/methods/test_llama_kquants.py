"""llama.cpp's own K-quant grids as candidates: the vectorised port chooses what ggml's loop
chooses, its grids are what Q4_K/Q5_K super-blocks can store, and each super-block keeps the
better of the two searches."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.methods.candidates import ERROR, grid_scores
from quantizer.methods.llama_kquants import STRETCHES, llama_group_grids, llama_superblock_grids
from quantizer.methods.superblock import better_superblocks, fp16_units


def ggml_group(x: np.ndarray, bits: int) -> tuple[float, float, float]:
    """ggml's make_qkx2_quants on one group (weights rms + |x|), line by line in fp32:
    (step, value of code 0, its weighted error)."""
    f = np.float32
    nmax = 2**bits - 1
    rmin, rdelta, nstep = STRETCHES[bits]
    w = f(np.sqrt(f(np.sum(x * x, dtype=f) / f(len(x))))) + np.abs(x)
    low, high = min(f(x.min()), f(0)), f(x.max())
    if high == low:
        return 0.0, float(low), 0.0

    def err(step, zero, levels):
        return float(np.sum(w * (f(step) * levels + f(zero) - x) ** 2, dtype=np.float64))

    inverse = f(nmax) / (high - low)
    levels = np.clip(np.rint(inverse * (x - low)), 0, nmax).astype(f)
    best = (f(1) / inverse, low, err(f(1) / inverse, low, levels))
    for i in range(nstep + 1):
        inverse = (f(rmin) + f(rdelta) * f(i) + f(nmax)) / (high - low)
        levels = np.clip(np.rint(inverse * (x - low)), 0, nmax).astype(f)
        sw, sl, sl2 = w.sum(dtype=f), (w * levels).sum(dtype=f), (w * levels * levels).sum(dtype=f)
        sx, sxl = (w * x).sum(dtype=f), (w * levels * x).sum(dtype=f)
        det = sw * sl2 - sl * sl
        if det > 0:
            step, zero = (sw * sxl - sx * sl) / det, (sl2 * sx - sl * sxl) / det
            if zero > 0:
                step, zero = sxl / sl2, f(0)
            e = err(step, zero, levels)
            if e < best[2]:
                best = (step, zero, e)
    return float(best[0]), float(best[1]), best[2]


def weighted_error(x: np.ndarray, step: float, zero: float, bits: int) -> float:
    """ggml's objective for a group on grid (step, zero), codes nearest."""
    w = np.sqrt(np.mean(x.astype(np.float64) ** 2)) + np.abs(x)
    levels = np.clip(np.rint((x - zero) / step), 0, 2**bits - 1) if step > 0 else np.zeros_like(x)
    return float(np.sum(w * (step * levels + zero - x) ** 2))


def test_the_port_chooses_the_grids_ggmls_loop_chooses():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 8, 32, generator=g) * 0.02
    x[:, :, ::7] *= 5  # outliers, so the stretched grids matter
    x[0, 0] = 0.01  # a flat group
    x[1, 1] = x[1, 1].abs()  # a group above 0: its minimum is 0
    for bits in STRETCHES:
        step, zero = llama_group_grids(x, bits)
        same = 0
        for n, gi in np.ndindex(8, 8):
            group = x[n, gi].numpy()
            want_step, want_zero, _ = ggml_group(group, bits)
            got, want = (weighted_error(group, s, z, bits) for s, z in
                         ((float(step[n, gi]), float(zero[n, gi])), (want_step, want_zero)))
            assert got <= want * (1 + 1e-2) + 1e-12, (n, gi, bits)  # a near tie settled otherwise
            same += abs(float(step[n, gi]) - want_step) <= 1e-4 * abs(want_step) + 1e-12  # fp32 sums
        assert same >= 62  # float sums in another order may settle a near tie the other way


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 6), blocks=st.integers(1, 3), bits=st.sampled_from(sorted(STRETCHES)),
       seed=st.integers(0, 2**16))
def test_llamas_grids_are_super_block_levels_and_each_block_keeps_the_better(rows, blocks, bits, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 8 * blocks, 32, generator=g) * torch.rand(rows, 8 * blocks, 1, generator=g)
    scale, zero = llama_superblock_grids(x, bits, 8)
    mid = 2 ** (bits - 1)
    for values in (scale, mid * scale - zero):  # steps and minimums: levels 0..63 of one fp16 unit
        assert bool(fp16_units(values.reshape(rows, blocks, 8), (0, 63))[2].all())
    ours = (scale * 1.01, zero)
    chosen = better_superblocks(x, None, bits, 8, ours, (scale, zero))

    def block_errors(grid):
        return grid_scores(x, *grid, None, bits)[..., ERROR].double().reshape(rows, blocks, 8).sum(-1)

    best = torch.minimum(block_errors(ours), block_errors((scale, zero)))
    assert torch.equal(block_errors(chosen), best)
