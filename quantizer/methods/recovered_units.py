"""A K-quant super-block's units for grids recovered group by group (see :mod:`.recovery`): the
groups' steps, and their lowest points, as levels of one fp16 unit each per super-block. Pure
tensor functions."""

from __future__ import annotations

import torch

from .codes import code_range
from .superblock import SIGNED_LEVELS, SUPER_LEVELS, fp16_units

NEAR = 2.0**-20  # relative slack of an exact grid's steps before they are snapped to their levels
LOWEST_CODES = 8  # codes the most negative group's lowest value may have, tried for a minimum's unit


def on_units(g: torch.Tensor, step: torch.Tensor, low: torch.Tensor, found: torch.Tensor, symmetric: bool,
             bits: int, per_block: int, slack: float):
    """The steps (and minimums) of the super-blocks whose groups were all found, snapped to levels of
    one fp16 unit per super-block where such units exist; found for those super-blocks' groups."""
    n, groups = step.shape
    shape = (n, groups // per_block, per_block)
    whole = found.reshape(shape).all(-1)
    rows = whole.nonzero(as_tuple=True)
    block_found = torch.zeros(n, groups // per_block, dtype=torch.bool, device=step.device)
    if not rows[0].numel():
        return step, low, block_found.repeat_interleave(per_block, dim=1)
    step, low = step.reshape(shape).clone(), low.reshape(shape).clone()
    if symmetric:  # a group's sign is free where its codes allow; only -128 has no positive twin
        s_unit, s_levels, ok = fp16_units(step[rows].abs(), (0, -SIGNED_LEVELS[0]), slack)
        sign = torch.where(s_levels == -SIGNED_LEVELS[0], -1.0, torch.sign(step[rows]))
        step[rows] = sign * s_unit * s_levels
    else:
        s_unit, s_levels, ok = fp16_units(step[rows], (0, SUPER_LEVELS), slack)
        step[rows] = s_unit * s_levels
    if not symmetric:
        blocks = g.reshape(*shape, -1)[rows].to(torch.float64)
        low[rows], m_ok = _minimum_units(step[rows], blocks.amin(-1), blocks.amax(-1), bits, slack)
        ok = ok & m_ok
    block_found[rows] = ok.squeeze(-1)
    return step.reshape(n, groups), low.reshape(n, groups), block_found.repeat_interleave(per_block, dim=1)


def _minimum_units(step: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int, near: float):
    """Per super-block (rows of [B, per] groups with their snapped steps, lowest and highest
    values), the groups' lowest grid points ``-unit * m`` (m in 0..63, one fp16 unit per
    super-block) with each group's values on its codes: the lowest value's code c is not known, so
    each c the group's span allows is tried, and the unit is sought from the most negative group
    (its lowest value at each of the first :data:`LOWEST_CODES` codes) over each level.
    -> (low [B, per] fp64, found [B, 1])."""
    _, qmax = code_range(bits)
    span = torch.round((hi - lo) / torch.where(step == 0, 1.0, step))
    codes = torch.arange(qmax + 1, dtype=torch.float64, device=step.device)
    depth = codes * step.unsqueeze(-1) - lo.unsqueeze(-1)  # [B, per, c]: -low if the lowest value has code c
    allowed = codes <= (qmax - span).unsqueeze(-1)
    deepest = (-lo).argmax(-1, keepdim=True)
    low, found = torch.zeros_like(step), torch.zeros(step.shape[0], 1, dtype=torch.bool, device=step.device)
    for first in range(LOWEST_CODES):
        left = (~found).squeeze(-1).nonzero().squeeze(-1)
        if not left.numel():
            break
        d, a = depth[left], allowed[left]
        top = d.gather(1, deepest[left].unsqueeze(-1).expand(-1, 1, d.shape[-1]))[..., first]  # [b, 1]
        slack = near * d.abs().amax((-2, -1), keepdim=True)
        for level in range(SUPER_LEVELS, 0, -1):
            unit = (top / level).to(torch.float16).to(torch.float64).unsqueeze(-1)  # [b, 1, 1]
            m = torch.round(d / torch.where(unit == 0, 1.0, unit))
            miss = (m * unit - d).abs()
            fits = a & (m >= 0) & (m <= SUPER_LEVELS) & (miss <= slack)
            ok = ~found[left] & fits.any(-1).all(-1, keepdim=True) & (unit.squeeze(-1) > 0)
            if bool(ok.any()):
                c = torch.where(fits, miss, torch.inf).argmin(-1, keepdim=True)  # each group's closest fit
                chosen = -(m.gather(-1, c).squeeze(-1) * unit.squeeze(-1))
                low[left] = torch.where(ok, chosen, low[left])
                found[left] |= ok
                if bool(found[left].all()):
                    break
    return low, found
