"""The factor of a damped Hessian that GPTQ's column loop feeds errors through. Pure tensor functions.

For columns visited in an order, GPTQ's objective tr(D H D^T) of the error D = W - Q is
sum_i R_ii^2 (e_i + sum_{j<i} c_ij e_j)^2 per row, with e = w - q and H = R^T R for a lower
triangular R in that order, c_ij = R_ij / R_ii. So each column is rounded at its weight plus the
errors of the columns already rounded, through the row-scaled factor c (Babai's nearest plane,
which GPTQ is; Chen et al. 2025). R is one Cholesky factorisation, K^3 / 6 multiply-adds; the
paper's factor of H^-1 costs a triangular inverse more.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

DAMP_RETRIES = 4  # each retry multiplies the damping by 10


class NotPositiveDefinite(ValueError):
    """The damped Hessian stayed indefinite through every retry; ``damp`` is the last one tried."""

    def __init__(self, damp: float):
        super().__init__(f"Hessian is not positive definite even at damp {damp:.3g}")
        self.damp = damp


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
    """What every linear on one input shares: the visiting order ``perm`` of the columns; in that
    order the lower Cholesky factor R of the damped Hessian (H' = R^T R) as its ``diagonal`` [K]
    and ``feedback`` [K, K], unit upper triangular: row j holds the share c_ij = R_ij / R_ii of
    column j's error that each later column i takes (R's rows divided by their diagonal,
    transposed, so a block's feedback to the later columns is a run of contiguous rows); the
    ``dead`` columns (bool [K], original order), the ``ridge`` added to every diagonal entry and
    what the damping took (``info``)."""

    feedback: torch.Tensor
    diagonal: torch.Tensor
    perm: torch.Tensor
    dead: torch.Tensor
    ridge: float
    info: GptqInfo
    _blocks: dict = field(default_factory=dict, repr=False, compare=False)

    def block(self, i1: int, i2: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Columns [i1, i2) of the visiting order: (their feedback among themselves [b, b] as R's
        rows scaled, unit lower, contiguous; U1 [b, b], the upper factor of that block's inverse,
        R_bb^-T, contiguous: the paper's Hinv block, whose diagonal is 1 / R_ii). Made once per
        block: every row chunk and every linear on the input reads them."""
        if (i1, i2) not in self._blocks:
            C = self.feedback[i1:i2, i1:i2].t().contiguous()
            R = C * self.diagonal[i1:i2].unsqueeze(1)
            eye = torch.eye(i2 - i1, dtype=R.dtype, device=R.device)
            self._blocks[i1, i2] = C, torch.linalg.solve_triangular(R, eye, upper=False).t().contiguous()
        return self._blocks[i1, i2]


def factorize(H: torch.Tensor, damp: float = 0.01, act_order: bool = True) -> HessianFactor:
    """The factor of Hessian H [K, K] for GPTQ's column loop: dead columns get diagonal 1,
    columns are visited by decreasing diag(H) with ``act_order``, and ``damp`` * mean(diag H) is
    added to the diagonal (ten times more per retry where H is not positive definite)."""
    k = H.shape[0]
    diag = torch.diag(H).to(torch.float32)
    dead = diag == 0
    diag = diag.masked_fill(dead, 1.0)
    perm = torch.argsort(diag, descending=True) if act_order else torch.arange(k, device=H.device)
    R, used_damp, retries, ridge = _lower_cholesky(H, perm, dead, damp)
    diagonal = R.diagonal().clone()
    feedback = transpose_in_place(R.div_(diagonal.unsqueeze(1)))
    return HessianFactor(feedback, diagonal, perm, dead, ridge, GptqInfo(used_damp, retries, int(dead.sum())))


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


def _lower_cholesky(H: torch.Tensor, perm: torch.Tensor, dead: torch.Tensor,
                    damp: float) -> tuple[torch.Tensor, float, int, float]:
    """Lower triangular R with R^T R = H' for H [K, K] visited in order ``perm`` (dead columns'
    diagonal taken as 1), after adding the ridge damp * mean(diag H) to the diagonal; retries with
    10x the damping when H is not positive definite. Returns (R, the damping used, the retries,
    the ridge added).

    With L the lower Cholesky factor of P H P, R = P L^T P. Besides H, one K x K matrix is held:
    P H P is factorised and flipped in its own storage, as every fresh K x K buffer is faulted in
    page by page."""
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
            return flip_in_place(damped), d, retry, d * mean_diag  # damped holds L^T
    raise NotPositiveDefinite(damp * 10**DAMP_RETRIES)


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


def transpose_in_place(M: torch.Tensor, block: int = 256) -> torch.Tensor:
    """M [K, K] becomes M^T in its own storage, ``block`` x ``block`` tiles at a time; returns M."""
    k = M.shape[0]
    for i in range(0, k, block):
        rows = slice(i, min(i + block, k))
        M[rows, rows] = M[rows, rows].t().clone()
        for j in range(i + block, k, block):
            cols = slice(j, min(j + block, k))
            tile = M[rows, cols].t().clone()
            M[rows, cols] = M[cols, rows].t()
            M[cols, rows] = tile
    return M
