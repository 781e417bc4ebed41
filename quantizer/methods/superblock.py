"""K-quant super-blocks: groups whose steps and minimums are stored as 6-bit multiples (0..63) of
two fp16 units per super-block, as GGUF's Q4_K holds them. Pure tensor functions."""

from __future__ import annotations

import torch

from .codes import MID, QMAX, group_sq_error, round_to_grid

SUPER_LEVELS = 63
LEVEL_STEPS = (0, -1, 1)  # level changes tried per group, for its step and its minimum


def superblock_grids(scale: torch.Tensor, zero: torch.Tensor, per_block: int, g: torch.Tensor | None = None,
                     weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's grid (scale, zero) [N, G] as super-blocks of ``per_block`` groups store it:
    the grid's lowest point raised to at most 0, the step kept covering its top, then step and
    -lowest each rounded to a level 0..63 of the super-block's fp16 unit (its largest value / 63).

    With the weights g [N, G, group] (fp32), each group's two levels are then moved by -1, 0 or +1
    to the pair whose nearest codes give the least squared error on g (weighted by ``weights``
    [G, group]), the units staying fixed. Returns fp64 (scale, zero), exact in the stored values.
    """
    n, groups = scale.shape
    scale, zero = scale.to(torch.float32), zero.to(torch.float32)
    low = torch.minimum(zero - MID * scale, torch.zeros_like(zero))
    step = ((zero + (QMAX - MID) * scale - low) / QMAX).clamp(min=0.0)
    step_unit, step_levels = _six_bit(step.reshape(n, groups // per_block, per_block))
    min_unit, min_levels = _six_bit((-low).reshape(n, groups // per_block, per_block))

    def grid(ds: int, dm: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = (step_unit * (step_levels + ds).clamp(0, SUPER_LEVELS)).reshape(n, groups)
        return s, MID * s - (min_unit * (min_levels + dm).clamp(0, SUPER_LEVELS)).reshape(n, groups)

    best_scale, best_zero = grid(0, 0)
    if g is None:
        return best_scale, best_zero
    best = group_sq_error(g, round_to_grid(g, best_scale, best_zero), best_scale, best_zero, weights)
    for ds in LEVEL_STEPS:
        for dm in LEVEL_STEPS:
            if ds or dm:
                s, z = grid(ds, dm)
                err = group_sq_error(g, round_to_grid(g, s, z), s, z, weights)
                better = err < best
                best = torch.where(better, err, best)
                best_scale, best_zero = torch.where(better, s, best_scale), torch.where(better, z, best_zero)
    return best_scale, best_zero


def _six_bit(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [..., B] >= 0 (fp32) -> (one fp16 unit per [...] as fp64 [..., 1], the nearest
    levels 0..63 [..., B] as fp64)."""
    unit = (values.amax(dim=-1, keepdim=True) / SUPER_LEVELS).to(torch.float16).to(torch.float64)
    return unit, torch.round(values / torch.where(unit == 0, 1.0, unit)).clamp_(0, SUPER_LEVELS)
