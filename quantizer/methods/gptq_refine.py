"""Refinement after GPTQ on a symmetric grid: coordinate descent on the full objective
tr((W - Q) H (W - Q)^T), Q = (codes - mid) * scale per group. In lazy blocks of columns, each code
moves one step up or down where that lowers the objective, and after its group's codes each
group's scale takes its least-squares value given the codes, rounded to the dtype that stores it
(kept only where the rounded value still lowers the objective). Every step lowers the objective,
so no row's objective rises. GPTQ fixes each column once, against the columns after it only; the
descent revisits every column against all the others. Pure tensor functions."""

from __future__ import annotations

import torch

from .codes import code_range, dequantize_codes
from .gptq import error_objective
from .grid import ROW_CHUNK, GroupQuantized, Storage
from .rounding import code_step

SWEEPS = 2  # passes over every column
BLOCK = 128  # columns per lazy block (whole groups)


def refine_symmetric(W: torch.Tensor, H: torch.Tensor, gq: GroupQuantized, storage: Storage,
                     sweeps: int = SWEEPS) -> tuple[GroupQuantized, float]:
    """``gq`` (W [N, K] on symmetric grids: zero 0) refined on Hessian H [K, K], and the objective
    it reaches. The scales stay values of the storage's scale dtype (held in gq.scale's dtype), of
    the same sign unless the storage takes signed scales. Rows are independent: they are refined
    :data:`ROW_CHUNK` at a time, which bounds the fp32 copies of a large head."""
    if bool(gq.zero.ne(0).any()):
        raise ValueError("refine_symmetric needs symmetric grids (every zero 0)")
    H = H.to(torch.float32)
    parts, objective = [], 0.0
    for start in range(0, W.shape[0], ROW_CHUNK):
        rows = slice(start, start + ROW_CHUNK)
        w = W[rows].to(torch.float32)
        part = _refine_rows(w, H, gq.rows(rows), storage, sweeps)
        objective += error_objective(w - part.dequantize(), H)
        parts.append(part)
    return GroupQuantized.cat(parts), objective


def _refine_rows(W: torch.Tensor, H: torch.Tensor, gq: GroupQuantized, storage: Storage, sweeps: int) -> GroupQuantized:
    """The sweeps over rows W [n, K] fp32, in lazy blocks: each block's columns are descended with
    their pulls current, then the blocks after it take the block's change."""
    group = gq.group_size
    codes = gq.codes.to(torch.int32, copy=True)
    scale = gq.scale.to(torch.float32, copy=True)  # refitted in place
    block = group * max(1, BLOCK // group)
    for _ in range(sweeps):
        pull = (W - dequantize_codes(codes, scale, gq.zero, torch.float32, gq.bits)) @ H  # H e, per row
        for i1 in range(0, W.shape[1], block):
            i2 = min(i1 + block, W.shape[1])
            delta = _descend_block(codes, scale, pull[:, i1:i2], H[i1:i2, i1:i2], i1, group, gq.bits, storage)
            pull[:, i2:] -= delta @ H[i1:i2, i2:]
    return GroupQuantized(codes.to(gq.codes.dtype), scale.to(gq.scale.dtype), gq.zero, gq.bits)


def _descend_block(codes, scale, pull, Hb, first: int, group: int, bits: int, storage: Storage) -> torch.Tensor:
    """One block's columns [first, first + b): codes [N, K] int32 and scale [N, G] fp32 updated in
    place, pull [N, b] (H e of the block's columns) kept current. Returns the change of Q [N, b]."""
    mid, qmax = code_range(bits)
    diagonal = Hb.diagonal()
    delta = torch.zeros_like(pull)
    for g0 in range(0, Hb.shape[0], group):
        s = scale[:, (first + g0) // group]
        for j in range(g0, g0 + group):
            c = codes[:, first + j]
            d = code_step(c, s, diagonal[j], pull[:, j], qmax)
            if bool(d.any()):
                c += d
                step = d * s
                pull -= step.unsqueeze(1) * Hb[j]
                delta[:, j] += step
        _refit_scale(codes, scale, pull, Hb, delta, first, g0, group, mid, storage)
    return delta


def _refit_scale(codes, scale, pull, Hb, delta, first: int, g0: int, group: int, mid: int, storage: Storage) -> None:
    """The group at block column g0 takes the scale s + t minimising the objective given its codes
    a: t = a.(H e) / a^T H a, rounded; kept where it lowers -2 t a.(H e) + t^2 a^T H a."""
    cols = slice(g0, g0 + group)
    a = codes[:, first + g0:first + g0 + group].to(torch.float32) - mid
    curvature = torch.einsum("ni,ij,nj->n", a, Hb[cols, cols], a)
    slope = (a * pull[:, cols]).sum(1)
    s = scale[:, (first + g0) // group]
    best = s + slope / torch.where(curvature > 0, curvature, 1.0)
    t = best.to(storage.scale_dtype).to(torch.float32) - s
    gain = 2 * t * slope - t * t * curvature
    same_sign = s * (s + t) > 0
    keep = (curvature > 0) & (gain > 0) & torch.isfinite(t) & (same_sign | (storage.signed_scale & (s + t != 0)))
    t = torch.where(keep, t, 0.0)
    if not bool(keep.any()):
        return
    s += t
    change = t.unsqueeze(1) * a
    pull -= change @ Hb[cols]
    delta[:, cols] += change
