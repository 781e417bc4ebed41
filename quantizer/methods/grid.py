"""The grids every method quantizes onto, and round-to-nearest. Pure tensor functions.

A weight [N, K] is cut into groups of ``group_size`` consecutive input columns. Each group has a
bf16 ``scale`` and ``zero`` and codes ``q`` in [0, 15], dequantized as ``(q - 8) * scale + zero``.

* asymmetric (min/max): ``scale = (max - min) / 15``, ``zero = min + 8 * scale``, so code 0 is
  the group minimum and code 15 its maximum.
* symmetric: ``zero = 0`` and ``scale = max(-min / 8, max / 7)``, the smallest step whose grid
  [-8, 7] * scale still covers the group.

GGUF's 5- and 6-bit types use the same grids with wider codes (``Storage.bits``: 0..31 around 16,
0..63 around 32; see :mod:`.codes`).

Codes are always chosen against the scale and zero *as stored* (:class:`.storage.Storage`: bf16 for
cpu_int4, fp16 and an integer or fp16 zero for the GPTQ and GGUF layouts, or GGUF's K-quant
super-blocks, see :mod:`.superblock`).

8-bit modules use symmetric grids, ``w = q * scale`` with q in [-127, 127]: one per output
channel, or (``Storage.int8_block``) one per block of consecutive input columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .candidates import ERROR, grid_scores
from .codebook import codebook_search, dequantize_levels
from .codes import MID, QMAX, code_range, dequantize_codes, grid_values, round_to_grid  # noqa: F401
from .recovery import with_recovered
from .llama_searches import llama_grids
from .shrink_search import shrunk_grids
from .storage import BF16, INTEGER_ZERO, Storage, grid_params  # noqa: F401
from .superblock import better_superblocks, superblock_grids

ROW_CHUNK = 4096  # rows are independent: methods work in row chunks to bound their fp32 copies
SEARCH_CHUNK = 1 << 19
"""Elements per row chunk of the grid searches, whose many temporaries then stay in the cache
(on a [8960, 1536] weight, ten times faster than one pass over all rows); rows are independent,
so the result is the same."""
CLIP_SHRINKS = torch.linspace(1.0, 0.80, 21).tolist()


@dataclass(frozen=True)
class GroupQuantized:
    """A quantized weight: codes uint8 [N, K] in 0..2^bits - 1 (0..15), scale and zero bf16
    [N, K // group_size] (or as the format stores them); ``levels``: a non-linear grid's table
    (``w = levels[q] * scale``, zero 0), None for a linear one."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int = 4
    levels: tuple[int, ...] | None = None

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        if self.levels:
            return dequantize_levels(self.codes, self.scale, self.levels, dtype)
        return dequantize_codes(self.codes, self.scale, self.zero, dtype, self.bits)

    def rows(self, rows: slice) -> "GroupQuantized":
        return GroupQuantized(self.codes[rows], self.scale[rows], self.zero[rows], self.bits, self.levels)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.codes, self.scale, self.zero

    @classmethod
    def cat(cls, parts: list["GroupQuantized"]) -> "GroupQuantized":
        """Row chunks [n_i, K] of one weight joined into one."""
        return cls(*(torch.cat(t) for t in zip(*(p.tensors for p in parts))), parts[0].bits, parts[0].levels)


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"input dim {k} is not a multiple of group size {group_size}")
    return w.to(torch.float32).reshape(n, k // group_size, group_size)


def row_chunks(rows: int, per_row: int) -> list[slice]:
    """Row slices of about :data:`SEARCH_CHUNK` elements each (one slice for a small weight)."""
    if rows * per_row <= 2 * SEARCH_CHUNK:
        return [slice(None)]
    step = max(1, SEARCH_CHUNK // per_row)
    return [slice(start, start + step) for start in range(0, rows, step)]


def quantize_groupwise(w: torch.Tensor, group_size: int, symmetric: bool = False, clip_search: bool = False,
                       storage: Storage = BF16, column_weights: torch.Tensor | None = None) -> GroupQuantized:
    """Round-to-nearest quantization of w [N, K] (any float dtype); ``storage`` as in :func:`grid_params`.

    With ``clip_search`` each group's range is shrunk towards its centre (symmetric: towards 0)
    by the factor in ``CLIP_SHRINKS`` that minimises that group's squared error. With
    ``column_weights`` [K] (each input column's mean squared activation) each group's grid is
    the one of :func:`weighted_grid_search`, as it always is for a K-quant super-block storage
    (with equal weights where none are given: llama.cpp searches those grids too).
    """
    chunks = row_chunks(w.shape[0], w.shape[1])
    if len(chunks) > 1:
        return GroupQuantized.cat([quantize_groupwise(w[rows], group_size, symmetric, clip_search, storage,
                                                      column_weights) for rows in chunks])
    g = _grouped(w, group_size)
    bits = storage.bits
    if storage.codebook:  # non-linear grids are always searched, as llama.cpp's IQ4 quantizer does
        weights = torch.ones(w.shape[1], device=w.device) if column_weights is None else column_weights
        scale, zero, codes = codebook_search(g, weights.reshape(g.shape[1:]).to(torch.float32), storage)
        return GroupQuantized(codes.reshape(w.shape), scale, zero, bits, storage.codebook)
    if storage.superblock and not storage.couples(g.shape[1]):
        return quantize_groupwise(w, group_size, symmetric, clip_search, storage.for_row(g.shape[1]), column_weights)
    if column_weights is not None or storage.superblock:  # K-quants search their grids, as llama.cpp's do
        weights = None if column_weights is None else column_weights.reshape(g.shape[1:])
        scale, zero, codes = weighted_grid_search(g, weights, symmetric, storage)
        return GroupQuantized(codes.reshape(w.shape), scale, zero, bits)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale, zero = grid_params(lo, hi, symmetric, storage)
    if clip_search:
        best_err = grid_scores(g, scale, zero, bits=bits)[..., ERROR]
        for shrink in CLIP_SHRINKS[1:]:
            if symmetric:
                s_lo, s_hi = lo * shrink, hi * shrink
            else:
                mid = (lo + hi) / 2
                s_lo, s_hi = mid + (lo - mid) * shrink, mid + (hi - mid) * shrink
            s2, z2 = grid_params(s_lo, s_hi, symmetric, storage)
            err = grid_scores(g, s2, z2, bits=bits)[..., ERROR]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            scale = torch.where(better, s2, scale)
            zero = torch.where(better, z2, zero)
    scale, zero = with_recovered(g, scale, zero, storage, symmetric)
    codes = round_to_grid(g, scale, zero, bits)
    return GroupQuantized(codes.reshape(w.shape), scale, zero, bits)


def weighted_grid_search(g: torch.Tensor, weights: torch.Tensor | None, symmetric: bool,
                         storage: Storage = BF16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group of g [N, G, group] (fp32), the stored (scale, zero) and codes minimising the
    weighted squared error sum(weights * (w - deq)^2), weights [G, group] >= 0 (None: all 1, and
    no importance matrix: llama.cpp's candidates are then those of its searches without one).

    Candidates: the min/max grid, each range scaled by the factors of
    :data:`.shrink_search.WEIGHTED_SHRINKS`, and for each of those the weighted least-squares
    (scale, zero) for its codes. The min/max grid is a
    candidate, so the result is never worse than it on this objective (before a super-block
    storage rounds the winner's scale and minimum).
    """
    chunks = row_chunks(g.shape[0], g[0].numel())
    if len(chunks) > 1:
        parts = [weighted_grid_search(g[rows], weights, symmetric, storage) for rows in chunks]
        return tuple(torch.cat(t) for t in zip(*parts))
    importance = weights
    weights = torch.ones(g.shape[1:], device=g.device) if weights is None else weights
    if storage.codebook:
        return codebook_search(g, weights.to(torch.float32), storage)
    scale, zero = _searched_grids(g, weights, importance, symmetric, storage)
    return scale, zero, round_to_grid(g, scale, zero, storage.bits)


def _searched_grids(g: torch.Tensor, weights: torch.Tensor, importance: torch.Tensor | None, symmetric: bool,
                    storage: Storage) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`weighted_grid_search`'s stored (scale, zero) [N, G] on a linear grid, without the
    codes; ``importance`` is ``weights`` as given (None: no importance matrix)."""
    bits = storage.bits
    if storage.superblock:
        scale, zero = _searched_grids(g, weights, importance, symmetric, storage.for_row(g.shape[1]))
        if not storage.couples(g.shape[1]):
            return scale, zero
        scale, zero = superblock_grids(scale, zero, storage, symmetric, g, weights)
        theirs = llama_grids(g, bits, storage.superblock, symmetric, importance)
        if theirs is not None:  # llama.cpp's own grids are candidates too
            scale, zero = better_superblocks(g, weights, bits, storage.superblock, (scale, zero), theirs)
        return with_recovered(g, scale, zero, storage, symmetric, weights)
    scale, zero = shrunk_grids(g, weights, symmetric, storage)
    theirs = llama_grids(g, bits, None, symmetric, importance) if storage.zero == "min" else None
    if theirs is not None:  # llama.cpp's own grids are candidates too
        scale, zero = better_superblocks(g, weights, bits, 1, (scale, zero), theirs)
    return with_recovered(g, scale, zero, storage, symmetric, weights)


QMAX8 = 127


@dataclass(frozen=True)
class ChannelQuantized:
    """An 8-bit weight: symmetric codes int8 [N, K] in -127..127 and scales [N, B], one per
    output channel (B = 1) or per block of K / B input columns, dequantized as ``q * scale``."""

    codes: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        n, k = self.codes.shape
        blocks = self.codes.to(torch.float32).reshape(n, self.scale.shape[1], -1)
        return (blocks * self.scale.to(torch.float32).unsqueeze(-1)).reshape(n, k).to(dtype)

    def rows(self, rows: slice) -> "ChannelQuantized":
        return ChannelQuantized(self.codes[rows], self.scale[rows])


def quantize_per_channel(w: torch.Tensor, storage: Storage = BF16) -> ChannelQuantized:
    """Round-to-nearest on the symmetric 8-bit grid of each output channel of w [N, K] (or of
    each block of ``storage.int8_block`` columns); the codes are chosen against the scale as
    stored (``storage.scale_dtype``), so no code leaves -127..127."""
    n, k = w.shape
    block = storage.int8_block or k
    if k % block:
        raise ValueError(f"input dim {k} is not a multiple of the 8-bit block {block}")
    blocks = w.to(torch.float32).reshape(n, k // block, block)
    scale = (blocks.abs().amax(dim=-1) / QMAX8).to(storage.scale_dtype)
    s = scale.to(torch.float32).unsqueeze(-1)
    codes = torch.round(blocks / torch.where(s == 0, 1.0, s)).clamp_(-QMAX8, QMAX8)
    return ChannelQuantized(codes.to(torch.int8).reshape(n, k), scale)
