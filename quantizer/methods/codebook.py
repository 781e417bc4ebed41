"""Non-linear grids: code q of a group stands for ``levels[q] * scale``, with a fixed table of
integer levels, as GGUF's IQ4_NL and IQ4_XS store 4-bit codes (:data:`IQ4_LEVELS`). Pure tensor
functions.

* IQ4_NL: one fp16 scale per group of 32.
* IQ4_XS: super-blocks of 8 such groups, each group's scale a level -32..31 of the super-block's
  fp16 unit (:data:`XS_SCALE_LEVELS`).

A group's scale may take either sign: the table is not symmetric (-127..113), so its extreme
value may go to either end. Codes are always the nearest levels to ``w / scale`` as stored.
"""

from __future__ import annotations

import functools

import torch

from .superblock import fp16_units

IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
XS_SCALE_LEVELS = (-32, 31)
SEARCH_STEPS = range(-7, 8)
"""Level offsets tried for a group's extreme value, at each end of the table: llama.cpp's IQ4
search tries the extreme at ``levels[0] + t`` for t in -7..7 (and first at ``-levels[0]``);
int4q tries the top end too."""
LEVEL_MOVES = (-1, 1)  # super-block scale level changes tried per group
UNIT_TOLERANCE = 2.0**-20
"""How far (relative to a super-block's largest) group scales may sit from levels of one fp16 unit
and still be taken as those levels: a scale refitted in fp32 on a weight that GGML decoded
(``(d * ls) * level``, rounded to fp32) lands within an ulp of its own."""


def level_table(levels: tuple[int, ...], device=None) -> torch.Tensor:
    return torch.tensor(levels, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=8)
def _lookup(levels: tuple[int, ...], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, levels fp32) indexed by ``ceil(2 x) - 2 levels[0]``, clamped to the table:
    integer levels put every midpoint between neighbours on a multiple of 1/2, so that index
    alone says which levels x lies between (a tie takes the lower)."""
    table = level_table(levels)
    twice_midpoints = table[1:] + table[:-1]
    index = torch.arange(2 * levels[0], 2 * levels[-1] + 1, dtype=torch.float32)
    codes = (twice_midpoints.view(1, -1) < index.view(-1, 1)).sum(-1)
    return codes.to(torch.uint8).to(device), table[codes].to(device)


def _nearest(units: torch.Tensor, levels: tuple[int, ...], values: bool) -> torch.Tensor:
    """The nearest levels' codes (uint8) or values (fp32) to ``units``, by :func:`_lookup` (an
    int32 gather: ten times faster than a binary search of the midpoints)."""
    table = _lookup(levels, str(units.device))[1 if values else 0]
    index = torch.ceil(units * 2).clamp_(2 * levels[0], 2 * levels[-1]).to(torch.int32).sub_(2 * levels[0])
    return table.index_select(0, index.reshape(-1)).view(units.shape)


def nearest_levels(units: torch.Tensor, levels: tuple[int, ...]) -> torch.Tensor:
    """Codes (uint8) of the levels nearest to ``units`` (w / scale, any shape; a tie takes the lower)."""
    return _nearest(units, levels, values=False)


def codebook_values(codes: torch.Tensor, scale: torch.Tensor, levels: tuple[int, ...]) -> torch.Tensor:
    """``levels[q] * scale`` in fp32: codes [..., group], scale [...] per group."""
    table = level_table(levels, codes.device)
    return table[codes.long()] * scale.to(torch.float32).unsqueeze(-1)


def dequantize_levels(codes: torch.Tensor, scale: torch.Tensor, levels: tuple[int, ...],
                      dtype=torch.float32) -> torch.Tensor:
    """Weight [N, K] from codes [N, K] and scale [N, K // group], computed in fp32, rounded once."""
    n, k = codes.shape
    grouped = codes.reshape(n, scale.shape[1], -1)
    return codebook_values(grouped, scale, levels).reshape(n, k).to(dtype)


def round_to_levels(g: torch.Tensor, scale: torch.Tensor, levels: tuple[int, ...]) -> torch.Tensor:
    """Nearest codes for g [..., group] (fp32) on scales [...] per group (scale 0: the level
    nearest 0)."""
    return nearest_levels(_units(g, scale), levels)


def _units(g: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """g [..., group] over its group's scale [...] (0 where the scale is 0)."""
    s = scale.to(torch.float32).unsqueeze(-1)
    return g / torch.where(s == 0, 1.0, s) * (s != 0)


def _levels_on(g: torch.Tensor, scale: torch.Tensor, levels: tuple[int, ...]) -> torch.Tensor:
    """The levels (fp32) of the nearest codes for g [N, G, B] on ``scale`` [N, G] fp32."""
    return _nearest(_units(g, scale), levels, values=True)


def _error(g: torch.Tensor, weights: torch.Tensor, u: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per group, sum(w (u * scale - g)^2): the weighted squared error of levels u at ``scale``
    (summed directly, not from moments: near a grid it is a small difference of large sums)."""
    return (weights * (u * scale.unsqueeze(-1) - g).square_()).sum(-1)


def _refit(g: torch.Tensor, weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per group, the weighted least-squares scale for levels u: sum(w u g) / sum(w u u)."""
    wu = weights * u
    return (wu * g).sum(-1) / (wu * u).sum(-1).clamp(min=1e-30)


def codebook_search(g: torch.Tensor, weights: torch.Tensor, storage) -> tuple[torch.Tensor, ...]:
    """Per group of g [N, G, B] (fp32), the stored scale, zero (0) and nearest codes minimising the
    weighted squared error, weights [G, B] >= 0, on ``storage.codebook``'s levels. Candidates: the
    group's extreme value at each level offset of :data:`SEARCH_STEPS` from either end of the
    table, at minus the bottom level and at every level (so that a group already on a grid of the
    table gets it back exactly); for each, the least-squares scale for its nearest codes,
    stored, is scored with the nearest codes on it (as they will be stored). With
    ``storage.superblock`` groups per super-block
    (where a row fills them), the winners' scales become levels of a unit
    (:func:`_superblock_scales`). Returns (scale, zero) in ``storage.exact_dtype`` and codes uint8."""
    levels = storage.codebook
    coupled = storage.couples(g.shape[1])
    dtype = torch.float32 if coupled else storage.scale_dtype
    top = g.gather(-1, g.abs().argmax(-1, keepdim=True)).squeeze(-1)
    best_scale = (top / levels[0]).to(dtype).to(torch.float32)
    best = _error(g, weights, _levels_on(g, best_scale, levels), best_scale)
    divisors = sorted({end + step for end in (levels[0], levels[-1]) for step in SEARCH_STEPS} | {-levels[0]}
                      | set(levels))
    for divisor in divisors:
        scale = _refit(g, weights, _levels_on(g, top / divisor, levels)).to(dtype).to(torch.float32)
        err = _error(g, weights, _levels_on(g, scale, levels), scale)
        better = err < best
        best, best_scale = torch.where(better, err, best), torch.where(better, scale, best_scale)
    if coupled:
        best_scale = _superblock_scales(g, weights, best_scale, storage.superblock, levels)
    scale = best_scale.to(storage.exact_dtype)
    return scale, torch.zeros_like(scale), round_to_levels(g, best_scale, levels)


def _superblock_scales(g: torch.Tensor, weights: torch.Tensor, scale: torch.Tensor, per_block: int,
                       levels: tuple[int, ...]) -> torch.Tensor:
    """Group scales [N, G] fp32 as IQ4_XS stores them: per super-block of ``per_block`` groups one
    fp16 unit that puts the scale of largest magnitude at level -32 (or, where the scales are all
    levels -32..31 of one fp16 unit to within :data:`UNIT_TOLERANCE`, that unit), each scale the
    nearest level -32..31 of it, then moved by one level where that lowers the group's error on g
    (nearest codes on each). Returns the products in fp64 (exact)."""
    n, groups = scale.shape
    blocks = scale.to(torch.float64).reshape(n, groups // per_block, per_block)
    top = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    unit = (top / XS_SCALE_LEVELS[0]).to(torch.float16).to(torch.float64)
    exact_unit, _, exact = fp16_units(blocks, XS_SCALE_LEVELS, UNIT_TOLERANCE)  # already levels of a unit: kept
    unit = torch.where(exact, exact_unit, unit)
    base = torch.round(blocks / torch.where(unit == 0, 1.0, unit)).clamp(*XS_SCALE_LEVELS)

    def at(move: int) -> tuple[torch.Tensor, torch.Tensor]:
        exact = (unit * (base + move).clamp(*XS_SCALE_LEVELS)).reshape(n, groups)
        s = exact.to(torch.float32)
        return exact, _error(g, weights, _levels_on(g, s, levels), s)

    best_scale, best = at(0)
    for move in LEVEL_MOVES:
        candidate, err = at(move)
        better = err < best
        best, best_scale = torch.where(better, err, best), torch.where(better, candidate, best_scale)
    return best_scale
