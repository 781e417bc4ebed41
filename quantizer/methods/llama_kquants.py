"""llama.cpp's own grid search for the asymmetric K-quants (Q4_K, Q5_K) without an importance
matrix, in torch: ggml's ``quantize_row_q4_K_ref`` and ``quantize_row_q5_K_ref``, which
``llama-quantize`` runs without ``--imatrix``. Each group of 32 takes the step and minimum of
``make_qkx2_quants`` (weights ``rms(group) + |w|``; the min/max grid, then a least-squares refit
for the codes of each of a few stretched grids); a super-block's steps and minimums then become
6-bit levels of its largest step and minimum over 63, each rounded to fp16. int4q's super-block
search keeps these grids as candidates (:func:`.superblock.better_superblocks`). Pure tensor
functions; the arithmetic is fp32 as ggml's, summed in another order, so a near tie between two
of a group's grids may be settled the other way.
"""

from __future__ import annotations

import numpy as np
import torch

from .candidates import ERROR, WU, WUG, WUU, grid_scores
from .codes import code_range

STRETCHES = {4: (-1.0, 0.1, 20), 5: (-0.5, 0.1, 15)}
"""bits -> (rmin, rdelta, nstep) of ``make_qkx2_quants``: grid ``is`` takes ``nmax + rmin + rdelta * is``
steps across the group's range, is = 0 .. nstep."""
LEVELS = 63


def llama_group_grids(g: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group of g [N, G, B] (fp32): ggml's step (>= 0 where the fit allows) and the value of
    code 0 (<= 0), both fp32 [N, G]. Each grid's codes and sums come from one pass of
    :func:`.candidates.grid_scores`, each group weighted by its own elements' weights."""
    n, groups, size = g.shape
    nmax, mid = 2**bits - 1, code_range(bits)[0]
    x = g.to(torch.float32)
    weights = x.square().mean(-1, keepdim=True).sqrt_() + x.abs()
    low = x.amin(-1).clamp(max=0.0)
    span = x.amax(-1) - low
    flat = span == 0
    span = torch.where(flat, 1.0, span)
    wx = weights * x
    sum_w, sum_x, sum_x2 = weights.sum(-1), wx.sum(-1), (wx * x).sum(-1)
    own = weights.reshape(n * groups, size)

    def scores(steps: np.float32) -> torch.Tensor:
        """[N, G, 4] of the grid with ``steps`` steps from ``low`` across the range (codes 0..nmax)."""
        step = span / float(steps)
        return grid_scores(x.reshape(1, n * groups, size), step.reshape(1, -1), (low + mid * step).reshape(1, -1),
                           own, bits).reshape(n, groups, 4)

    def error(step, zero, sum_l, sum_l2, sum_xl) -> torch.Tensor:
        """sum(w (step l + zero - x)^2) from the sums, to choose among these grids only."""
        return (sum_x2 + step * step * sum_l2 + zero * zero * sum_w + 2 * step * zero * sum_l
                - 2 * step * sum_xl - 2 * zero * sum_x)

    best_step, best_zero = span / nmax, low
    best = scores(np.float32(nmax))[..., ERROR]
    rmin, rdelta, nstep = STRETCHES[bits]
    for i in range(nstep + 1):
        sums = scores(np.float32(rmin) + np.float32(rdelta) * np.float32(i) + np.float32(nmax))
        sum_u, sum_u2 = sums[..., WU], sums[..., WUU]  # codes l = u + mid
        sum_l, sum_l2 = sum_u + mid * sum_w, sum_u2 + 2 * mid * sum_u + mid * mid * sum_w
        sum_xl = sums[..., WUG] + mid * sum_x
        det = sum_w * sum_l2 - sum_l * sum_l
        safe = torch.where(det > 0, det, 1.0)
        step, zero = (sum_w * sum_xl - sum_x * sum_l) / safe, (sum_l2 * sum_x - sum_l * sum_xl) / safe
        positive = zero > 0
        step = torch.where(positive, sum_xl / sum_l2.clamp(min=1e-30), step)
        zero = torch.where(positive, 0.0, zero)
        err = error(step, zero, sum_l, sum_l2, sum_xl)
        better = (det > 0) & (err < best)  # a later grid wins only where strictly better, as in ggml
        best = torch.where(better, err, best)
        best_step, best_zero = torch.where(better, step, best_step), torch.where(better, zero, best_zero)
    return torch.where(flat, 0.0, best_step), torch.where(flat, low, best_zero)


def llama_superblock_grids(g: torch.Tensor, bits: int, per_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The grids (scale, zero) [N, G] fp64 that ggml stores for g [N, G, B], G a multiple of
    ``per_block`` groups per super-block, in int4q's form: ``w = (q - mid) * scale + zero``."""
    n, groups, _ = g.shape
    step, zero = llama_group_grids(g, bits)
    blocks = (n, groups // per_block, per_block)
    step, minimum = step.reshape(blocks), (-zero).reshape(blocks)
    top_step = step.amax(-1, keepdim=True).clamp(min=0.0)
    top_min = minimum.amax(-1, keepdim=True).clamp(min=0.0)

    def levels(values: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        inverse = torch.where(top > 0, LEVELS / torch.where(top > 0, top, 1.0), 0.0)
        return torch.round(inverse * values).clamp_(0, LEVELS).to(torch.float64)

    step_unit = (top_step / LEVELS).to(torch.float16).to(torch.float64)
    min_unit = (top_min / LEVELS).to(torch.float16).to(torch.float64)
    scale = (step_unit * levels(step, top_step)).reshape(n, groups)
    return scale, code_range(bits)[0] * scale - (min_unit * levels(minimum, top_min)).reshape(n, groups)
