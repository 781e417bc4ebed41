"""GPTQ (Frantar et al., 2022) for one linear, in the paper's terms. Pure tensor functions.

Given W [N, K] and the Hessian H = 2/n sum x x^T of the layer's inputs x [K], columns are
quantized one at a time and each column's rounding error is spread over the columns not yet
quantized, weighted by the inverse Hessian (its upper Cholesky factor, "Hinv"), in lazy
blocks of ``block_size`` columns.

Groups use the cpu_int4 grid (see grid.py). With ``act_order`` columns are visited in order
of decreasing diag(H), and the groups stay *static*: each contiguous group's scale and zero
are fixed up front from the original weights, so the result needs no g_idx. Groups stored in
K-quant super-blocks are static too, their grids fixed before the first column.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from .grid import (
    BF16,
    ROW_CHUNK,
    GroupQuantized,
    Storage,
    grid_params,
    grid_values,
    round_to_grid,
    weighted_grid_search,
)

log = logging.getLogger(__name__)

DAMP_RETRIES = 4  # each retry multiplies the damping by 10


class NotPositiveDefinite(ValueError):
    """The damped Hessian stayed indefinite through every retry; ``damp`` is the last one tried."""

    def __init__(self, damp: float):
        super().__init__(f"Hessian is not positive definite even at damp {damp:.3g}")
        self.damp = damp


class HessianAccumulator:
    """Running H = 2/n sum x x^T in fp32 over input rows x [..., K]."""

    def __init__(self, k: int, device: str | torch.device = "cpu"):
        self.H = torch.zeros(k, k, dtype=torch.float32, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float32)
        m = x.shape[0]
        if m == 0:
            return
        self.H *= self.n / (self.n + m)
        self.n += m
        x = x * (2.0 / self.n) ** 0.5
        self.H.addmm_(x.t(), x)

    def merge(self, sum_across: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Become the Hessian of every process's rows: ``sum_across`` sums a tensor in place over
        the processes. Each H is weighted by its row count, so the result is the one a single
        process would have accumulated, up to fp32 summation order."""
        total = int(sum_across(torch.tensor([self.n], dtype=torch.float64)).item())
        self.H *= self.n
        sum_across(self.H)
        self.H /= max(total, 1)
        self.n = total


@dataclass(frozen=True)
class GptqInfo:
    """What the solve did: the damping that worked, the retries it needed, and the dead columns
    (zero Hessian diagonal: never seen by the calibration inputs)."""

    damp: float
    retries: int
    dead_columns: int


def _inverse_cholesky(H: torch.Tensor, damp: float) -> tuple[torch.Tensor, float, int]:
    """Upper Cholesky factor of H^-1 after adding damp * mean(diag H) to the diagonal; retries
    with 10x the damping when H is not positive definite."""
    mean_diag = torch.mean(torch.diag(H)).item() or 1.0
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    for retry in range(DAMP_RETRIES + 1):
        d = damp * 10**retry
        L, info = torch.linalg.cholesky_ex(H + d * mean_diag * eye)
        if info.item() == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if info.item() == 0:
                if retry:
                    log.warning("Hessian not positive definite at damp %.3g; used damp %.3g "
                                "(more calibration samples, or a larger --damp, avoid this)", damp, d)
                return U, d, retry
    raise NotPositiveDefinite(damp * 10**DAMP_RETRIES)




def gptq_quantize(W: torch.Tensor, H: torch.Tensor, group_size: int, symmetric: bool = False,
                  act_order: bool = True, damp: float = 0.01, block_size: int = 128,
                  storage: Storage = BF16, weighted_grids: bool = False) -> tuple[GroupQuantized, GptqInfo]:
    """Quantize W [N, K] (any float dtype) against Hessian H [K, K] fp32. Returns the quantized
    weight (codes in the original column order; scale/zero as stored, see ``grid_params`` for
    ``storage``) and what the solve did. With ``weighted_grids`` each group's grid is chosen
    by the search weighted by diag(H) (grid.weighted_grid_search) instead of its min/max."""
    k = W.shape[1]
    if k % group_size:
        raise ValueError(f"input dim {k} is not a multiple of group size {group_size}")
    H = H.to(torch.float32).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(k, device=H.device)
    U, used_damp, retries = _inverse_cholesky(H[perm][:, perm], damp)
    weights = torch.diag(H).masked_fill(dead, 0.0) if weighted_grids else None
    parts = [_solve_rows(rows, U, perm, dead, group_size, symmetric, act_order, block_size, storage, weights)
             for rows in W.split(ROW_CHUNK)]
    gq = GroupQuantized(*(torch.cat(t) for t in zip(*((p.codes, p.scale, p.zero) for p in parts))))
    return gq, GptqInfo(used_damp, retries, int(dead.sum()))


def _solve_rows(W, U, perm, dead, group_size, symmetric, act_order, block_size, storage,
                weights=None) -> GroupQuantized:
    """The GPTQ column loop for rows W [n, K], given the upper Cholesky factor U of the
    (permuted, damped) inverse Hessian; ``weights`` [K] (original order) for weighted grids."""
    W = W.to(torch.float32).clone()
    W[:, dead] = 0.0
    n, k = W.shape
    groups = k // group_size

    def params_of(cols: torch.Tensor, first: int):
        """(scale, zero) of groups cols [n, G, group] whose first original column is ``first``."""
        if weights is None:
            return grid_params(cols.amin(-1), cols.amax(-1), symmetric, storage)
        w = weights[first:first + cols.shape[1] * group_size].reshape(cols.shape[1], group_size)
        return weighted_grid_search(cols, w, symmetric, storage)[:2]

    stored = storage.exact_dtype
    scale = torch.empty(n, groups, dtype=stored, device=W.device)
    zero = torch.empty(n, groups, dtype=stored, device=W.device)
    static = act_order or storage.couples(groups)  # a super-block's groups share their grids' units
    if static:
        s, z = params_of(W.reshape(n, groups, group_size), 0)  # static groups, from the original weights
        scale[:], zero[:] = s, z
    if act_order:
        W = W[:, perm]
    group_of = perm // group_size  # group of each (permuted) column
    codes = torch.empty(n, k, dtype=torch.uint8, device=W.device)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = group_of[col].item()
            if not static and col % group_size == 0:
                # lazy groups: params from the weights as updated so far (this block's in W1)
                cols = torch.cat([W1[:, i:i + group_size], W[:, i2:col + group_size]], dim=1)
                s, z = params_of(cols.unsqueeze(1), col)
                scale[:, g], zero[:, g] = s[:, 0], z[:, 0]
            w = W1[:, i]
            q = round_to_grid(w.unsqueeze(-1), scale[:, g], zero[:, g]).squeeze(-1)
            deq = grid_values(q.unsqueeze(-1), scale[:, g], zero[:, g]).squeeze(-1)
            codes[:, col] = q
            err = (w - deq) / U1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * U1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]
    if act_order:
        codes = codes[:, torch.argsort(perm)]
    return GroupQuantized(codes, scale, zero)


def proxy_loss(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor) -> float:
    """The GPTQ objective tr((W - Q) H (W - Q)^T): the expected squared output error on the
    calibration inputs (up to the 2/n factor folded into H)."""
    D = (W.to(torch.float32) - Q.to(torch.float32))
    return torch.einsum("nk,kl,nl->", D, H, D).item()
