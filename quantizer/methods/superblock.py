"""K-quant super-blocks: groups whose grids are stored as integer levels of fp16 units, one set
of units per super-block, as GGUF's K-quants hold them. Pure tensor functions.

* asymmetric (Q4_K, Q5_K): each group's step and minimum (its lowest point, at most 0) are
  levels 0..63 of two fp16 units;
* symmetric (Q6_K): each group's signed step is a level -128..127 of one fp16 unit.
"""

from __future__ import annotations

import torch

from .candidates import grid_errors
from .codes import code_range

SUPER_LEVELS = 63  # the asymmetric super-blocks' 6-bit levels
SIGNED_LEVELS = (-128, 127)  # the symmetric super-blocks' 8-bit levels
LEVEL_STEPS = (0, -1, 1)  # level changes tried per group, for its step and its minimum


def superblock_grids(scale: torch.Tensor, zero: torch.Tensor, storage, symmetric: bool, g: torch.Tensor | None = None,
                     weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's grid (scale, zero) [N, G] as super-blocks of ``storage.superblock`` groups
    store it (``storage.bits``-bit codes). Asymmetric: the grid's lowest point raised to at most
    0, the step kept covering its top, then step and -lowest each rounded to a level 0..63 of the
    super-block's fp16 unit (its largest value / 63). Symmetric: each signed step rounded to a
    level -128..127 of the unit that puts the largest step at -128 (as llama.cpp's Q6_K).

    With the weights g [N, G, group] (fp32), each group's levels are then moved by -1, 0 or +1 to
    the ones whose nearest codes give the least squared error on g (weighted by ``weights``
    [G, group]), the units staying fixed. Returns fp64 (scale, zero), exact in the stored values.
    """
    n, groups = scale.shape
    per_block, bits = storage.superblock, storage.bits
    blocks = (n, groups // per_block, per_block)
    if symmetric:
        unit, levels = _signed_levels(scale.to(torch.float32).reshape(blocks))

        def grid(ds: int, dm: int) -> tuple[torch.Tensor, torch.Tensor]:
            s = (unit * (levels + ds).clamp(*SIGNED_LEVELS)).reshape(n, groups)
            return s, torch.zeros_like(s)
        moves = [(ds, 0) for ds in LEVEL_STEPS]
    else:
        mid, qmax = code_range(bits)
        scale, zero = scale.to(torch.float32), zero.to(torch.float32)
        low = torch.minimum(zero - mid * scale, torch.zeros_like(zero))
        step = ((zero + (qmax - mid) * scale - low) / qmax).clamp(min=0.0)
        step_unit, step_levels = _six_bit(step.reshape(blocks))
        min_unit, min_levels = _six_bit((-low).reshape(blocks))

        def grid(ds: int, dm: int) -> tuple[torch.Tensor, torch.Tensor]:
            s = (step_unit * (step_levels + ds).clamp(0, SUPER_LEVELS)).reshape(n, groups)
            return s, mid * s - (min_unit * (min_levels + dm).clamp(0, SUPER_LEVELS)).reshape(n, groups)
        moves = [(ds, dm) for ds in LEVEL_STEPS for dm in LEVEL_STEPS]
    if g is None:
        return grid(0, 0)
    grids = [grid(ds, dm) for ds, dm in moves]
    errors = grid_errors(g, grids, weights, bits)
    (best_scale, best_zero), best = grids[0], errors[0]
    for (s, z), err in zip(grids[1:], errors[1:]):
        better = err < best
        best = torch.where(better, err, best)
        best_scale, best_zero = torch.where(better, s, best_scale), torch.where(better, z, best_zero)
    return best_scale, best_zero


def _six_bit(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [..., B] >= 0 (fp32) -> (one fp16 unit per [...] as fp64 [..., 1], the nearest
    levels 0..63 [..., B] as fp64)."""
    unit = (values.amax(dim=-1, keepdim=True) / SUPER_LEVELS).to(torch.float16).to(torch.float64)
    return unit, torch.round(values / torch.where(unit == 0, 1.0, unit)).clamp_(0, SUPER_LEVELS)


def _signed_levels(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [..., B] (fp32, signed) -> (one fp16 unit per [...] as fp64 [..., 1]: minus the
    value of largest magnitude over 128, the nearest levels -128..127 [..., B] as fp64)."""
    top = values.gather(-1, values.abs().argmax(dim=-1, keepdim=True))
    unit = (-top / -SIGNED_LEVELS[0]).to(torch.float16).to(torch.float64)
    return unit, torch.round(values / torch.where(unit == 0, 1.0, unit)).clamp_(*SIGNED_LEVELS)


def fp16_units(values: torch.Tensor, levels: tuple[int, int], tolerance: float = 0.0) -> tuple[torch.Tensor, ...]:
    """values [..., B] (fp64, each an fp16 unit times an integer level in ``levels``) -> (the unit
    [..., 1] fp64, the levels [..., B] int64, found [..., 1] bool): per row of B, an fp16 unit whose
    integer multiples in ``levels`` are the values exactly (within ``tolerance`` of the row's
    largest magnitude), where one exists (0 and levels 0 where all the values are 0). Any such unit
    is as good as another: the products are what is stored."""
    low, high = levels
    top = values.gather(-1, values.abs().argmax(dim=-1, keepdim=True))
    unit = torch.zeros_like(top)
    found = top == 0
    for top_level in sorted((lv for lv in range(low, high + 1) if lv), key=lambda lv: (-abs(lv), lv)):
        if bool(found.all()):
            break
        u = (top / top_level).to(torch.float16).to(torch.float64)
        got = torch.round(values / torch.where(u == 0, 1.0, u))
        near = (got * u - values).abs() <= tolerance * top.abs()
        ok = ~found & (u != 0) & ((got >= low) & (got <= high) & near).all(dim=-1, keepdim=True)
        unit, found = torch.where(ok, u, unit), found | ok
    return unit, torch.round(values / torch.where(unit == 0, 1.0, unit)).to(torch.int64), found


def better_superblocks(g: torch.Tensor, weights: torch.Tensor | None, bits: int, per_block: int,
                       ours: tuple[torch.Tensor, torch.Tensor],
                       theirs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per super-block of ``per_block`` groups, whichever of two stored grids (scale, zero) [N, G]
    gives the lesser squared error on g [N, G, group] with nearest codes (weighted by ``weights``
    [G, group]); ``ours`` on a tie."""
    n, groups, _ = g.shape

    mine, other = (err.to(torch.float64).reshape(n, groups // per_block, per_block).sum(-1, keepdim=True)
                   for err in grid_errors(g, [ours, theirs], weights, bits))
    take = (other < mine).expand(n, groups // per_block, per_block).reshape(n, groups)
    return torch.where(take, theirs[0], ours[0]), torch.where(take, theirs[1], ours[1])
