"""llama.cpp's own K-quant grids as candidates: the vectorised ports (without and with an
importance matrix) choose what ggml's loops choose, their grids are what Q4_K/Q5_K super-blocks
can store, and each super-block keeps the better of the two searches."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.methods.candidates import ERROR, grid_scores
from quantizer.methods.grid import Storage, weighted_grid_search
from quantizer.methods.llama_searches import (
    IMPORTANCE_STRETCH,
    STRETCHES,
    llama_grids,
    llama_group_grids,
    llama_superblock_grids,
    weighted_levels,
)
from quantizer.methods.superblock import better_superblocks, fp16_units


def ggml_qkx(x: np.ndarray, w: np.ndarray, nmax: int, stretch: tuple[float, float, int]) -> tuple[float, float, float]:
    """ggml's make_qkx2_quants / make_qkx3_quants on one group x with weights w, line by line in
    fp32: (step, value of code 0, its weighted error)."""
    f = np.float32
    rmin, rdelta, nstep = stretch
    low, high = min(f(x.min()), f(0)), f(x.max())
    if high <= low:
        return 0.0, float(low), 0.0

    def err(step, zero, levels):
        return np.sum(w * (f(step) * levels + f(zero) - x) ** 2, dtype=f)

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
    return float(best[0]), float(best[1]), float(best[2])


def ggml_group(x: np.ndarray, bits: int) -> tuple[float, float, float]:
    """ggml's make_qkx2_quants on one group (weights rms + |x|): (step, value of code 0, error)."""
    f = np.float32
    w = f(np.sqrt(f(np.sum(x * x, dtype=f) / f(len(x))))) + np.abs(x)
    return ggml_qkx(x, w, 2**bits - 1, STRETCHES[bits])


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


def ggml_weighted_units(x: np.ndarray, w: np.ndarray) -> tuple[float, np.ndarray]:
    """ggml's make_qp_quants on one super-block's values x [8] >= 0 and weights w [8], line by
    line in fp32: (the unit before fp16, the levels)."""
    f = np.float32
    top = f(x.max())
    if top < 1e-15:
        return 0.0, np.zeros_like(x)

    def error(inverse):
        levels = np.minimum(np.rint(inverse * x), 63).astype(f)
        return np.sum(w * (x - (f(1) / inverse) * levels) ** 2, dtype=f)

    inverse = f(63) / top
    best = error(inverse)
    for i in (-4, -3, -2, -1, 1, 2, 3, 4):
        trial = (f(0.1) * f(i) + f(63)) / top
        if error(trial) < best:
            best, inverse = error(trial), trial
    levels = np.minimum(np.rint(inverse * x), 63).astype(f)
    lx, l2 = np.sum(w * x * levels, dtype=f), np.sum(w * levels * levels, dtype=f)
    for _ in range(5):
        for i in range(len(x)):
            slx, sl2 = lx - w[i] * x[i] * levels[i], l2 - w[i] * levels[i] * levels[i]
            if slx > 0 and sl2 > 0:
                new = f(min(63, np.rint(x[i] * sl2 / slx)))
                if new != levels[i]:
                    slx, sl2 = slx + w[i] * x[i] * new, sl2 + w[i] * new * new
                    if slx * slx * l2 > lx * lx * sl2:
                        levels[i], lx, l2 = new, slx, sl2
    return float(lx / l2) if l2 > 0 else 0.0, levels


def test_the_weighted_unit_search_chooses_what_ggmls_loop_chooses():
    g = torch.Generator().manual_seed(5)
    values = torch.rand(200, 8, generator=g) * torch.rand(200, 1, generator=g)
    values[:, ::3] *= 0.1  # levels far from 63, where the moves matter
    values[0] = 0.0  # an empty super-block stores 0
    weights = torch.rand(200, 8, generator=g) + 0.05
    unit, levels = weighted_levels(values, weights)
    same = 0
    for i in range(200):
        want_unit, want_levels = ggml_weighted_units(values[i].numpy(), weights[i].numpy())
        same += bool(np.array_equal(levels[i].numpy(), want_levels)) and \
            float(unit[i, 0]) == float(np.float16(want_unit))
    assert same >= 196  # fp32 sums in another order may settle a near tie the other way
    assert float(unit[0, 0]) == 0.0 and not bool(levels[0].any())


def ggml_importance_block(x: np.ndarray, importance: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's quantize_row_q4_K_impl / q5_K_impl grids of one super-block x [8, 32] with
    importance [8, 32], line by line in fp32: (steps [8], values of code 0 [8]) as stored."""
    f = np.float32
    nmax = 2**bits - 1
    sigma2 = f(2) * np.sum(x * x, dtype=f) / f(x.size)
    steps, mins, sums = np.zeros(8, f), np.zeros(8, f), np.zeros(8, f)
    for j in range(8):
        w = importance[j] * np.sqrt(sigma2 + x[j] * x[j])
        sums[j] = w.sum(dtype=f)
        step, low, _ = ggml_qkx(x[j], w, nmax, IMPORTANCE_STRETCH)
        steps[j], mins[j] = step, -low
    (step_unit, step_levels), (min_unit, min_levels) = (ggml_weighted_units(v, sums) for v in (steps, mins))
    step_unit, min_unit = float(np.float16(step_unit)), float(np.float16(min_unit))
    return step_unit * step_levels, -min_unit * min_levels


def ggml_block_error(x: np.ndarray, importance: np.ndarray, steps: np.ndarray, lows: np.ndarray, bits: int) -> float:
    """ggml's importance objective of a super-block x [8, 32] on grids (steps, values of code 0)
    [8], codes nearest: sum(importance sqrt(sigma2 + x^2) (deq - x)^2), in fp64."""
    x = x.astype(np.float64)
    w = importance * np.sqrt(2 * np.mean(x * x) + x * x)
    s, low = steps[:, None], lows[:, None]
    q = np.where(s > 0, np.clip(np.rint((x - low) / np.where(s > 0, s, 1)), 0, 2**bits - 1), 0)
    return float(np.sum(w * (s * q + low - x) ** 2))


@pytest.mark.parametrize("bits", [4, 5])
def test_the_importance_port_stores_the_grids_ggmls_loop_stores(bits):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(24, 16, 32, generator=g) * 0.02
    x[:, :, ::9] *= 4
    importance = torch.rand(16, 32, generator=g).square() * 3 + 0.01
    scale, zero = llama_superblock_grids(x, bits, 8, importance)
    steps, lows = scale, zero - 2 ** (bits - 1) * scale  # int4q's form: code 0 at zero - mid * scale
    same, ours, theirs = 0, [], []
    for n, b in np.ndindex(24, 2):
        blocks = slice(8 * b, 8 * b + 8)
        block, weights = x[n, blocks].numpy(), importance[blocks].numpy()
        want_steps, want_lows = ggml_importance_block(block, weights, bits)
        got_steps, got_lows = steps[n, blocks].numpy(), lows[n, blocks].numpy()
        same += bool(np.allclose(got_steps, want_steps, rtol=1e-6, atol=0)
                     and np.allclose(got_lows, want_lows, rtol=1e-6, atol=0))
        ours.append(ggml_block_error(block, weights, got_steps, got_lows, bits))
        theirs.append(ggml_block_error(block, weights, want_steps, want_lows, bits))
    # The port's codes are rounded from int4q's (step, zero), ggml's from its inverse step: an element
    # at a rounding tie may take the other code, and the group another of its near-equal grids.
    assert same >= 40, same
    assert sum(ours) <= sum(theirs) * 1.005 and max(a / b for a, b in zip(ours, theirs)) < 1.1


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 4), bits=st.sampled_from((4, 5)), seed=st.integers(0, 2**16))
def test_with_an_importance_matrix_the_search_is_never_worse_than_llamas_on_its_objective(rows, bits, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 16, 32, generator=g) * torch.rand(rows, 16, 1, generator=g)
    importance = torch.rand(16, 32, generator=g).square() + 1e-3
    storage = Storage(torch.float16, superblock=8, bits=bits)
    scale, zero, _ = weighted_grid_search(x, importance, False, storage)

    def block_errors(grid):
        return grid_scores(x, *grid, importance, bits)[..., ERROR].double().reshape(rows, 2, 8).sum(-1)

    theirs = block_errors(llama_superblock_grids(x, bits, 8, importance))
    assert bool((block_errors((scale, zero)) <= theirs * (1 + 1e-6)).all())


def ggml_q6_block(x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """ggml's Q6_K steps of one super-block x [16, 16] (make_qx_quants with rmse_type 1 and
    ``weights`` [16, 16], then levels of -128 / the largest), line by line in fp32, as stored."""
    f = np.float32
    scales = np.zeros(16, f)
    for j in range(16):
        xj, w = x[j], weights[j]
        top = f(xj[np.argmax(np.abs(xj))])
        if abs(top) < 1e-15:
            continue

        def sums(inverse):
            levels = np.clip(np.rint(inverse * xj), -32, 31).astype(f)
            return np.sum(w * xj * levels, dtype=f), np.sum(w * levels * levels, dtype=f)

        lx, l2 = sums(f(-32) / top)
        scale = lx / l2 if l2 else f(0)
        best = scale * lx
        for i in (i for i in range(-9, 10) if i):
            lx, l2 = sums(-(f(32) + f(0.1) * f(i)) / top)
            if l2 > 0 and lx * lx > best * l2:
                scale = lx / l2
                best = scale * lx
        scales[j] = scale
    largest = scales[np.argmax(np.abs(scales))]
    if abs(largest) < 1e-15:
        return np.zeros(16)
    inverse = f(-128) / largest
    return float(np.float16(f(1) / inverse)) * np.minimum(127, np.rint(inverse * scales))


@pytest.mark.parametrize("with_importance", [False, True])
def test_the_q6_port_stores_the_steps_ggmls_loop_stores(with_importance):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(32, 32, 16, generator=g) * 0.02
    x[:, :, ::5] *= 3
    x[0, :16] = 0.0  # an empty super-block stores 0
    importance = torch.rand(32, 16, generator=g).square() + 0.01
    scale, zero = llama_grids(x, 6, 16, True, importance if with_importance else None)
    assert not bool(zero.any()) and not bool(scale[0, :16].any())
    same, ours, theirs = 0, 0.0, 0.0
    for n, b in np.ndindex(32, 2):
        blocks = slice(16 * b, 16 * b + 16)
        block = x[n, blocks].numpy()
        weights = importance[blocks].numpy() if with_importance else block * block
        want = ggml_q6_block(block, weights)
        same += bool(np.allclose(scale[n, blocks].numpy(), want, rtol=1e-6, atol=0))
        for steps, total in ((scale[n, blocks].numpy()[:, None], "ours"), (want[:, None], "theirs")):
            q = np.where(steps != 0, np.clip(np.rint(block / np.where(steps != 0, steps, 1)), -32, 31), 0)
            err = float(np.sum(weights * (steps * q - block) ** 2))
            ours, theirs = (ours + err, theirs) if total == "ours" else (ours, theirs + err)
    assert same >= 58, same  # of 64; the rest a rounding tie away
    assert ours <= theirs * 1.005


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 4), bits=st.sampled_from((4, 5)), seed=st.integers(0, 2**16))
def test_q4_1_and_q5_1_with_an_importance_matrix_keep_the_better_grid_per_group(rows, bits, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 6, 32, generator=g) * torch.rand(rows, 6, 1, generator=g)
    importance = torch.rand(6, 32, generator=g).pow(4) * 10 + 1e-3
    storage = Storage(torch.float16, "min", bits=bits)
    scale, zero, _ = weighted_grid_search(x, importance, False, storage)
    theirs = llama_grids(x, bits, None, False, importance)
    assert llama_grids(x, bits, None, False, None) is None and llama_grids(x, bits, None, True, importance) is None
    assert torch.equal(theirs[0], theirs[0].half().float())  # the step is stored in fp16

    def errors(grid):
        return grid_scores(x, *grid, importance, bits)[..., ERROR]

    assert bool((errors((scale, zero)) <= errors(theirs)).all())
