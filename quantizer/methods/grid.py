"""The grids every method quantizes onto, and round-to-nearest. Pure tensor functions.

A weight [N, K] is cut into groups of ``group_size`` consecutive input columns. Each group has a
bf16 ``scale`` and ``zero`` and codes ``q`` in [0, 15], dequantized as ``(q - 8) * scale + zero``.

* asymmetric (min/max): ``scale = (max - min) / 15``, ``zero = min + 8 * scale``, so code 0 is
  the group minimum and code 15 its maximum.
* symmetric: ``zero = 0`` and ``scale = max(-min / 8, max / 7)``, the smallest step whose grid
  [-8, 7] * scale still covers the group.

Codes are always chosen against the scale and zero *as stored* (:class:`Storage`: bf16 for
cpu_int4, fp16 and an integer or fp16 zero for the GPTQ and GGUF layouts).

8-bit modules use symmetric grids, ``w = q * scale`` with q in [-127, 127]: one per output
channel, or (``Storage.int8_block``) one per block of consecutive input columns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

QMAX = 15
MID = 8  # the code that dequantizes to ``zero``
ROW_CHUNK = 4096  # rows are independent: methods work in row chunks to bound their fp32 copies
CLIP_SHRINKS = torch.linspace(1.0, 0.80, 21).tolist()
WEIGHTED_SHRINKS = torch.linspace(1.0, 0.80, 9).tolist()


@dataclass(frozen=True)
class Storage:
    """How a format stores a group's scale and zero, which fixes the values codes are rounded against.

    ``zero``: "float" (stored in ``scale_dtype``), "integer" (``zero = (8 - z) * scale`` for an
    integer zero point z in [1, 15], as GPTQ v1 and GGUF's Q4_0 hold it) or "min" (an fp16 minimum
    m beside the scale, ``zero = m + 8 * scale``, as GGUF's Q4_1 holds it). ``int8_block``: input
    columns per 8-bit scale (None: one per output channel). ``signed_scale``: a symmetric grid may
    take a negative scale, so that a group's largest magnitude gets code 0 whatever its sign (an
    eighth of it a step, as llama.cpp's Q4_0 does) instead of a seventh when it is positive.
    """

    scale_dtype: torch.dtype = torch.bfloat16
    zero: str = "float"
    int8_block: int | None = None
    signed_scale: bool = False

    @property
    def exact_dtype(self) -> torch.dtype:
        """The dtype that holds a stored scale and zero exactly."""
        return self.scale_dtype if self.zero == "float" else torch.float32


BF16 = Storage()
INTEGER_ZERO = Storage(torch.float16, "integer")


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
                storage: Storage = BF16) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group range [lo, hi] (fp32) -> (scale, zero) as ``storage`` holds them, in its
    ``exact_dtype`` (fp32 for an integer or minimum zero, whose products are exact there)."""
    if symmetric:
        if storage.signed_scale:
            return stored_symmetric(torch.where(hi > -lo, -hi / MID, -lo / MID), storage)
        return stored_symmetric(torch.maximum(-lo / MID, hi / (QMAX - MID)).clamp(min=0.0), storage)
    scale = (hi - lo) / QMAX
    if storage.zero == "float":
        return scale.to(storage.scale_dtype), (lo + MID * scale).to(storage.scale_dtype)
    scale = scale.to(storage.scale_dtype).to(torch.float32)
    if storage.zero == "min":
        return scale, lo.to(storage.scale_dtype).to(torch.float32) + MID * scale
    z = torch.round(-lo / torch.where(scale == 0, 1.0, scale)).clamp(1, QMAX)
    return scale, (MID - z) * scale


def stored_symmetric(scale: torch.Tensor, storage: Storage) -> tuple[torch.Tensor, torch.Tensor]:
    """A symmetric grid's (scale, zero 0) as ``storage`` holds them."""
    stored = scale.to(storage.scale_dtype).to(storage.exact_dtype)
    return stored, torch.zeros_like(stored)


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
                       storage: Storage = BF16, column_weights: torch.Tensor | None = None) -> GroupQuantized:
    """Round-to-nearest quantization of w [N, K] (any float dtype); ``storage`` as in :func:`grid_params`.

    With ``clip_search`` each group's range is shrunk towards its centre (symmetric: towards 0)
    by the factor in ``CLIP_SHRINKS`` that minimises that group's squared error. With
    ``column_weights`` [K] (each input column's mean squared activation) each group's grid is
    the one of :func:`weighted_grid_search`.
    """
    g = _grouped(w, group_size)
    if column_weights is not None:
        scale, zero, codes = weighted_grid_search(g, column_weights.reshape(g.shape[1:]), symmetric, storage)
        return GroupQuantized(codes.reshape(w.shape), scale, zero)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale, zero = grid_params(lo, hi, symmetric, storage)
    codes = round_to_grid(g, scale, zero)
    if clip_search:
        best_err = _group_sq_error(g, codes, scale, zero)
        for shrink in CLIP_SHRINKS[1:]:
            if symmetric:
                s_lo, s_hi = lo * shrink, hi * shrink
            else:
                mid = (lo + hi) / 2
                s_lo, s_hi = mid + (lo - mid) * shrink, mid + (hi - mid) * shrink
            s2, z2 = grid_params(s_lo, s_hi, symmetric, storage)
            c2 = round_to_grid(g, s2, z2)
            err = _group_sq_error(g, c2, s2, z2)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            scale = torch.where(better, s2, scale)
            zero = torch.where(better, z2, zero)
            codes = torch.where(better.unsqueeze(-1), c2, codes)
    n, k = w.shape
    return GroupQuantized(codes.reshape(n, k), scale, zero)


def _group_sq_error(g, codes, scale, zero, weights=None) -> torch.Tensor:
    err = (grid_values(codes, scale, zero) - g).pow(2)
    return (err if weights is None else err * weights).sum(dim=-1)


def weighted_grid_search(g: torch.Tensor, weights: torch.Tensor, symmetric: bool,
                         storage: Storage = BF16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group of g [N, G, group] (fp32), the stored (scale, zero) and codes minimising the
    weighted squared error sum(weights * (w - deq)^2), weights [G, group] >= 0.

    Candidates: the min/max grid, each range shrunk by the factors of ``WEIGHTED_SHRINKS``, and for
    each of those the weighted least-squares (scale, zero) for its codes. The min/max grid is a
    candidate, so the result is never worse than it on this objective.
    """
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale, zero = grid_params(lo, hi, symmetric, storage)
    best = _group_sq_error(g, round_to_grid(g, scale, zero), scale, zero, weights)
    mid = torch.zeros_like(lo) if symmetric else (lo + hi) / 2
    for shrink in WEIGHTED_SHRINKS:
        c_scale, c_zero = grid_params(mid + (lo - mid) * shrink, mid + (hi - mid) * shrink, symmetric, storage)
        c_codes = round_to_grid(g, c_scale, c_zero)
        refit = _least_squares_grid(g, c_codes, weights, symmetric, storage)
        for c_scale, c_zero, c_codes in ((c_scale, c_zero, c_codes), (*refit, round_to_grid(g, *refit))):
            err = _group_sq_error(g, c_codes, c_scale, c_zero, weights)
            better = err < best
            best = torch.where(better, err, best)
            scale, zero = torch.where(better, c_scale, scale), torch.where(better, c_zero, zero)
    return scale, zero, round_to_grid(g, scale, zero)


def _least_squares_grid(g, codes, weights, symmetric: bool, storage: Storage):
    """The stored (scale, zero) of the weighted least-squares fit w ~ (q - 8) * scale + zero."""
    u = codes.to(torch.float32) - MID
    sw, su, suu = weights.sum(-1), (weights * u).sum(-1), (weights * u * u).sum(-1)
    sw_w, su_w = (weights * g).sum(-1), (weights * u * g).sum(-1)
    if symmetric:
        scale = su_w / suu.clamp(min=1e-30)
        return stored_symmetric(scale if storage.signed_scale else scale.clamp(min=0.0), storage)
    det = (suu * sw - su * su).clamp(min=1e-30)
    scale, zero = (su_w * sw - su * sw_w) / det, (suu * sw_w - su * su_w) / det
    scale = scale.clamp(min=0.0)
    lo, hi = zero - MID * scale, zero + (QMAX - MID) * scale
    return grid_params(lo, hi, symmetric, storage)


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
