"""Round-to-nearest, the uncalibrated method: each weight's codes are the nearest points of its
grids (4-bit groups, min/max or clipped by ``clip_search``; or 8-bit channels). Pure tensor code."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..schema.scheme import ModuleScheme
from .error_stats import ErrorStats
from .grid import (
    BF16,
    ROW_CHUNK,
    ChannelQuantized,
    GroupQuantized,
    Storage,
    quantize_groupwise,
    quantize_per_channel,
)
from .minmax import minmax_rtn

STATS_ELEMENTS = 1 << 21
"""Weights per slice of the error statistics: each fp32 transient 8 MB, whatever the weight's width
(a 7B down projection's row chunk is 77 M weights)."""


def quantize_rtn(weight: torch.Tensor, scheme: ModuleScheme, clip_search: bool = False, storage: Storage = BF16,
                 column_weights: torch.Tensor | None = None) -> tuple[GroupQuantized | ChannelQuantized, ErrorStats]:
    """Round-to-nearest on the scheme's grid (groups of 4 to 6 bits, or 8-bit channels), in row chunks
    written into one result (no concatenated copies); the error statistics against ``weight``.
    ``column_weights`` [K]: 4-bit grids chosen by the weighted search (see grid.quantize_groupwise)."""
    if _one_pass(weight, scheme, clip_search, storage, column_weights):
        return minmax_rtn(weight, scheme.group_size, scheme.symmetric)
    stats = ErrorStats()
    out = None
    step = max(1, STATS_ELEMENTS // max(weight.shape[1], 1))
    for start in range(0, weight.shape[0], ROW_CHUNK):
        rows = weight[start:start + ROW_CHUNK]
        if scheme.bits == 8:
            part = quantize_per_channel(rows, storage)
        else:
            part = quantize_groupwise(rows, scheme.group_size, symmetric=scheme.symmetric, clip_search=clip_search,
                                      storage=storage, column_weights=column_weights)
        for first in range(0, rows.shape[0], step):
            stats.add(rows[first:first + step], part.rows(slice(first, first + step)).dequantize())
        if out is None:
            out = dataclasses.replace(part, **{name: torch.empty((weight.shape[0], *t.shape[1:]), dtype=t.dtype,
                                                                 device=t.device) for name, t in _tensors(part)})
        for name, t in _tensors(part):
            getattr(out, name)[start:start + ROW_CHUNK] = t
    return out, stats


def _one_pass(weight: torch.Tensor, scheme: ModuleScheme, clip_search: bool, storage: Storage,
              column_weights: torch.Tensor | None) -> bool:
    """Whether :func:`.minmax.minmax_rtn` gives this weight's result: bf16 min/max grids of a bf16 weight."""
    return (scheme.bits == 4 and storage == BF16 and not clip_search and column_weights is None
            and weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[1] % scheme.group_size == 0)


def _tensors(q: GroupQuantized | ChannelQuantized) -> list[tuple[str, torch.Tensor]]:
    """The quantized weight's tensor fields, by name."""
    return [(f.name, getattr(q, f.name)) for f in dataclasses.fields(q) if isinstance(getattr(q, f.name), torch.Tensor)]


@dataclass(frozen=True)
class RtnSettings:
    clip_search: bool = False  # each group's range shrunk by the factor that minimises its squared error


@dataclass(frozen=True)
class RoundToNearest:
    """Round-to-nearest with ``settings``."""

    settings: RtnSettings | None = None

    def __post_init__(self) -> None:
        if self.settings is None:
            object.__setattr__(self, "settings", RtnSettings())

    def calibration_record(self) -> dict:
        return {}

    def quantize(self, weight: torch.Tensor, stats: None, scheme: ModuleScheme,
                 storage: Storage = BF16) -> tuple[GroupQuantized | ChannelQuantized, dict]:
        """The weight on the scheme's grid as ``storage`` holds it, and its error statistics
        (``stats`` is unused)."""
        q, err = quantize_rtn(weight, scheme, self.settings.clip_search, storage)
        return q, err.as_dict()
