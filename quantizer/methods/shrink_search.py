"""The weighted grid search's candidates for one storage: the min/max grid, each range scaled by
the factors of :data:`WEIGHTED_SHRINKS`, and for each of those the weighted least-squares grid of
its codes. The torch loop is the reference; on fp32-stored grids (a K-quant's groups before their
super-block levels) its native form runs (:mod:`.fused_search`) once it has written the loop's bits
on a seeded probe. Pure tensor functions.
"""

from __future__ import annotations

import torch

from ..native.checked import CheckedKernel
from . import fused_search
from .candidates import ERROR, WU, WUG, WUU, grid_scores
from .codes import code_range
from .storage import Storage, grid_params, stored_symmetric

WEIGHTED_SHRINKS = torch.linspace(1.0, 0.80, 9).tolist() + [1.01, 1.02, 1.03, 1.04]
"""The weighted search's range factors: shrunk (clipping the extremes) and widened a little (the
extremes on inner codes), as llama.cpp's own searches try steps on both sides."""


def shrunk_grids(g: torch.Tensor, weights: torch.Tensor, symmetric: bool, storage: Storage) -> tuple[torch.Tensor, ...]:
    """The stored (scale, zero) [N, G] of the candidate with the least weighted squared error for
    each group of g [N, G, group] (fp32), weights [G, group]; a later candidate wins only where
    strictly better, so the min/max grid stands on a tie."""
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    fixed = weights.sum(-1), (weights * g).sum(-1)  # sum(w), sum(w g): the same for every grid
    if fused_search.takes(g, weights, storage, symmetric):
        return fused_search.shrink_search(SHRINK(), g, weights, lo, hi, fixed, symmetric, storage.bits,
                                          WEIGHTED_SHRINKS)
    return _shrink_loop(g, weights, lo, hi, fixed, symmetric, storage, WEIGHTED_SHRINKS)


def _shrink_loop(g: torch.Tensor, weights: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 fixed: tuple[torch.Tensor, torch.Tensor], symmetric: bool, storage: Storage,
                 shrinks: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`weighted_grid_search`'s candidates for groups g [N, G, group] with ranges lo, hi [N, G]
    and ``fixed`` (sum(w) [G], sum(w g) [N, G]): the min/max grid, then per range factor the scaled
    grid and its refit, each kept where its error is strictly lower -> the stored (scale, zero)."""
    bits = storage.bits
    scale, zero = grid_params(lo, hi, symmetric, storage)
    best = grid_scores(g, scale, zero, weights, bits)[..., ERROR]
    mid = torch.zeros_like(lo) if symmetric else (lo + hi) / 2
    for shrink in shrinks:
        c_scale, c_zero = grid_params(mid + (lo - mid) * shrink, mid + (hi - mid) * shrink, symmetric, storage)
        scores = grid_scores(g, c_scale, c_zero, weights, bits)
        refit = _least_squares_grid(scores, fixed, symmetric, storage)
        for c_scale, c_zero, err in ((c_scale, c_zero, scores[..., ERROR]),
                                     (*refit, grid_scores(g, *refit, weights, bits)[..., ERROR])):
            better = err < best
            best = torch.where(better, err, best)
            scale, zero = torch.where(better, c_scale, scale), torch.where(better, c_zero, zero)
    return scale, zero


def torch_shrink_search(x: torch.Tensor, weights: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, sw: torch.Tensor,
                        swx: torch.Tensor, shrinks: torch.Tensor, qmax: int, symmetric: bool, scale: torch.Tensor,
                        zero: torch.Tensor) -> None:
    """:func:`_shrink_loop` on fp32-stored grids (asymmetric, or symmetric with a signed scale), in
    the arguments of the native kernel (:mod:`.fused_search`), written into ``scale`` and ``zero``."""
    storage = Storage(torch.float32, "float", signed_scale=symmetric, bits=(qmax + 1).bit_length() - 1)
    found = _shrink_loop(x, weights, lo, hi, (sw, swx), symmetric, storage, shrinks.tolist())
    scale.copy_(found[0]), zero.copy_(found[1])


SHRINK = CheckedKernel(torch_shrink_search, fused_search.shrink_operator, fused_search.shrink_probe, "grid search")


def _least_squares_grid(scores: torch.Tensor, fixed: tuple[torch.Tensor, torch.Tensor], symmetric: bool,
                        storage: Storage):
    """The stored (scale, zero) of the weighted least-squares fit w ~ (q - mid) * scale + zero for
    the codes a grid's ``scores`` (:func:`.candidates.grid_scores`) are of; ``fixed``: each group's
    sum(w) and sum(w g)."""
    mid, qmax = code_range(storage.bits)
    su, suu, su_w = scores[..., WU], scores[..., WUU], scores[..., WUG]
    sw, sw_w = fixed
    if symmetric:
        scale = su_w / suu.clamp(min=1e-30)
        return stored_symmetric(scale if storage.signed_scale else scale.clamp(min=0.0), storage)
    det = (suu * sw - su * su).clamp(min=1e-30)
    scale, zero = (su_w * sw - su * sw_w) / det, (suu * sw_w - su * su_w) / det
    scale = scale.clamp(min=0.0)
    lo, hi = zero - mid * scale, zero + (qmax - mid) * scale
    return grid_params(lo, hi, symmetric, storage)
