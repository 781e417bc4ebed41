"""GPTQ (Frantar et al., 2022) for one linear, in the paper's terms. Pure tensor functions.

Given W [N, K] and the Hessian H = 2/n sum x x^T of the layer's inputs x [K], columns are
quantized one at a time and each column's rounding error is spread over the columns not yet
quantized, weighted by the inverse Hessian (its upper Cholesky factor, "Hinv"), in lazy
blocks of ``block_size`` columns.

Groups use the format's grid (see grid.py). With ``act_order`` columns are visited in order of
decreasing diag(H), and the groups stay *static*: each contiguous group's scale and zero are
fixed up front from the original weights, so the result needs no g_idx. Groups stored in
K-quant super-blocks are static too, their grids fixed before the first column.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
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
from .recovery import with_recovered

log = logging.getLogger(__name__)

DAMP_RETRIES = 4  # each retry multiplies the damping by 10


class NotPositiveDefinite(ValueError):
    """The damped Hessian stayed indefinite through every retry; ``damp`` is the last one tried."""

    def __init__(self, damp: float):
        super().__init__(f"Hessian is not positive definite even at damp {damp:.3g}")
        self.damp = damp


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


@dataclass(frozen=True)
class GptqInfo:
    """What the solve did: the damping that worked, the retries it needed, the dead columns (zero
    Hessian diagonal: never seen by the calibration inputs) and, for a solved weight, the
    calibration objective it reached."""

    damp: float
    retries: int
    dead_columns: int
    objective: float | None = None  # tr((W - Q) H (W - Q)^T) of a solved weight; None in a factor's info


@dataclass(frozen=True)
class HessianFactor:
    """What every linear on one input shares: the visiting order ``perm`` of the columns, the
    upper Cholesky factor ``U`` of the damped inverse Hessian in that order, the ``dead`` columns
    (bool [K], original order), the ``ridge`` added to every diagonal entry and what the damping
    took (``info``)."""

    U: torch.Tensor
    perm: torch.Tensor
    dead: torch.Tensor
    ridge: float
    info: GptqInfo


def factorize(H: torch.Tensor, damp: float = 0.01, act_order: bool = True) -> HessianFactor:
    """The factor of Hessian H [K, K] for :func:`gptq_quantize`: dead columns get diagonal 1,
    columns are visited by decreasing diag(H) with ``act_order``, and ``damp`` * mean(diag H) is
    added to the diagonal (ten times more per retry where H is not positive definite)."""
    k = H.shape[0]
    diag = torch.diag(H).to(torch.float32)
    dead = diag == 0
    diag = diag.masked_fill(dead, 1.0)
    perm = torch.argsort(diag, descending=True) if act_order else torch.arange(k, device=H.device)
    U, used_damp, retries, ridge = _inverse_cholesky(H, perm, dead, damp)
    return HessianFactor(U, perm, dead, ridge, GptqInfo(used_damp, retries, int(dead.sum())))


def _reversed(H: torch.Tensor, perm: torch.Tensor, dead: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """P H P in fp32 for visiting order ``perm`` (P the reversal of that order), dead columns'
    diagonal 1: a new matrix, gathered ``rows`` rows at a time (no K x K index tensor)."""
    backwards = perm.flip(0)
    source = H.to(torch.float32)
    reversed_h = torch.empty_like(source)
    for i in range(0, H.shape[0], rows):
        torch.index_select(source.index_select(0, backwards[i:i + rows]), 1, backwards, out=reversed_h[i:i + rows])
    reversed_h.diagonal()[dead[backwards]] = 1.0
    return reversed_h


def _inverse_cholesky(H: torch.Tensor, perm: torch.Tensor, dead: torch.Tensor,
                      damp: float) -> tuple[torch.Tensor, float, int, float]:
    """Upper Cholesky factor U of H^-1 (H^-1 = U^T U) for H [K, K] visited in order ``perm`` (dead
    columns' diagonal taken as 1), after adding the ridge damp * mean(diag H) to the diagonal;
    retries with 10x the damping when H is not positive definite. Returns (U, the damping used,
    the retries, the ridge added).

    With L the lower Cholesky factor of P H P, U = P L^-1 P: one factorisation and one
    triangular inverse (K^3 / 3 multiply-adds each). Besides H, one K x K matrix is held: P H P
    is factorised, inverted and flipped in its own storage, as every fresh K x K buffer is
    faulted in page by page."""
    mean_diag = None
    for retry in range(DAMP_RETRIES + 1):
        d = damp * 10**retry
        damped = _reversed(H, perm, dead)  # made anew for each try
        if mean_diag is None:
            mean_diag = torch.mean(torch.diag(damped).flip(0)).item() or 1.0
        damped.diagonal().add_(d * mean_diag)
        L = damped.mT  # the same symmetric matrix, column-major: LAPACK factorises it in place
        info = torch.empty((), dtype=torch.int32, device=L.device)
        torch.linalg.cholesky_ex(L, out=(L, info))
        if info.item() == 0:
            if retry:
                log.warning("Hessian not positive definite at damp %.3g; used damp %.3g "
                            "(more calibration samples, or a larger --damp, avoid this)", damp, d)
            invert_lower(L)
            flip_in_place(damped)  # L.flip(0, 1) is damped.flip(0, 1).mT
            return L, d, retry, d * mean_diag
    raise NotPositiveDefinite(damp * 10**DAMP_RETRIES)


def invert_lower(L: torch.Tensor, leaf: int = 512) -> None:
    """Lower-triangular L [K, K] with a positive diagonal becomes L^-1, in place, by halves: the
    inverse of [[A, 0], [C, D]] is [[A^-1, 0], [-D^-1 C A^-1, D^-1]], its corner from two
    triangular solves made before A and D are inverted."""
    k = L.shape[0]
    if k <= leaf:
        L.copy_(torch.linalg.solve_triangular(L, torch.eye(k, dtype=L.dtype, device=L.device), upper=False))
        return
    h = k // 2
    corner = torch.linalg.solve_triangular(L[:h, :h], L[h:, :h], upper=False, left=False)
    L[h:, :h] = torch.linalg.solve_triangular(L[h:, h:], corner, upper=False, out=corner).neg_()
    del corner
    invert_lower(L[:h, :h], leaf)
    invert_lower(L[h:, h:], leaf)


def flip_in_place(M: torch.Tensor, block: int = 256) -> torch.Tensor:
    """M [K, K] becomes M.flip(0, 1) in its own storage, ``block`` rows from each end at a time;
    returns M."""
    k = M.shape[0]
    half = k // 2
    for i in range(0, half, block):
        j = min(i + block, half)
        top = M[i:j].flip(0, 1)
        M[i:j] = M[k - j:k - i].flip(0, 1)
        M[k - j:k - i] = top
    if k % 2:
        M[half] = M[half].flip(0)
    return M


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
    (each column's rounding error over U's diagonal). Inside a block the columns are worked on
    as contiguous rows of its transpose, with each column's grid looked up, not recomputed."""
    W = W.to(torch.float32).clone()
    W[:, factor.dead] = 0.0
    n, k = W.shape
    groups = k // group_size

    def params_of(cols: torch.Tensor, first: int):
        """(scale, zero) of groups cols [n, G, group] whose first original column is ``first``."""
        if weights is None and not storage.codebook:
            return with_recovered(cols, *grid_params(cols.amin(-1), cols.amax(-1), symmetric, storage), storage,
                                  symmetric)
        shape = (cols.shape[1], group_size)
        w = torch.ones(shape, device=W.device) if weights is None else \
            weights[first:first + cols.shape[1] * group_size].reshape(shape)
        return weighted_grid_search(cols, w, symmetric, storage)[:2]

    stored = storage.exact_dtype
    scale = torch.empty(n, groups, dtype=stored, device=W.device)
    zero = torch.empty(n, groups, dtype=stored, device=W.device)
    static = act_order or storage.couples(groups)  # a super-block's groups share their grids' units
    if static:
        scale[:], zero[:] = params_of(W.reshape(n, groups, group_size), 0)  # from the original weights
    perm, U = factor.perm, factor.U
    if act_order:
        W = W[:, perm]
    grid = ColumnGrids(n, perm // group_size)  # the group of each (permuted) column
    group_of = grid.group_of.tolist()
    if static:
        grid.set(range(groups), scale.t(), zero.t())
    codes = torch.empty(k, n, dtype=torch.float32, device=W.device)
    scaled_errors = torch.zeros((), dtype=torch.float64, device=W.device)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, i1:i2].t().contiguous()
        Err1 = torch.empty_like(W1)
        U1 = U[i1:i2, i1:i2].contiguous()
        starts = [i1] if static else sorted({i1, *range(-(-i1 // group_size) * group_size, i2, group_size)})
        for a, b in zip(starts, [*starts[1:], i2]):
            if not static and a % group_size == 0:
                # lazy groups start at a: params from the weights as updated so far (this block's in W1)
                cols = torch.cat([W1[a - i1:a - i1 + group_size].t(), W[:, i2:a + group_size]], dim=1)
                s, z = params_of(cols.unsqueeze(1), a)
                scale[:, group_of[a]], zero[:, group_of[a]] = s[:, 0], z[:, 0]
                grid.set(range(group_of[a], group_of[a] + 1), s[:, 0], z[:, 0])
            solve_columns(W1, U1, grid.block(i1, i2), codes[i1:i2], Err1, a - i1, b - i1, storage.bits,
                          storage.codebook)
        W[:, i2:].addmm_(Err1.t().contiguous(), U[i1:i2, i2:], alpha=-1)  # in place: no [n, K] temporary
        scaled_errors += Err1.square().sum(dtype=torch.float64)
    codes = codes.t().to(torch.uint8)
    if act_order:
        codes = codes[:, torch.argsort(perm)]
    return GroupQuantized(codes, scale, zero, storage.bits, storage.codebook), scaled_errors.item()


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
