"""GPTQ's column loop inside one lazy block: each column rounded to its grid, its error divided by
the factor's diagonal and spread over the block's later columns. Two kernels with the same
arithmetic in the same order, so the same codes and weights to the bit:

- int4q's own (``int4q_native::gptq_columns``), rows split between threads, each kept in L1
  through the block;
- torch, one column at a time (a few small operations per column).

The native kernel proves itself on first use against the torch loop; where it fails, one warning
names the fallback (:mod:`.native`)."""

from __future__ import annotations

import torch

from ..native.checked import CheckedKernel
from .codebook import level_table, round_to_levels
from .codes import code_range


class ColumnGrids:
    """Each group's grid, per row, in the form rounding needs (the arithmetic of
    :func:`grid.round_to_grid` and :func:`grid.grid_values`, so codes and values match them
    exactly): scale, zero, the scale safe to divide by, and whether the scale is 0; all [G, n],
    looked up per column through ``group_of`` [K] (each column's group, long)."""

    def __init__(self, n: int, group_of: torch.Tensor):
        groups = int(group_of.max()) + 1 if group_of.numel() else 0
        device = group_of.device
        self.group_of = group_of
        self.scale = torch.zeros(groups, n, dtype=torch.float32, device=device)
        self.zero = torch.zeros(groups, n, dtype=torch.float32, device=device)
        self.safe = torch.ones(groups, n, dtype=torch.float32, device=device)
        self.flat = torch.zeros(groups, n, dtype=torch.bool, device=device)

    def set(self, groups: range, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """Groups ``groups`` take scale, zero [len(groups), n] (or [n], the same for each)."""
        c = slice(groups.start, groups.stop)
        self.scale[c], self.zero[c] = scale.to(torch.float32), zero.to(torch.float32)
        self.flat[c] = self.scale[c] == 0
        self.safe[c] = torch.where(self.flat[c], 1.0, self.scale[c])

    def block(self, i1: int, i2: int) -> tuple[torch.Tensor, ...]:
        """(scale, zero, safe, flat) of columns [i1, i2), each [i2 - i1, n] and contiguous."""
        columns = self.group_of[i1:i2]
        return tuple(t.index_select(0, columns) for t in (self.scale, self.zero, self.safe, self.flat))


def solve_columns(W1: torch.Tensor, U1: torch.Tensor, grids: tuple[torch.Tensor, ...], codes: torch.Tensor,
                  err: torch.Tensor, first: int, last: int, bits: int = 4,
                  levels: tuple[int, ...] | None = None) -> None:
    """Columns [first, last) of a block: W1 [b, n] fp32 (the block's columns as rows, updated in
    place), U1 [b, b] the factor's block (contiguous), ``grids`` from :meth:`ColumnGrids.block`; writes their
    ``bits``-bit codes (as fp32) into ``codes`` [b, n] and their scaled errors into ``err`` [b, n].
    With ``levels`` the grids are that non-linear table's (zero 0), rounded in torch."""
    if levels:
        return codebook_columns(W1, U1, grids, codes, err, first, last, levels)
    kernel = KERNEL() if W1.device.type == "cpu" else torch_columns
    kernel(W1, U1, grids, codes, err, first, last, bits)


def codebook_columns(W1, U1, grids, codes, err, first: int, last: int, levels: tuple[int, ...]) -> None:
    """:func:`solve_columns` on a non-linear grid, one column at a time."""
    scale = grids[0]
    table = level_table(levels, W1.device)
    for i in range(first, last):
        w = W1[i]
        q = round_to_levels(w.unsqueeze(-1), scale[i], levels).squeeze(-1)
        codes[i] = q
        e = torch.div(w - table[q.long()] * scale[i], U1[i, i], out=err[i])
        W1[i + 1:] -= U1[i, i + 1:].unsqueeze(1) * e


def torch_columns(W1, U1, grids, codes, err, first: int, last: int, bits: int = 4) -> None:
    """:func:`solve_columns` in torch, one column at a time."""
    scale, zero, safe, flat = grids
    mid, qmax = code_range(bits)
    any_flat = bool(flat[first:last].any())
    for i in range(first, last):
        w = W1[i]
        q = torch.round((w - zero[i]) / safe[i] + mid, out=codes[i]).clamp_(0, qmax)
        if any_flat:
            q.masked_fill_(flat[i], float(mid))
        deq = (q - mid) * scale[i] + zero[i]
        e = torch.div(w - deq, U1[i, i], out=err[i])
        W1[i + 1:] -= U1[i, i + 1:].unsqueeze(1) * e


def _operator(library):
    def native(W1, U1, grids, codes, err, first, last, bits=4):
        library.gptq_columns(W1, U1, *grids, codes, err, first, last, code_range(bits)[1])
    return native


def _probe(kernel) -> list[torch.Tensor]:
    """A block with a flat column, rows that fill no whole chunk and a partial range of columns,
    for 4- and 6-bit codes: what ``kernel`` writes."""
    g = torch.Generator().manual_seed(0)
    b, n = 40, 157
    grids = ColumnGrids(n, torch.arange(b))
    grids.set(range(b), torch.rand(b, n, generator=g) * 0.1, torch.randn(b, n, generator=g) * 0.05)
    grids.set(range(5, 6), torch.zeros(n), torch.zeros(n))
    U1 = (torch.randn(b, b, generator=g) * 0.1).triu() + torch.eye(b)
    W = torch.randn(b, n, generator=g)
    written = []
    for bits in (4, 6):
        W1, codes, err = W.clone(), torch.zeros(b, n), torch.zeros(b, n)
        kernel(W1, U1, grids.block(0, b), codes, err, 3, 37, bits)
        written += [W1, codes, err]
    return written


KERNEL = CheckedKernel(torch_columns, _operator, _probe, "GPTQ column loop")
