"""A grid an already-quantized checkpoint stores, moved onto the grid an output format stores, with
no rounding where the output can hold it. Pure tensor functions.

A source weight [N, K] is ``w[n, k] = (codes[n, k] - mid) * scale[n, g] + zero[n, g]`` with
``g = group[k]`` (GPTQ's ``g_idx``: act-order checkpoints put any column in any group); int4q's
convention for every grid (see :mod:`.grid`), so an integer zero point z is ``zero = (mid - z) *
scale``. The output's groups are runs of ``group_size`` consecutive columns, each of which must lie
in one source group for the source's grid to carry over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codes import code_range, round_to_grid
from .grid import GroupQuantized, Storage


@dataclass(frozen=True)
class SourceGrid:
    """codes uint8 [N, K]; scale and zero fp64 [N, G] (the stored values, exactly); group int64 [K]."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group: torch.Tensor
    bits: int = 4

    def dequantize(self) -> torch.Tensor:
        """The weight [N, K] fp32 the source stands for (fp64 products rounded once)."""
        mid = code_range(self.bits)[0]
        g = self.group
        return ((self.codes.to(torch.float64) - mid) * self.scale[:, g] + self.zero[:, g]).to(torch.float32)

    def rows(self, rows: slice) -> "SourceGrid":
        return SourceGrid(self.codes[rows], self.scale[rows], self.zero[rows], self.group, self.bits)


def integer_zero(zero_point: torch.Tensor, scale: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int4q's zero (fp64) of a grid ``(q - zero_point) * scale``."""
    return (code_range(bits)[0] - zero_point.to(torch.float64)) * scale.to(torch.float64)


@dataclass(frozen=True)
class Transfer:
    """The output grid of one weight: ``quantized`` on the output's storage; ``exact`` when it
    dequantizes to the source's values bit for bit."""

    quantized: GroupQuantized
    exact: bool


def transfer_grid(source: SourceGrid, group_size: int, symmetric: bool, storage: Storage) -> Transfer | None:
    """The source's grid on groups of ``group_size`` as ``storage`` holds them: its codes, scales and
    zeros where the storage holds them exactly; else each group's scale and zero rounded to the
    storage's nearest and the codes chosen again against them (``exact`` False). None where the
    grid cannot carry over at all: an output group spanning two source groups, other code widths,
    K-quant super-blocks (their grids are levels of shared units), non-linear grids, or a symmetric
    output of a source whose zeros are not 0."""
    n, k = source.codes.shape
    if k % group_size or storage.bits != source.bits or storage.couples(k // group_size) or storage.codebook:
        return None
    runs = source.group.reshape(k // group_size, group_size)
    if not bool((runs == runs[:, :1]).all()):
        return None
    own = runs[:, 0]
    scale, zero = source.scale[:, own], source.zero[:, own]
    if symmetric and bool((zero != 0).any()):
        return None
    stored_scale, stored_zero = _stored(scale, zero, symmetric, storage)
    exact = bool(torch.equal(stored_scale.to(torch.float64), scale)) and bool(
        torch.equal(stored_zero.to(torch.float64), zero))
    codes = source.codes
    if not exact:
        g = source.dequantize().reshape(n, k // group_size, group_size)
        codes = round_to_grid(g, stored_scale, stored_zero, source.bits).reshape(n, k)
    return Transfer(GroupQuantized(codes, stored_scale, stored_zero, source.bits), exact)


def _stored(scale: torch.Tensor, zero: torch.Tensor, symmetric: bool, storage: Storage):
    """(scale, zero) fp64 [N, G] as ``storage`` holds them, in its exact dtype: each rounded to the
    nearest value it can hold (an integer zero point to the nearest in 1..qmax)."""
    mid, qmax = code_range(storage.bits)
    s = scale.to(storage.scale_dtype).to(torch.float64)
    if not storage.signed_scale:
        s = s.clamp(min=0.0)
    if symmetric:
        z = torch.zeros_like(s)
    elif storage.zero == "float":
        z = zero.to(storage.scale_dtype).to(torch.float64)
    elif storage.zero == "min":
        z = (zero - mid * scale).to(storage.scale_dtype).to(torch.float64) + mid * s
    else:
        point = torch.round(mid - zero / torch.where(s == 0, 1.0, s)).clamp(1, qmax)
        z = (mid - point) * s
    return s.to(storage.exact_dtype), z.to(storage.exact_dtype)
