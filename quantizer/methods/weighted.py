"""Activation-weighted rounding as a method of the layer-wise driver. Its statistic is the inputs'
second moment XᵀX / n on diagonal blocks of consecutive input columns: its diagonal (each
column's mean squared activation, llama.cpp's importance matrix) weights each group's grid
search, and the blocks then move codes off their nearest grid point where that lowers the
expected output error (:mod:`.rounding`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..schema.methods import UNCALIBRATED
from ..schema.scheme import ModuleScheme
from .error_stats import ErrorStats
from .grid import BF16, ROW_CHUNK, ChannelQuantized, GroupQuantized, Storage
from .rounding import refine_codes
from .rtn import quantize_rtn

BLOCK = 64  # input columns per block of the second moment (or the largest power of two dividing K)


class BlockSecondMoment:
    """The running mean of x xᵀ over a linear's inputs on diagonal blocks of :data:`BLOCK` columns."""

    def __init__(self, k: int, device: str | torch.device = "cpu"):
        b = next(b for b in (BLOCK, 32, 16, 8, 4, 2, 1) if k % b == 0)
        self.sum = torch.zeros(k // b, b, b, dtype=torch.float64, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        groups, b, _ = self.sum.shape
        x = x.reshape(-1, groups, b).to(torch.float32).transpose(0, 1)  # [G, rows, b]
        self.sum += (x.transpose(1, 2) @ x).to(torch.float64)
        self.n += x.shape[1]

    def merge(self, sum_across: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Become the statistic of every process's rows (``sum_across`` sums in place over them)."""
        sum_across(self.sum)
        self.n = int(sum_across(torch.tensor([self.n], dtype=torch.float64)).item())

    @property
    def blocks(self) -> torch.Tensor:
        """The mean x xᵀ on the diagonal blocks [K / b, b, b] fp32; zeros before any input."""
        return (self.sum / max(self.n, 1)).to(torch.float32)

    @property
    def value(self) -> torch.Tensor:
        """Each column's mean x² [K] fp32; zeros before any input."""
        return torch.diagonal(self.blocks, dim1=1, dim2=2).reshape(-1).contiguous()

    def column_mean_square(self) -> tuple[torch.Tensor, int]:
        """(:attr:`value` on the CPU, the rows it is over)."""
        return self.value.cpu(), self.n


@dataclass(frozen=True)
class WeightedRounding:
    """Rounding on activation-weighted grids (it has no settings)."""

    settings: None = None

    def accumulator(self, in_features: int, device: str = "cpu") -> BlockSecondMoment:
        return BlockSecondMoment(in_features, device)

    def calibration_record(self) -> dict:
        return {}

    def quantize(self, weight: torch.Tensor, stats: BlockSecondMoment, scheme: ModuleScheme,
                 storage: Storage = BF16) -> tuple[GroupQuantized | ChannelQuantized, dict]:
        """Groups: grids by the weighted search, codes refined on the blocks; 8-bit: the covering
        per-channel grid (unweighted, nearest codes)."""
        if not scheme.grouped:
            q, err = quantize_rtn(weight, scheme, storage=storage)
            return q, {**err.as_dict(), "method": UNCALIBRATED}
        nearest, _ = quantize_rtn(weight, scheme, storage=storage, column_weights=stats.value)
        q = refine_codes(weight, nearest, stats.blocks)
        err = ErrorStats()
        for rows in range(0, weight.shape[0], ROW_CHUNK):
            err.add(weight[rows:rows + ROW_CHUNK], q.rows(slice(rows, rows + ROW_CHUNK)).dequantize())
        return q, {**err.as_dict(), "method": "weighted"}
