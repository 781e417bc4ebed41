"""4-bit codes and the values they stand for on a group's grid, ``(q - 8) * scale + zero``.
Pure tensor functions."""

from __future__ import annotations

import torch

QMAX = 15
MID = 8  # the code that dequantizes to ``zero``


def grid_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``(q - 8) * scale + zero`` in fp32: codes [..., group], scale and zero [...] per group."""
    return (codes.to(torch.float32) - MID) * scale.to(torch.float32).unsqueeze(-1) + zero.to(torch.float32).unsqueeze(-1)


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """Weight [N, K] from codes [N, K] (any dtype holding 0..15) and scale, zero [N, K // group],
    computed in fp32 and rounded once to ``dtype``."""
    n, k = codes.shape
    groups = scale.shape[1]
    return grid_values(codes.reshape(n, groups, k // groups), scale, zero).reshape(n, k).to(dtype)


def round_to_grid(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Nearest codes for w [..., group] (fp32) on a grid given per group [...] -> uint8 in 0..15.

    A group with scale 0 (all its values equal) gets code 8, which dequantizes to ``zero``.
    """
    s = scale.to(torch.float32).unsqueeze(-1)
    z = zero.to(torch.float32).unsqueeze(-1)
    safe = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round((w - z) / safe + MID).clamp_(0, QMAX)
    return torch.where(s == 0, torch.full_like(q, float(MID)), q).to(torch.uint8)


def group_sq_error(g, codes, scale, zero, weights=None) -> torch.Tensor:
    """Per group, sum(weights * (deq - g)^2) over its elements (unweighted: weights None)."""
    err = (grid_values(codes, scale, zero) - g).pow(2)
    return (err if weights is None else err * weights).sum(dim=-1)
