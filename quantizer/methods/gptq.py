"""GPTQ (Frantar et al., 2022) for one linear, in the paper's terms. Pure tensor functions.

Given W [N, K] and the Hessian H = 2/n sum x x^T of the layer's inputs x [K], columns are
quantized one at a time and each column's rounding error is spread over the columns not yet
quantized, in lazy blocks of ``block_size`` columns: inside a block through the paper's factor
of the inverse Hessian, between blocks through the Cholesky factor of H itself
(:mod:`.hessian_factor`), which needs no inverse.

Groups use the format's grid (see grid.py). With ``act_order`` columns are visited in order of
decreasing diag(H), and the groups stay *static*: each contiguous group's scale and zero are
fixed up front from the original weights, so the result needs no g_idx. Groups stored in
K-quant super-blocks are static too, their grids fixed before the first column.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .gptq_columns import ColumnGrids, solve_columns
from .gram import add_gram, mirror_upper
from .grid import (
    BF16,
    ROW_CHUNK,
    GroupQuantized,
    Storage,
    grid_params,
    row_chunks,
    weighted_grid_search,
)
from .hessian_factor import GptqInfo, HessianFactor, factorize
from .recovery import with_recovered


class HessianAccumulator:
    """Running H = 2/n sum x x^T in fp32 over input rows x [..., K]; its factor for GPTQ is
    computed once however many linears share the input (:meth:`factor`)."""

    def __init__(self, k: int, device: str | torch.device = "cpu"):
        self._H = torch.zeros(k, k, dtype=torch.float32, device=device)
        self._upper_only = False  # the lower triangle is stale: mirrored when H is read
        self.n = 0
        self._factor: tuple[tuple, HessianFactor] | None = None

    @property
    def H(self) -> torch.Tensor:
        """The Hessian [K, K] fp32."""
        if self._upper_only:
            mirror_upper(self._H)
            self._upper_only = False
        return self._H

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        m = x.shape[0]
        if m == 0:
            return
        self._factor = None
        add_gram(self._H, x, alpha=2.0 / (self.n + m), beta=self.n / (self.n + m))
        self._upper_only = True
        self.n += m

    def merge(self, sum_across: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Become the Hessian of every process's rows: ``sum_across`` sums a tensor in place over
        the processes. Each H is weighted by its row count, so the result is the one a single
        process would have accumulated, up to fp32 summation order."""
        self._factor = None
        total = int(sum_across(torch.tensor([self.n], dtype=torch.float64)).item())
        H = self.H
        H *= self.n
        sum_across(H)
        H /= max(total, 1)
        self.n = total

    def column_mean_square(self) -> tuple[torch.Tensor, int]:
        """(each input column's mean x² [K] fp32 on the CPU, the rows it is over): half H's diagonal."""
        return (self.H.diagonal() / 2).cpu(), self.n

    def factor(self, damp: float, act_order: bool) -> "HessianFactor":
        """:func:`factorize` of this H, kept until H changes."""
        key = (damp, act_order)
        if self._factor is None or self._factor[0] != key:
            self._factor = (key, factorize(self.H, damp, act_order))
        return self._factor[1]


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, group_size: int, symmetric: bool = False,
                  act_order: bool = True, damp: float = 0.01, block_size: int = 128,
                  storage: Storage = BF16, weighted_grids: bool = False,
                  factor: HessianFactor | None = None) -> tuple[GroupQuantized, GptqInfo]:
    """Quantize W [N, K] (any float dtype) against Hessian H [K, K] fp32. Returns the quantized
    weight (codes in the original column order; scale/zero as stored, see ``grid_params`` for
    ``storage``) and what the solve did. With ``weighted_grids`` each group's grid is chosen
    by the search weighted by diag(H) (grid.weighted_grid_search) instead of its min/max.
    ``factor``: H's :func:`factorize` with this ``damp`` and ``act_order``, where already made.
    The info's ``objective`` is tr((W - Q) H (W - Q)^T), from the solve's own errors."""
    k = W.shape[1]
    if k % group_size:
        raise ValueError(f"input dim {k} is not a multiple of group size {group_size}")
    factor = factor or factorize(H, damp, act_order)
    weights = torch.diag(H).to(torch.float32).masked_fill(factor.dead, 0.0) if weighted_grids else None
    parts, objective = [], 0.0
    for rows in W.split(ROW_CHUNK):
        q, scaled_errors = _solve_rows(rows, factor, group_size, symmetric, act_order, block_size, storage, weights)
        parts.append(q)
        objective += solved_objective(scaled_errors, rows, q, factor)
    return GroupQuantized.cat(parts), dataclasses.replace(factor.info, objective=objective)


def _solve_rows(W, factor: HessianFactor, group_size, symmetric, act_order, block_size, storage,
                weights=None) -> tuple[GroupQuantized, float]:
    """The GPTQ column loop for rows W [n, K] given the factor; ``weights`` [K] (original order)
    for weighted grids. Returns the quantized rows and the sum of their squared scaled errors
    (each column's rounding error times R's diagonal).

    Each column is rounded at its weight plus the feedback of the errors of the columns rounded
    before it (:mod:`.hessian_factor`). ``targets`` [n, K] holds the weights plus the finished
    blocks' feedback; a block's own runs through the paper's column kernel on the block's U1,
    which is handed the weights whose updates there add up to the same targets. Inside a block
    the columns are worked on as contiguous rows of its transpose, with each column's grid looked
    up, not recomputed."""
    source = W
    n, k = W.shape
    groups = k // group_size
    stored = storage.exact_dtype
    scale = torch.empty(n, groups, dtype=stored, device=W.device)
    zero = torch.empty(n, groups, dtype=stored, device=W.device)
    static = act_order or storage.couples(groups)  # a super-block's groups share their grids' units
    perm = factor.perm
    visit = perm if act_order else None
    if static:  # from the original weights
        original = _columns(source, factor, None).reshape(n, groups, group_size)
        scale[:], zero[:] = _group_params(original, 0, weights, symmetric, storage)
        del original
    targets = _columns(source, factor, visit)
    grid = ColumnGrids(n, perm // group_size)  # the group of each (permuted) column
    group_of = grid.group_of.tolist()
    if static:
        grid.set(range(groups), scale.t(), zero.t())
    codes = torch.empty(k, n, dtype=torch.float32, device=W.device)
    scaled_errors = torch.zeros((), dtype=torch.float64, device=W.device)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        C1, U1 = factor.block(i1, i2)
        W1 = _columns(source, factor, visit, i1, i2).t()
        V1 = torch.linalg.solve_triangular(C1, targets[:, i1:i2].t() - W1, upper=False, unitriangular=True)
        V1 = V1.add_(W1).contiguous()
        Err1 = torch.empty_like(V1)
        starts = [i1] if static else sorted({i1, *range(-(-i1 // group_size) * group_size, i2, group_size)})
        for a, b in zip(starts, [*starts[1:], i2]):
            if not static and a % group_size == 0:  # a lazy group starts at a: its grid from its weights so far
                cols = _lazy_group(source, targets, V1, factor, i1, i2, a, group_size)
                s, z = _group_params(cols.unsqueeze(1), a, weights, symmetric, storage)
                scale[:, group_of[a]], zero[:, group_of[a]] = s[:, 0], z[:, 0]
                grid.set(range(group_of[a], group_of[a] + 1), s[:, 0], z[:, 0])
            solve_columns(V1, U1, grid.block(i1, i2), codes[i1:i2], Err1, a - i1, b - i1, storage.bits,
                          storage.codebook)
        errors = _block_errors(W1, V1, Err1, U1, i2 - i1)
        targets[:, i2:].addmm_(errors.t(), factor.feedback[i1:i2, i2:])
        scaled_errors += Err1.square().sum(dtype=torch.float64)
    codes = codes.t().to(torch.uint8)
    if act_order:
        codes = codes[:, torch.argsort(perm)]
    return GroupQuantized(codes, scale, zero, storage.bits, storage.codebook), scaled_errors.item()


def _columns(source: torch.Tensor, factor: HessianFactor, visit: torch.Tensor | None, i1: int = 0,
             i2: int | None = None) -> torch.Tensor:
    """Visited columns [i1, i2) of ``source`` [n, K] as fp32, in their visiting order ``visit``
    (None: as they are), dead columns 0: a new tensor."""
    index = slice(i1, i2) if visit is None else visit[i1:i2]
    cols = source[:, index]
    if cols.dtype != torch.float32:
        cols = cols.to(torch.float32)
    elif isinstance(index, slice):
        cols = cols.clone()  # not a view of the source
    return cols.masked_fill_(factor.dead[index], 0.0) if factor.info.dead_columns else cols


def _lazy_group(source, targets, V1, factor: HessianFactor, i1: int, i2: int, a: int, group_size: int) -> torch.Tensor:
    """Columns [a, a + group) [n, group] as the paper's loop holds them when column a is next: in
    the block, the column kernel's rows of V1; past it, the weights with the finished blocks'
    updates, which are their feedback (``targets`` less the weights) through the inverse of the
    unit factor from the block's first column on."""
    end = a + group_size
    cols = V1[a - i1:end - i1].t()
    if end <= i2:
        return cols
    weights = _columns(source, factor, None, i1, end)
    ahead = torch.linalg.solve_triangular(factor.feedback[i1:end, i1:end].t(), (targets[:, i1:end] - weights).t(),
                                          upper=False, unitriangular=True)[i2 - i1:]
    return torch.cat([cols, ahead.t() + weights[:, i2 - i1:]], dim=1)


def _block_errors(W1: torch.Tensor, V1: torch.Tensor, Err1: torch.Tensor, U1: torch.Tensor, count: int) -> torch.Tensor:
    """The errors w - q [count, n] of a block's first ``count`` columns once rounded: the column
    kernel leaves each at its target t in V1 and writes (t - q) / U1_ii into Err1."""
    return (W1[:count] - V1[:count]).addcmul_(Err1[:count], U1.diagonal()[:count].unsqueeze(1))


def _group_params(cols: torch.Tensor, first: int, weights: torch.Tensor | None, symmetric: bool,
                  storage: Storage) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) of groups cols [n, G, group] whose first original column is ``first``: their
    min/max grids, or with ``weights`` [K] (or a codebook) the weighted search's."""
    if weights is None and not storage.codebook:
        return with_recovered(cols, *grid_params(cols.amin(-1), cols.amax(-1), symmetric, storage), storage,
                              symmetric)
    shape = cols.shape[1:]
    w = torch.ones(shape, device=cols.device) if weights is None else \
        weights[first:first + shape[0] * shape[1]].reshape(shape)
    return weighted_grid_search(cols, w, symmetric, storage)[:2]


def solved_objective(scaled_errors: float, W: torch.Tensor, q: GroupQuantized, factor: HessianFactor) -> float:
    """tr(D H D^T) for D = W - Q, W [n, K] solved into ``q`` with ``factor``, from the sum of the
    solve's squared scaled errors E [n, K]: D = E U in the visiting order, so ||E||^2 is
    tr(D' H' D'^T) for the H' the solve factorised (dead columns' diagonal 1, the ridge added to
    every diagonal entry) and D' (W's dead columns taken as 0, as the solve takes them); less the
    ridge's and the dead columns' share, which H, whose dead rows and columns are 0, does not have."""
    all_squares, dead_squares = 0.0, 0.0
    for rows in row_chunks(*W.shape):  # cache-sized pieces
        D = W[rows].to(torch.float32).masked_fill(factor.dead, 0.0).sub_(q.rows(rows).dequantize())
        squares = D.square_()
        all_squares += float(squares.sum(dtype=torch.float64))
        if factor.info.dead_columns:
            dead_squares += float(squares[:, factor.dead].sum(dtype=torch.float64))
    return scaled_errors - factor.ridge * all_squares - dead_squares


def error_objective(D: torch.Tensor, H: torch.Tensor, block: int = 512) -> float:
    """The GPTQ objective tr(D H D^T) of an error D = W - Q [n, K] fp32 for symmetric H [K, K]:
    the expected squared output error on the calibration inputs (up to the 2/n factor folded
    into H), fp32 products summed in fp64. As <H, D^T D> over the blocks of D^T D on and above
    the diagonal, half of D H's work."""
    H = H.to(torch.float32)
    total = 0.0
    for a in range(0, D.shape[1], block):
        rows = D[:, a:a + block].t()
        for b in range(a, D.shape[1], block):
            share = (rows @ D[:, b:b + block]).mul_(H[a:a + block, b:b + block]).sum(dtype=torch.float64)
            total += float(share) * (1 if a == b else 2)
    return total
