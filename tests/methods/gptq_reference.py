"""The GPTQ column loop and factorisation as first written, column by column in the paper's
order: the reference the package's faster loop and factorisation must reproduce."""

import torch

from quantizer.methods.grid import (
    grid_params,
    grid_values,
    round_to_grid,
    weighted_grid_search,
)


def reference_inverse_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) I)^-1: cholesky, inverse, cholesky."""
    k = H.shape[0]
    L = torch.linalg.cholesky(H + damp * torch.mean(torch.diag(H)) * torch.eye(k, dtype=H.dtype))
    return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)


def papers_factor(factor, block_size: int) -> torch.Tensor:
    """The paper's upper Cholesky factor U of the damped inverse Hessian in the visiting order
    (H'^-1 = U^T U), from a :class:`HessianFactor`'s R (H' = R^T R): U = R^-T in fp64, with each
    lazy block's diagonal block the one the factor hands the column kernel."""
    R = factor.feedback.t().double() * factor.diagonal.double().unsqueeze(1)
    k = R.shape[0]
    U = torch.linalg.solve_triangular(R, torch.eye(k, dtype=torch.float64), upper=False).t().float()
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        U[i1:i2, i1:i2] = factor.block(i1, i2)[1]
    return U


def reference_gptq(W, U, perm, group_size, symmetric=False, act_order=True, block_size=128, weights=None):
    """Codes, scale, zero of W [n, K] for the factor U of the permuted inverse Hessian."""
    W = W.to(torch.float32).clone()
    n, k = W.shape
    groups = k // group_size

    def params_of(cols, first):
        if weights is None:
            return grid_params(cols.amin(-1), cols.amax(-1), symmetric)
        w = weights[first:first + cols.shape[1] * group_size].reshape(cols.shape[1], group_size)
        return weighted_grid_search(cols, w, symmetric)[:2]

    scale = torch.empty(n, groups, dtype=torch.bfloat16)
    zero = torch.empty(n, groups, dtype=torch.bfloat16)
    if act_order:
        scale[:], zero[:] = params_of(W.reshape(n, groups, group_size), 0)
        W = W[:, perm]
    group_of = perm // group_size
    codes = torch.empty(n, k, dtype=torch.uint8)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = group_of[col].item()
            if not act_order and col % group_size == 0:
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
        W[:, i2:].addmm_(Err1, U[i1:i2, i2:], alpha=-1)
    if act_order:
        codes = codes[:, torch.argsort(perm)]
    return codes, scale, zero
