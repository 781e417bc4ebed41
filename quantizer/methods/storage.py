"""How a format stores a group's grid (its scale and zero), which fixes the values codes are
rounded against, and the stored grid of a range. Pure tensor functions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .codes import code_range
from .superblock import superblock_grids


@dataclass(frozen=True)
class Storage:
    """How a format stores a group's scale and zero, which fixes the values codes are rounded against.

    ``zero``: "float" (stored in ``scale_dtype``), "integer" (``zero = (8 - z) * scale`` for an
    integer zero point z in [1, 15], as GPTQ v1 and GGUF's Q4_0 hold it) or "min" (an fp16 minimum
    m beside the scale, ``zero = m + 8 * scale``, as GGUF's Q4_1 holds it). ``int8_block``: input
    columns per 8-bit scale (None: one per output channel). ``signed_scale``: a symmetric grid may
    take a negative scale, so that a group's largest magnitude gets code 0 whatever its sign (an
    eighth of it a step, as llama.cpp's Q4_0 does) instead of a seventh when it is positive.
    ``superblock``: groups per K-quant super-block, whose grids are stored as levels of fp16
    units (see :mod:`.superblock`); a row whose groups do not fill super-blocks is stored as this
    storage without them. ``bits``: the width of the group codes (4, or GGUF's 5 and 6).
    ``codebook``: a non-linear grid's levels (symmetric, ``w = levels[q] * scale``, see
    :mod:`.codebook`), None for the linear grids above.
    """

    scale_dtype: torch.dtype = torch.bfloat16
    zero: str = "float"
    int8_block: int | None = None
    signed_scale: bool = False
    superblock: int | None = None
    bits: int = 4
    codebook: tuple[int, ...] | None = None

    @property
    def exact_dtype(self) -> torch.dtype:
        """The dtype that holds a stored scale and zero exactly (fp64 for super-blocks, whose zero
        is the difference of two products of fp16 and 6-bit values)."""
        if self.superblock:
            return torch.float64
        return self.scale_dtype if self.zero == "float" else torch.float32

    def couples(self, groups: int) -> bool:
        """Whether a row of ``groups`` groups is stored in super-blocks."""
        return bool(self.superblock) and groups % self.superblock == 0

    def for_row(self, groups: int) -> "Storage":
        """The storage each group's own grid is chosen on, for a row of ``groups`` groups: fp32
        (then stored by :func:`superblock_grids`) where super-blocks couple them, else itself
        without super-blocks."""
        if self.couples(groups):
            return dataclasses.replace(self, scale_dtype=torch.float32, zero="float", superblock=None)
        return dataclasses.replace(self, superblock=None) if self.superblock else self


BF16 = Storage()
INTEGER_ZERO = Storage(torch.float16, "integer")


def grid_params(lo: torch.Tensor, hi: torch.Tensor, symmetric: bool,
                storage: Storage = BF16) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group range [lo, hi] (fp32) -> (scale, zero) as ``storage`` holds them, in its
    ``exact_dtype`` (fp32 for an integer or minimum zero, whose products are exact there)."""
    if storage.superblock:
        own = storage.for_row(lo.shape[-1])
        params = grid_params(lo, hi, symmetric, own)
        return superblock_grids(*params, storage, symmetric) if storage.couples(lo.shape[-1]) else params
    mid, qmax = code_range(storage.bits)
    if symmetric:
        if storage.signed_scale:
            return stored_symmetric(torch.where(hi > -lo, -hi / mid, -lo / mid), storage)
        return stored_symmetric(torch.maximum(-lo / mid, hi / (qmax - mid)).clamp(min=0.0), storage)
    scale = (hi - lo) / qmax
    if storage.zero == "float":
        return scale.to(storage.scale_dtype), (lo + mid * scale).to(storage.scale_dtype)
    scale = scale.to(storage.scale_dtype).to(torch.float32)
    if storage.zero == "min":
        return scale, lo.to(storage.scale_dtype).to(torch.float32) + mid * scale
    z = torch.round(-lo / torch.where(scale == 0, 1.0, scale)).clamp(1, qmax)
    return scale, (mid - z) * scale


def stored_symmetric(scale: torch.Tensor, storage: Storage) -> tuple[torch.Tensor, torch.Tensor]:
    """A symmetric grid's (scale, zero 0) as ``storage`` holds them."""
    stored = scale.to(storage.scale_dtype).to(storage.exact_dtype)
    return stored, torch.zeros_like(stored)
