"""llama.cpp's own grid searches, in torch, as ``llama-quantize`` runs them, for the types where
int4q's searches alone can lose to them: without an importance matrix ggml's
``quantize_row_q4_K_ref`` (and q5_K, q6_K), with one ``quantize_row_q4_K_impl`` (and q5_K, q6_K,
q4_1, q5_1).

* Each group of 32 takes the step and minimum of ``make_qkx2_quants`` (weights ``rms(group) +
  |w|``) or ``make_qkx3_quants`` (weights ``importance * sqrt(sigma2 + w^2)``, sigma2 twice the
  super-block's mean square; for Q4_1/Q5_1 the row's mean square): the min/max grid, then a
  least-squares refit for the codes of each of a few stretched grids. Q4_1/Q5_1 store that step
  and minimum in fp16.
* A K-quant super-block's steps and minimums then become 6-bit levels of two fp16 units: of their
  largest over 63 without the importance matrix, of ``make_qp_quants``' weighted search with it.
* Q6_K's symmetric groups of 16 take the signed step of ``make_qx_quants`` (weights w^2, or the
  importance): the step that puts the largest magnitude at -32, or at -(32 + is / 10), each
  refitted by least squares on its codes; the super-block's steps then become levels -128..127 of
  the largest over -128.

int4q's searches keep these grids as candidates (:func:`.superblock.better_superblocks`, per group
for Q4_1/Q5_1). Pure tensor functions; the arithmetic is fp32 as ggml's, summed in another order,
so a near tie between two of a group's grids may be settled the other way.
"""

from __future__ import annotations

import numpy as np
import torch

from ..native.checked import CheckedKernel
from . import fused_search
from .candidates import ERROR, WU, WUG, WUU, grid_scores
from .codes import code_range

STRETCHES = {4: (-1.0, 0.1, 20), 5: (-0.5, 0.1, 15)}
"""bits -> (rmin, rdelta, nstep) of ``make_qkx2_quants``: grid ``is`` takes ``nmax + rmin + rdelta * is``
steps across the group's range, is = 0 .. nstep."""
IMPORTANCE_STRETCH = (-0.9, 0.05, 36)
"""(rmin, rdelta, nstep) of ``make_qkx3_quants`` in the importance-matrix forms, both widths."""
LEVELS = 63
UNIT_STRETCHES = (-4, -3, -2, -1, 1, 2, 3, 4)
"""``make_qp_quants``' trial units: the super-block's largest value over 63 + is / 10 levels."""
UNIT_SWEEPS = 5  # make_qp_quants' passes of level moves
EMPTY = 1e-15  # ggml's GROUP_MAX_EPS: a super-block whose values are all below it stores 0
SIGNED_STRETCHES = tuple(i for i in range(-9, 10) if i)
"""``make_qx_quants``' trial steps: the largest magnitude at -(2^(bits-1) + is / 10) steps."""
SIGNED_LEVELS = 128


def llama_grids(g: torch.Tensor, bits: int, per_block: int | None, symmetric: bool,
                importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The grids (scale, zero) [N, G] ggml stores for g [N, G, B] (whole rows) as a K-quant
    of ``bits`` with ``per_block`` groups a super-block, or (``per_block`` None) as Q4_1/Q5_1;
    with ``importance`` [G, B], those of its importance-matrix search. None for the types whose
    ggml search int4q's own matches or beats tensor by tensor (Q4_0, Q5_0; Q4_1 and Q5_1 without
    an importance matrix, where ggml's grid is the min/max one)."""
    if per_block is None:
        return None if symmetric or importance is None else llama_min_grids(g, bits, importance)
    if not symmetric and bits in STRETCHES:
        return llama_superblock_grids(g, bits, per_block, importance)
    if symmetric and bits == 6:
        return llama_signed_grids(g, bits, per_block, importance)
    return None


def llama_min_grids(g: torch.Tensor, bits: int, importance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's Q4_1/Q5_1 grids with an importance matrix (``quantize_row_q4_1_impl``) for g
    [N, G, B]: each group's ``make_qkx3_quants`` step and minimum, weights ``importance * sqrt(
    sigma2 + w^2)`` with sigma2 the mean square of its row (of the G groups given), both stored
    in fp16; (scale, zero) [N, G] fp32, as int4q's "min" storage holds them."""
    x = g.to(torch.float32)
    sigma2 = x.square().mean((1, 2), keepdim=True)
    weights = importance.to(torch.float32) * (sigma2 + x * x).sqrt()
    step, low = llama_group_grids(x, bits, weights, IMPORTANCE_STRETCH)
    scale = step.to(torch.float16).to(torch.float32)
    return scale, low.to(torch.float16).to(torch.float32) + code_range(bits)[0] * scale


def llama_group_grids(g: torch.Tensor, bits: int, weights: torch.Tensor | None = None,
                      stretch: tuple[float, float, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group of g [N, G, B] (fp32): ggml's step (>= 0 where the fit allows) and the value of
    code 0 (<= 0), both fp32 [N, G], for per-element ``weights`` [N, G, B] and ``stretch`` (by
    default ``make_qkx2_quants``': weights rms + |w|, :data:`STRETCHES`). Each grid's codes and
    sums are those of :func:`.candidates.grid_scores`, each group weighted by its own elements'
    weights."""
    x = g.to(torch.float32)
    if weights is None:
        weights = x.square().mean(-1, keepdim=True).sqrt_() + x.abs()
    rmin, rdelta, nstep = STRETCHES[bits] if stretch is None else stretch
    nmax = np.float32(2**bits - 1)
    steps = [nmax] + [np.float32(rmin) + np.float32(rdelta) * np.float32(i) + nmax for i in range(nstep + 1)]
    low = x.amin(-1).clamp(max=0.0)
    span = x.amax(-1) - low
    flat = span == 0
    span = torch.where(flat, 1.0, span)
    wx = weights * x
    sums = weights.sum(-1), wx.sum(-1), (wx * x).sum(-1)
    if fused_search.runs_on(x):
        step, zero = fused_search.stretch_search(STRETCH(), x, weights, low, span, sums, steps, bits)
    else:
        step, zero = _stretch_loop(x, weights, low, span, sums, steps, bits)
    return torch.where(flat, 0.0, step), torch.where(flat, low, zero)


def _stretch_loop(x: torch.Tensor, weights: torch.Tensor, low: torch.Tensor, span: torch.Tensor,
                  sums: tuple[torch.Tensor, torch.Tensor, torch.Tensor], steps: list,
                  bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`llama_group_grids`' candidates for groups x [N, G, B] with weights [N, G, B], lowest
    points ``low`` and nonzero spans [N, G], ``sums`` (of w, w x, w x x) [N, G]: the grid of
    ``steps[0]`` steps (the min/max grid), then per later step count the least-squares refit of
    that grid's codes, kept where it is solvable and its error strictly lower -> (step, zero)."""
    n, groups, size = x.shape
    nmax, mid = 2**bits - 1, code_range(bits)[0]
    sum_w, sum_x, sum_x2 = sums
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
    best = scores(steps[0])[..., ERROR]
    for count in steps[1:]:
        scored = scores(count)
        sum_u, sum_u2 = scored[..., WU], scored[..., WUU]  # codes l = u + mid
        sum_l, sum_l2 = sum_u + mid * sum_w, sum_u2 + 2 * mid * sum_u + mid * mid * sum_w
        sum_xl = scored[..., WUG] + mid * sum_x
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
    return best_step, best_zero


def torch_stretch_search(x: torch.Tensor, weights: torch.Tensor, low: torch.Tensor, span: torch.Tensor,
                         sum_w: torch.Tensor, sum_x: torch.Tensor, sum_x2: torch.Tensor, steps: torch.Tensor,
                         qmax: int, step: torch.Tensor, zero: torch.Tensor) -> None:
    """:func:`_stretch_loop` in the arguments of the native kernel (:mod:`.fused_search`): groups
    x [1, M, B], per-group tensors [M], written into ``step`` and ``zero``."""
    sums = tuple(t.reshape(1, -1) for t in (sum_w, sum_x, sum_x2))
    found = _stretch_loop(x, weights, low.reshape(1, -1), span.reshape(1, -1), sums,
                          [np.float32(v) for v in steps.tolist()], (qmax + 1).bit_length() - 1)
    step.copy_(found[0].reshape(-1)), zero.copy_(found[1].reshape(-1))


STRETCH = CheckedKernel(torch_stretch_search, fused_search.stretch_operator, fused_search.stretch_probe,
                        "llama.cpp's grid search")


def llama_superblock_grids(g: torch.Tensor, bits: int, per_block: int,
                           importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The grids (scale, zero) [N, G] fp64 that ggml stores for g [N, G, B], G a multiple of
    ``per_block`` groups per super-block, in int4q's form: ``w = (q - mid) * scale + zero``;
    with ``importance`` [G, B] (each column's mean squared activation, as an importance matrix
    holds it) the grids of ggml's importance-matrix search."""
    n, groups, size = g.shape
    blocks = (n, groups // per_block, per_block)
    if importance is None:
        step, zero = llama_group_grids(g, bits)
        step, minimum = step.reshape(blocks), (-zero).reshape(blocks)
        step_unit, step_levels = _largest_levels(step)
        min_unit, min_levels = _largest_levels(minimum)
    else:
        x = g.to(torch.float32)
        sigma2 = 2 * x.reshape(n, blocks[1], per_block * size).square().mean(-1)
        weights = importance.to(torch.float32) * (sigma2.repeat_interleave(per_block, 1).unsqueeze(-1) + x * x).sqrt()
        step, zero = llama_group_grids(x, bits, weights, IMPORTANCE_STRETCH)
        group_weights = weights.sum(-1).reshape(blocks)
        step_unit, step_levels = weighted_levels(step.reshape(blocks), group_weights)
        min_unit, min_levels = weighted_levels((-zero).reshape(blocks), group_weights)
    scale = (step_unit * step_levels).reshape(n, groups)
    return scale, code_range(bits)[0] * scale - (min_unit * min_levels).reshape(n, groups)


def _largest_levels(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [..., B] (fp32) -> (the fp16 unit of their largest (at least 0) over 63 as fp64
    [..., 1], the nearest levels 0..63 of its fp32 form as fp64 [..., B]), as ggml's reference
    quantizers store a super-block."""
    top = values.amax(-1, keepdim=True).clamp(min=0.0)
    inverse = torch.where(top > 0, LEVELS / torch.where(top > 0, top, 1.0), 0.0)
    levels = torch.round(inverse * values).clamp_(0, LEVELS).to(torch.float64)
    return (top / LEVELS).to(torch.float16).to(torch.float64), levels


def weighted_levels(values: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's ``make_qp_quants`` per row of values [..., B] (fp32) and their weights [..., B]:
    (the fp16 unit as fp64 [..., 1], the levels 0..63 as fp64 [..., B]) minimising
    sum(weights * (values - unit * level)^2) by ggml's search: the unit that puts the largest
    value at level 63 or at 63 + is / 10 (:data:`UNIT_STRETCHES`), its nearest levels, then
    single-level moves that raise the least-squares fit's gain, and the unit refitted in fp32.
    Levels are clamped at 0 where ggml's would wrap below it."""
    x, w = values.to(torch.float32), weights.to(torch.float32)
    top = x.amax(-1, keepdim=True)
    empty = top < EMPTY
    top = torch.where(empty, 1.0, top)

    def nearest(inverse: torch.Tensor) -> torch.Tensor:
        return torch.round(inverse * x).clamp_(0, LEVELS)

    def error(inverse: torch.Tensor) -> torch.Tensor:
        return (w * (x - (1 / inverse) * nearest(inverse)).square()).sum(-1, keepdim=True)

    inverse = LEVELS / top
    best = error(inverse)
    for stretch in UNIT_STRETCHES:
        trial = (np.float32(0.1) * np.float32(stretch) + np.float32(LEVELS)) / top
        err = error(trial)
        inverse, best = torch.where(err < best, trial, inverse), torch.minimum(err, best)
    levels = nearest(inverse)
    sum_lx, sum_l2 = (w * x * levels).sum(-1), (w * levels * levels).sum(-1)
    for _ in range(UNIT_SWEEPS):
        for i in range(x.shape[-1]):
            wi, xi, li = w[..., i], x[..., i], levels[..., i]
            lx, l2 = sum_lx - wi * xi * li, sum_l2 - wi * li * li
            fits = (lx > 0) & (l2 > 0)
            moved = torch.round(xi * l2 / torch.where(fits, lx, 1.0)).clamp_(0, LEVELS)
            new_lx, new_l2 = lx + wi * xi * moved, l2 + wi * moved * moved
            take = fits & (moved != li) & (new_lx * new_lx * sum_l2 > sum_lx * sum_lx * new_l2)
            levels[..., i] = torch.where(take, moved, li)
            sum_lx, sum_l2 = torch.where(take, new_lx, sum_lx), torch.where(take, new_l2, sum_l2)
    unit = torch.where(sum_l2 > 0, sum_lx / torch.where(sum_l2 > 0, sum_l2, 1.0), 0.0).unsqueeze(-1)
    unit = torch.where(empty, 0.0, unit)
    return unit.to(torch.float16).to(torch.float64), torch.where(empty, 0.0, levels).to(torch.float64)


def _signed_loop(x: torch.Tensor, weights: torch.Tensor, top: torch.Tensor, steps: list, bits: int) -> torch.Tensor:
    """:func:`llama_signed_grids`' candidates for groups x [N, G, B] with weights [N, G, B] and values
    of largest magnitude ``top`` [N, G] (nonzero): per step count the least-squares step of the
    codes of the grid with -top / count a step, kept where its gain sum(w x l)^2 / sum(w l l) is
    strictly higher (the first count's always) -> the signed step [N, G]."""
    n, groups, size = x.shape
    own, zeros = weights.reshape(n * groups, size), torch.zeros_like(top).reshape(1, -1)

    def fit(count: np.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum(w x l), sum(w l l)) [N, G] for the codes l of the grid with -top / count a step."""
        sums = grid_scores(x.reshape(1, n * groups, size), (-top / float(count)).reshape(1, -1), zeros, own, bits)
        return sums[0, :, WUG].reshape(n, groups), sums[0, :, WUU].reshape(n, groups)

    lx, l2 = fit(steps[0])
    scale = torch.where(l2 > 0, lx / torch.where(l2 > 0, l2, 1.0), 0.0)
    best = scale * lx
    for count in steps[1:]:
        lx, l2 = fit(count)
        trial = lx / torch.where(l2 > 0, l2, 1.0)
        better = (l2 > 0) & (lx * lx > best * l2)
        scale, best = torch.where(better, trial, scale), torch.where(better, trial * lx, best)
    return scale


def torch_signed_search(x: torch.Tensor, weights: torch.Tensor, top: torch.Tensor, steps: torch.Tensor, qmax: int,
                        scale: torch.Tensor) -> None:
    """:func:`_signed_loop` in the arguments of the native kernel (:mod:`.fused_search`): groups
    x [1, M, B], ``top`` [M], written into ``scale`` [M]."""
    found = _signed_loop(x, weights, top.reshape(1, -1), [np.float32(v) for v in steps.tolist()],
                         (qmax + 1).bit_length() - 1)
    scale.copy_(found.reshape(-1))


SIGNED = CheckedKernel(torch_signed_search, fused_search.signed_operator, fused_search.signed_probe,
                       "llama.cpp's Q6_K grid search")


def llama_signed_grids(g: torch.Tensor, bits: int, per_block: int,
                       importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's Q6_K grids (scale, zero 0) [N, G] fp64 for g [N, G, B]: each group's signed step by
    ``make_qx_quants`` (weights g^2, or ``importance`` [G, B]), then each super-block's steps as
    levels -128..127 of the fp16 unit that puts its largest magnitude at -128."""
    n, groups, size = g.shape
    x = g.to(torch.float32)
    weights = x * x if importance is None else importance.to(torch.float32).expand_as(x)
    top = x.gather(-1, x.abs().argmax(-1, keepdim=True)).squeeze(-1)  # the first of the largest, as ggml
    empty = top.abs() < EMPTY
    top = torch.where(empty, 1.0, top)
    nmax = np.float32(2 ** (bits - 1))
    steps = [nmax] + [nmax + np.float32(0.1) * np.float32(stretch) for stretch in SIGNED_STRETCHES]
    if fused_search.runs_on(x):
        scale = fused_search.signed_search(SIGNED(), x, weights, top, steps, bits)
    else:
        scale = _signed_loop(x, weights, top, steps, bits)
    blocks = torch.where(empty, 0.0, scale).reshape(n, groups // per_block, per_block)
    largest = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    inverse = torch.where(largest.abs() < EMPTY, 0.0, -SIGNED_LEVELS / largest)
    levels = torch.round(inverse * blocks).clamp_(-SIGNED_LEVELS, SIGNED_LEVELS - 1).to(torch.float64)
    unit = torch.where(inverse == 0, 0.0, 1 / torch.where(inverse == 0, 1.0, inverse))
    scale = (unit.to(torch.float16).to(torch.float64) * levels).reshape(n, groups)
    return scale, torch.zeros_like(scale)
