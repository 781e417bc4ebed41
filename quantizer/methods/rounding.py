"""Rounding that sees how a linear's inputs move together: from a grid's nearest codes, each code
moves one step up or down where that lowers the expected squared output error of its block of
input columns, ``e_b^T H_b e_b`` (e the weight's error, H_b a diagonal block of the inputs' second
moment E[x x^T]), by coordinate descent on the grids as they are. Pure tensor functions.

The descent has two kernels with the same arithmetic in the same order: int4q's own
(``int4q_native::refine_codes``, rows split between threads) and torch's, one column of every
block at a time; the native one proves itself on first use (:mod:`.native`)."""

from __future__ import annotations

import torch

from ..native.checked import CheckedKernel
from .codes import code_range
from .grid import ROW_CHUNK, GroupQuantized

SWEEPS = 4  # passes over a block's codes; each pass only lowers the objective


def block_objective(w: torch.Tensor, gq: GroupQuantized, blocks: torch.Tensor) -> torch.Tensor:
    """Per row of w [N, K], the sum over blocks of e_b^T H_b e_b, for blocks [K / b, b, b] fp32."""
    e = _errors(w, gq, blocks.shape[-1])
    return torch.einsum("ngi,gij,ngj->n", e, blocks, e)


def refine_codes(w: torch.Tensor, gq: GroupQuantized, blocks: torch.Tensor, sweeps: int = SWEEPS) -> GroupQuantized:
    """``gq`` (w [N, K] on its grids) with codes moved by coordinate descent on
    :func:`block_objective`: a code takes the neighbour (±1, inside the code range) that lowers its
    block's objective most, in column order, for up to ``sweeps`` passes. Grids are unchanged and
    no row's objective rises."""
    descend = KERNEL() if w.device.type == "cpu" else torch_descend
    blocks = blocks.to(torch.float32).contiguous()
    codes = torch.empty_like(gq.codes)
    for start in range(0, w.shape[0], ROW_CHUNK):
        rows = slice(start, start + ROW_CHUNK)
        part = gq.rows(rows)
        n, k = part.codes.shape
        b = blocks.shape[-1]
        step = part.scale.to(torch.float32).repeat_interleave(part.group_size, 1).reshape(n, k // b, b).contiguous()
        moved = part.codes.to(torch.int16).reshape(n, k // b, b).contiguous()
        pull = torch.einsum("gij,ngj->ngi", blocks, _errors(w[rows], part, b)).contiguous()  # H_b e
        descend(moved, step, pull, blocks, code_range(gq.bits)[1], sweeps)
        codes[rows] = moved.reshape(n, k).to(torch.uint8)
    return GroupQuantized(codes, gq.scale, gq.zero, gq.bits)


def _errors(w: torch.Tensor, gq: GroupQuantized, b: int) -> torch.Tensor:
    n, k = w.shape
    return (w.to(torch.float32) - gq.dequantize()).reshape(n, k // b, b)


def torch_descend(codes: torch.Tensor, step: torch.Tensor, pull: torch.Tensor, blocks: torch.Tensor, qmax: int,
                  sweeps: int) -> None:
    """The descent in torch, in place: codes int16 [n, G, b], each code's grid step [n, G, b],
    pull = H_b e [n, G, b] fp32, blocks [G, b, b]; one column of every block at a time."""
    b = blocks.shape[-1]
    diagonal = torch.diagonal(blocks, dim1=1, dim2=2)  # [G, b]
    for _ in range(sweeps):
        moved = False
        for j in range(b):
            s, c = step[:, :, j], codes[:, :, j]
            d = code_step(c, s, diagonal[:, j], pull[:, :, j], qmax)
            if not bool(d.any()):
                continue
            moved = True
            c += d
            pull -= (d * s).unsqueeze(-1) * blocks[:, :, j]
        if not moved:
            break


def code_step(codes: torch.Tensor, step: torch.Tensor, h_jj: torch.Tensor, pull: torch.Tensor,
              qmax: int) -> torch.Tensor:
    """The move d in {-1, 0, 1} (codes' dtype) of one column's codes that lowers e^T H e most:
    codes, their grid ``step`` and ``pull`` = (H e)_j alike-shaped, ``h_jj`` = H_jj."""
    curvature, slope = step * step * h_jj, 2 * step * pull
    # a code moved by d changes e_j by -d s, the objective by -2 d s (H e)_j + s^2 H_jj
    up = torch.where(codes < qmax, curvature - slope, torch.inf)
    down = torch.where(codes > 0, curvature + slope, torch.inf)
    return torch.where((up < 0) & (up <= down), 1, torch.where(down < 0, -1, 0)).to(codes.dtype)


def _operator(library):
    def native(codes, step, pull, blocks, qmax, sweeps):
        library.refine_codes(codes, step, pull, blocks, qmax, sweeps)
    return native


def _probe(kernel) -> list[torch.Tensor]:
    """A seeded descent over 37 rows of three blocks of 64 correlated columns, 4- and 6-bit codes,
    with codes at both ends of their range: the codes and pulls ``kernel`` leaves."""
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(3, 64, 64, generator=g)
    blocks = (mix @ mix.transpose(1, 2) / 64).contiguous()
    written = []
    for qmax in (15, 63):
        codes = torch.randint(0, qmax + 1, (37, 3, 64), generator=g, dtype=torch.int16)
        codes[:, :, :4] = torch.tensor([0, qmax, 0, qmax], dtype=torch.int16)
        step = torch.rand(37, 3, 64, generator=g) * 0.1
        pull = torch.einsum("gij,ngj->ngi", blocks, torch.randn(37, 3, 64, generator=g) * 0.05).contiguous()
        kernel(codes, step, pull, blocks, qmax, SWEEPS)
        written += [codes, pull]
    return written


KERNEL = CheckedKernel(torch_descend, _operator, _probe, "correlated rounding")
