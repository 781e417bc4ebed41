"""Activation-weighted round-to-nearest as a method of the layer-wise driver: its statistic is
each input column's mean squared activation (the diagonal of XᵀX / n, llama.cpp's importance
matrix), and each group's grid is the one that minimises the error weighted by it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..spec.methods import UNCALIBRATED
from ..spec.scheme import ModuleScheme
from .grid import BF16, ChannelQuantized, GroupQuantized, Storage
from .rtn import quantize_rtn


class ColumnMeanSquare:
    """The running mean of x² per input column of a linear."""

    def __init__(self, k: int, device: str | torch.device = "cpu"):
        self.sum = torch.zeros(k, dtype=torch.float64, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float32)
        self.sum += x.pow(2).sum(0).to(torch.float64)
        self.n += x.shape[0]

    def merge(self, sum_across: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Become the statistic of every process's rows (``sum_across`` sums in place over them)."""
        sum_across(self.sum)
        self.n = int(sum_across(torch.tensor([self.n], dtype=torch.float64)).item())

    @property
    def value(self) -> torch.Tensor:
        """[K] fp32; zeros before any input."""
        return (self.sum / max(self.n, 1)).to(torch.float32)

    def column_mean_square(self) -> tuple[torch.Tensor, int]:
        """(:attr:`value`, the rows it is over)."""
        return self.value, self.n


@dataclass(frozen=True)
class WeightedRtnMethod:
    """Round-to-nearest on activation-weighted grids (it has no settings); ``storage``: how the
    format stores the grids."""

    settings: None = None
    storage: Storage = BF16

    def accumulator(self, in_features: int, device: str = "cpu") -> ColumnMeanSquare:
        return ColumnMeanSquare(in_features, device)

    def calibration_record(self) -> dict:
        return {}

    def quantize(self, weight: torch.Tensor, stats: ColumnMeanSquare,
                 scheme: ModuleScheme) -> tuple[GroupQuantized | ChannelQuantized, dict]:
        """4-bit: grids by the weighted search; 8-bit: the covering per-channel grid (unweighted)."""
        q, err = quantize_rtn(weight, scheme, storage=self.storage, column_weights=stats.value)
        return q, {**err.as_dict(), "method": "weighted" if scheme.bits == 4 else UNCALIBRATED}
