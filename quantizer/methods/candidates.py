"""How well a candidate grid fits each group, in one pass over its weights: the grid searches score
every candidate with it. Pure tensor functions.

Per group of g and its grid (scale, zero), with q the nearest codes, u = q - mid and w each
column's weight: ``[sum(w (deq - g)^2), sum(w u), sum(w u u), sum(w u g)]``, the squared error
and what the weighted least-squares refit of the grid needs. Element j of a group adds to lane
j % 8; each lane sums in element order and the eight lanes then pairwise. int4q's native kernel
(``int4q_native::grid_scores``) sums the same way and proves itself on first use
(:mod:`.native`); torch's form runs where it cannot, off the CPU, and for groups that 8 does not
divide.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..native.checked import CheckedKernel
from .codes import code_range

LANES = 8
ERROR, WU, WUU, WUG = range(4)  # the columns of :func:`grid_scores`


def grid_scores(g: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, weights: torch.Tensor | None = None,
                bits: int = 4) -> torch.Tensor:
    """g [N, G, group] fp32, scale and zero [N, G] (any float dtype, used as fp32), weights [G, group]
    >= 0 (None: all 1) -> fp32 [N, G, 4]: per group the columns ERROR, WU, WUU and WUG above."""
    n, groups, group = g.shape
    weights = torch.ones(groups, group, device=g.device) if weights is None else weights
    args = (g.to(torch.float32).contiguous(), weights.to(torch.float32).contiguous(),
            scale.to(torch.float32).contiguous(), zero.to(torch.float32).contiguous(), code_range(bits)[1])
    out = torch.empty(n, groups, 4, device=g.device)
    scorer = KERNEL() if g.device.type == "cpu" and group % LANES == 0 else torch_scores
    scorer(*args, out)
    return out


def grid_errors(g: torch.Tensor, grids: list[tuple[torch.Tensor, torch.Tensor]], weights: torch.Tensor | None = None,
                bits: int = 4) -> torch.Tensor:
    """g [N, G, group] fp32 and C candidate grids (scale, zero) [N, G] (any float dtype, used as fp32),
    weights [G, group] -> fp32 [C, N, G]: each grid's ERROR column of :func:`grid_scores`, the
    candidates scored in one pass where the native kernel runs (each group's values then stay in
    cache)."""
    n, groups, group = g.shape
    weights = torch.ones(groups, group, device=g.device) if weights is None else weights
    scales, zeros = (torch.stack([grid[i].to(torch.float32) for grid in grids]).contiguous() for i in (0, 1))
    out = torch.empty(len(grids), n, groups, device=g.device)
    scorer = ERRORS() if g.device.type == "cpu" and group % LANES == 0 else torch_errors
    scorer(g.to(torch.float32).contiguous(), weights.to(torch.float32).contiguous(), scales, zeros,
           code_range(bits)[1], out)
    return out


def torch_errors(g: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, qmax: int,
                 out: torch.Tensor) -> None:
    """:func:`grid_errors` grid by grid with :func:`grid_scores`' kernel, written into ``out`` [C, N, G]."""
    scores = torch.empty(*g.shape[:2], 4, device=g.device)
    scorer = KERNEL() if g.device.type == "cpu" and g.shape[-1] % LANES == 0 else torch_scores
    for c in range(scales.shape[0]):
        scorer(g, weights, scales[c], zeros[c], qmax, scores)
        out[c] = scores[..., ERROR]


def torch_scores(g: torch.Tensor, weights: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmax: int,
                 out: torch.Tensor) -> None:
    """:func:`grid_scores` in torch, written into ``out`` [N, G, 4]; fp32 arguments as the native
    kernel takes them, ``qmax`` the top code."""
    mid = (qmax + 1) // 2
    s, z = scale.unsqueeze(-1), zero.unsqueeze(-1)
    safe = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round((g - z) / safe + mid).clamp_(0, qmax)
    u = torch.where(s == 0, torch.full_like(q, float(mid)), q) - mid
    d, a = u * s + z - g, weights * u
    terms = torch.stack([d * d * weights, a, a * u, a * g], dim=-1)  # [N, G, group, 4]
    out.copy_(lane_sum(terms))


def lane_sum(terms: torch.Tensor) -> torch.Tensor:
    """terms [..., group, C] summed over the group as the kernel sums: element j into lane j % 8 in
    element order (groups padded with zeros to whole lanes), then the lanes pairwise -> [..., C]."""
    group = terms.shape[-2]
    pad = -group % LANES
    if pad:
        terms = F.pad(terms, (0, 0, 0, pad))
    rows = terms.unflatten(-2, (-1, LANES))  # [..., group / 8, 8, C]
    acc = rows[..., 0, :, :]
    for i in range(1, rows.shape[-3]):
        acc = acc + rows[..., i, :, :]
    while acc.shape[-2] > 1:
        acc = acc[..., 0::2, :] + acc[..., 1::2, :]
    return acc.squeeze(-2)


def _operator(library):
    def native(g, weights, scale, zero, qmax, out):
        library.grid_scores(g, weights, scale, zero, qmax, out)
    return native


def _probe(kernel) -> list[torch.Tensor]:
    """Seeded scores of 29 rows of groups of 8, 32 and 64 under 4- and 6-bit grids, with groups of
    scale 0, grids too small for their groups (codes at both ends) and weights with zeros: the
    scores ``kernel`` writes."""
    gen = torch.Generator().manual_seed(0)
    written = []
    for group, qmax in ((8, 15), (32, 15), (64, 63)):
        g = torch.randn(29, 5, group, generator=gen)
        weights = torch.rand(5, group, generator=gen) * (torch.rand(5, group, generator=gen) > 0.1)
        scale = torch.rand(29, 5, generator=gen) * 0.3
        scale[:, 0] = 0.0
        zero = torch.randn(29, 5, generator=gen) * 0.2
        out = torch.empty(29, 5, 4)
        kernel(g, weights, scale, zero, qmax, out)
        written.append(out)
    return written


KERNEL = CheckedKernel(torch_scores, _operator, _probe, "grid scoring")


def _errors_probe(kernel) -> list[torch.Tensor]:
    """Seeded errors of 3 candidate grids for 37 rows of 3 groups (16 groups side by side, then a
    tail) of 8, 16 and 32 under 4- to 6-bit grids, some of scale 0: what ``kernel`` writes."""
    gen = torch.Generator().manual_seed(1)
    written = []
    for group, qmax in ((8, 15), (16, 63), (32, 31)):
        g = torch.randn(37, 3, group, generator=gen)
        weights = torch.rand(3, group, generator=gen) * (torch.rand(3, group, generator=gen) > 0.1)
        scales = (torch.rand(3, 37, 3, generator=gen) - 0.2) * 0.3
        scales[:, :, 0] = 0.0
        zeros = torch.randn(3, 37, 3, generator=gen) * 0.2
        out = torch.empty(3, 37, 3)
        kernel(g, weights, scales, zeros, qmax, out)
        written.append(out)
    return written


ERRORS = CheckedKernel(torch_errors, lambda library: library.grid_errors, _errors_probe, "grid errors")
