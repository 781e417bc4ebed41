"""The prefill GEMM of the quantized linears, ``x @ weight.T`` for a bf16 weight they dequantized:
bf16 where this CPU multiplies bf16 natively, else fp32 over the same values (the bf16 operands
widened exactly) with the result rounded to bf16, which is what a bf16 GEMM computes up to the
order of its fp32 sums."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...native import cpu


def prefill_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x bf16 [M, K], weight bf16 [N, K] -> bf16 [M, N]."""
    if cpu.native_bf16_matmul():
        return F.linear(x, weight)
    return F.linear(x.float(), weight.float()).to(x.dtype)
