"""Group codes and the values they stand for on a group's grid, ``(q - mid) * scale + zero``,
with ``bits``-bit codes 0..2^bits - 1 around mid = 2^(bits - 1) (4-bit: 0..15 around 8; GGUF's
5- and 6-bit types: 0..31 around 16, 0..63 around 32). Pure tensor functions."""

from __future__ import annotations

import torch

QMAX = 15
MID = 8  # the 4-bit code that dequantizes to ``zero``


def code_range(bits: int = 4) -> tuple[int, int]:
    """(mid, qmax) of a ``bits``-bit grid: the code that stands for ``zero``, and the top code."""
    return 1 << (bits - 1), (1 << bits) - 1


def grid_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """``(q - mid) * scale + zero`` in fp32: codes [..., group], scale and zero [...] per group."""
    mid = code_range(bits)[0]
    return (codes.to(torch.float32) - mid) * scale.to(torch.float32).unsqueeze(-1) + zero.to(torch.float32).unsqueeze(-1)


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype=torch.bfloat16,
                     bits: int = 4) -> torch.Tensor:
    """Weight [N, K] from codes [N, K] (any dtype holding 0..2^bits - 1) and scale, zero [N, K // group],
    computed in fp32 and rounded once to ``dtype``."""
    n, k = codes.shape
    groups = scale.shape[1]
    return grid_values(codes.reshape(n, groups, k // groups), scale, zero, bits).reshape(n, k).to(dtype)


def round_to_grid(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Nearest codes for w [..., group] (fp32) on a grid given per group [...] -> uint8 in 0..2^bits - 1.

    A group with scale 0 (all its values equal) gets code mid, which dequantizes to ``zero``.
    """
    mid, qmax = code_range(bits)
    s = scale.to(torch.float32).unsqueeze(-1)
    z = zero.to(torch.float32).unsqueeze(-1)
    safe = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round((w - z) / safe + mid).clamp_(0, qmax)
    return torch.where(s == 0, torch.full_like(q, float(mid)), q).to(torch.uint8)


def group_sq_error(g, codes, scale, zero, weights=None, bits: int = 4) -> torch.Tensor:
    """Per group, sum(weights * (deq - g)^2) over its elements (unweighted: weights None)."""
    err = (grid_values(codes, scale, zero, bits) - g).pow(2)
    return (err if weights is None else err * weights).sum(dim=-1)
