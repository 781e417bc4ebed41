"""The group-wise 4-bit grid every method quantizes onto, and round-to-nearest. Pure tensor functions.

A weight [N, K] is cut into groups of ``group_size`` consecutive input columns. Each group has a
bf16 ``scale`` and ``zero`` and codes ``q`` in [0, 15], dequantized as ``(q - 8) * scale + zero``.

* asymmetric (min/max): ``scale = (max - min) / 15``, ``zero = min + 8 * scale``, so code 0 is
  the group minimum and code 15 its maximum.
* symmetric: ``zero = 0`` and ``scale = max(-min / 8, max / 7)``, the smallest step whose grid
  [-8, 7] * scale still covers the group.

Codes are always chosen against the scale and zero *as stored* (rounded to bf16).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

QMAX = 15
MID = 8  # the code that dequantizes to ``zero``
ROW_CHUNK = 4096  # rows are independent: methods work in row chunks to bound their fp32 copies
CLIP_SHRINKS = torch.linspace(1.0, 0.80, 21).tolist()


@dataclass(frozen=True)
class GroupQuantized:
    """A quantized weight: codes uint8 [N, K] in 0..15, scale and zero bf16 [N, K // group_size]."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return dequantize_codes(self.codes, self.scale, self.zero, dtype)

    def rows(self, rows: slice) -> "GroupQuantized":
        return GroupQuantized(self.codes[rows], self.scale[rows], self.zero[rows])


def grid_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``(q - 8) * scale + zero`` in fp32: codes [..., group], scale and zero [...] per group."""
    return (codes.to(torch.float32) - MID) * scale.to(torch.float32).unsqueeze(-1) + zero.to(torch.float32).unsqueeze(-1)


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """Weight [N, K] from codes [N, K] (any dtype holding 0..15) and scale, zero [N, K // group],
    computed in fp32 and rounded once to ``dtype``."""
    n, k = codes.shape
    groups = scale.shape[1]
    return grid_values(codes.reshape(n, groups, k // groups), scale, zero).reshape(n, k).to(dtype)


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"input dim {k} is not a multiple of group size {group_size}")
    return w.to(torch.float32).reshape(n, k // group_size, group_size)


def grid_params(lo: torch.Tensor, hi: torch.Tensor, symmetric: bool,
                integer_zero: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group range [lo, hi] (fp32) -> (scale, zero) as stored.

    cpu_int4: both rounded to bf16. ``integer_zero`` (the GPTQ checkpoint format): scale rounded
    to fp16 and ``zero = (8 - z) * scale`` for an integer zero point z in [1, 15] (GPTQ's v1
    convention stores z - 1 in 4 bits), returned in fp32, where that product is exact.
    """
    if symmetric:
        scale = torch.maximum(-lo / MID, hi / (QMAX - MID)).clamp(min=0.0)
    else:
        scale = (hi - lo) / QMAX
    if not integer_zero:
        zero = torch.zeros_like(scale) if symmetric else lo + MID * scale
        return scale.to(torch.bfloat16), zero.to(torch.bfloat16)
    scale = scale.to(torch.float16).to(torch.float32)
    if symmetric:
        z = torch.full_like(scale, float(MID))
    else:
        z = torch.round(-lo / torch.where(scale == 0, 1.0, scale)).clamp(1, QMAX)
    return scale, (MID - z) * scale


def round_to_grid(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Nearest codes for w [..., group] (fp32) on a grid given per group [...] -> uint8 in 0..15.

    A group with scale 0 (all its values equal) gets code 8, which dequantizes to ``zero``.
    """
    s = scale.to(torch.float32).unsqueeze(-1)
    z = zero.to(torch.float32).unsqueeze(-1)
    safe = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round((w - z) / safe + MID).clamp_(0, QMAX)
    return torch.where(s == 0, torch.full_like(q, float(MID)), q).to(torch.uint8)


def quantize_groupwise(w: torch.Tensor, group_size: int, symmetric: bool = False, clip_search: bool = False,
                       integer_zero: bool = False) -> GroupQuantized:
    """Round-to-nearest quantization of w [N, K] (any float dtype); ``integer_zero`` as in :func:`grid_params`.

    With ``clip_search`` each group's range is shrunk towards its centre (symmetric: towards 0)
    by the factor in ``CLIP_SHRINKS`` that minimises that group's squared error.
    """
    g = _grouped(w, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale, zero = grid_params(lo, hi, symmetric, integer_zero)
    codes = round_to_grid(g, scale, zero)
    if clip_search:
        best_err = _group_sq_error(g, codes, scale, zero)
        for shrink in CLIP_SHRINKS[1:]:
            if symmetric:
                s_lo, s_hi = lo * shrink, hi * shrink
            else:
                mid = (lo + hi) / 2
                s_lo, s_hi = mid + (lo - mid) * shrink, mid + (hi - mid) * shrink
            s2, z2 = grid_params(s_lo, s_hi, symmetric, integer_zero)
            c2 = round_to_grid(g, s2, z2)
            err = _group_sq_error(g, c2, s2, z2)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            scale = torch.where(better, s2, scale)
            zero = torch.where(better, z2, zero)
            codes = torch.where(better.unsqueeze(-1), c2, codes)
    n, k = w.shape
    return GroupQuantized(codes.reshape(n, k), scale, zero)


def _group_sq_error(g, codes, scale, zero) -> torch.Tensor:
    return (grid_values(codes, scale, zero) - g).pow(2).sum(dim=-1)


class ErrorStats:
    """Accumulates SNR (dB, signal power over error power) and max abs error over chunks."""

    def __init__(self) -> None:
        self.signal = 0.0
        self.noise = 0.0
        self.max_abs_err = 0.0

    def add(self, reference: torch.Tensor, approx: torch.Tensor) -> None:
        ref = reference.to(torch.float32)
        err = approx.to(torch.float32) - ref
        self.signal += ref.pow(2).sum().item()
        self.noise += err.pow(2).sum().item()
        if err.numel():
            self.max_abs_err = max(self.max_abs_err, err.abs().max().item())

    @property
    def snr_db(self) -> float:
        if self.noise == 0:
            return float("inf")
        if self.signal == 0:
            return float("-inf")
        return 10.0 * math.log10(self.signal / self.noise)

    def as_dict(self) -> dict[str, float | None]:
        """JSON-ready: an exact tensor's infinite SNR becomes null."""
        snr = self.snr_db
        return {"snr_db": round(snr, 4) if math.isfinite(snr) else None, "max_abs_err": self.max_abs_err}
