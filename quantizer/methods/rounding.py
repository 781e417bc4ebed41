"""Rounding that sees how a linear's inputs move together: from a grid's nearest codes, each code
moves one step up or down where that lowers the expected squared output error of its block of
input columns, ``e_b^T H_b e_b`` (e the weight's error, H_b a diagonal block of the inputs' second
moment E[x x^T]), by coordinate descent on the grids as they are. Pure tensor functions.

A step's size is the level change from the code (1 on a linear grid; on a table of levels,
:mod:`.codebook`, levels[q ± 1] - levels[q]) times the group's scale. The descent has two kernels
with the same arithmetic in the same order: int4q's own (``int4q_native::refine_codes``, rows split
between threads) and torch's, one column of every block at a time; the native one proves itself
on first use (:mod:`.native`)."""

from __future__ import annotations

import torch

from ..native.checked import CheckedKernel
from .codebook import IQ4_LEVELS, level_table
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
    rise, fall = step_tables(gq.levels or tuple(range(code_range(gq.bits)[1] + 1)), w.device)
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
        descend(moved, step, pull, blocks, rise, fall, sweeps)
        codes[rows] = moved.reshape(n, k).to(torch.uint8)
    return GroupQuantized(codes, gq.scale, gq.zero, gq.bits, gq.levels)


def _errors(w: torch.Tensor, gq: GroupQuantized, b: int) -> torch.Tensor:
    n, k = w.shape
    return (w.to(torch.float32) - gq.dequantize()).reshape(n, k // b, b)


def step_tables(levels: tuple[int, ...], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rise, fall) fp32 [len(levels)]: levels[q + 1] - levels[q] and levels[q - 1] - levels[q]
    (0 where there is no such level)."""
    table = level_table(levels, device)
    zero = table.new_zeros(1)
    return torch.cat([table[1:] - table[:-1], zero]), torch.cat([zero, table[:-1] - table[1:]])


def torch_descend(codes: torch.Tensor, step: torch.Tensor, pull: torch.Tensor, blocks: torch.Tensor,
                  rise: torch.Tensor, fall: torch.Tensor, sweeps: int) -> None:
    """The descent in torch, in place: codes int16 [n, G, b], each code's group scale [n, G, b],
    pull = H_b e [n, G, b] fp32, blocks [G, b, b], rise and fall [Q] (:func:`step_tables`); one
    column of every block at a time."""
    b, qmax = blocks.shape[-1], rise.numel() - 1
    diagonal = torch.diagonal(blocks, dim1=1, dim2=2)  # [G, b]
    for _ in range(sweeps):
        moved = False
        for j in range(b):
            c, s = codes[:, :, j], step[:, :, j]
            up, down = rise[c.long()] * s, fall[c.long()] * s
            d = best_move(up, down, c < qmax, c > 0, diagonal[:, j], pull[:, :, j]).to(c.dtype)
            if not bool(d.any()):
                continue
            moved = True
            c += d
            pull -= torch.where(d > 0, up, torch.where(d < 0, down, 0)).unsqueeze(-1) * blocks[:, :, j]
        if not moved:
            break


def code_step(codes: torch.Tensor, step: torch.Tensor, h_jj: torch.Tensor, pull: torch.Tensor,
              qmax: int) -> torch.Tensor:
    """The move d in {-1, 0, 1} (codes' dtype) of one column's codes on a linear grid that lowers
    e^T H e most: codes, their grid ``step`` and ``pull`` = (H e)_j alike-shaped, ``h_jj`` = H_jj."""
    return best_move(step, -step, codes < qmax, codes > 0, h_jj, pull).to(codes.dtype)


def best_move(up: torch.Tensor, down: torch.Tensor, can_up: torch.Tensor, can_down: torch.Tensor,
              h_jj: torch.Tensor, pull: torch.Tensor) -> torch.Tensor:
    """The move d in {-1, 0, 1} (int) that lowers e^T H e most, given the value changes ``up`` and
    ``down`` of a code's step each way, where each is allowed, ``pull`` = (H e)_j and ``h_jj``."""
    # a value moved by v changes e_j by -v, the objective by v^2 H_jj - 2 v (H e)_j
    cost_up = torch.where(can_up, up * up * h_jj - 2 * up * pull, torch.inf)
    cost_down = torch.where(can_down, down * down * h_jj - 2 * down * pull, torch.inf)
    return torch.where((cost_up < 0) & (cost_up <= cost_down), 1, torch.where(cost_down < 0, -1, 0))


def _operator(library):
    def native(codes, step, pull, blocks, rise, fall, sweeps):
        library.refine_codes(codes, step, pull, blocks, rise, fall, sweeps)
    return native


def _probe(kernel) -> list[torch.Tensor]:
    """A seeded descent over 37 rows of three blocks of 64 correlated columns, on 4- and 6-bit
    linear grids and IQ4's table (with negative scales), with codes at both ends of their range:
    the codes and pulls ``kernel`` leaves."""
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(3, 64, 64, generator=g)
    blocks = (mix @ mix.transpose(1, 2) / 64).contiguous()
    written = []
    for levels in (tuple(range(16)), tuple(range(64)), IQ4_LEVELS):
        qmax = len(levels) - 1
        codes = torch.randint(0, qmax + 1, (37, 3, 64), generator=g, dtype=torch.int16)
        codes[:, :, :4] = torch.tensor([0, qmax, 0, qmax], dtype=torch.int16)
        step = torch.rand(37, 3, 64, generator=g) * (0.1 if levels[0] == 0 else torch.tensor([-0.01, 0.01])[
            torch.randint(0, 2, (37, 3, 1), generator=g)])
        pull = torch.einsum("gij,ngj->ngi", blocks, torch.randn(37, 3, 64, generator=g) * 0.05).contiguous()
        kernel(codes, step, pull, blocks, *step_tables(levels), SWEEPS)
        written += [codes, pull]
    return written


KERNEL = CheckedKernel(torch_descend, _operator, _probe, "correlated rounding")
