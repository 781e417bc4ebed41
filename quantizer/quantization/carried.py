"""A quantized source's own grid carried into the output (see :mod:`..methods.transfer`): exactly
where the output's storage holds it, to the nearest stored scale and zero where only they differ,
and otherwise the method rounds the source's dequantized weight. Each module's report entry says
which (``source_grid``: exact, nearest or rounded; none for a module the source keeps in float)
beside its error against the source."""

from __future__ import annotations

from typing import Callable

import torch

from ..methods.error_stats import ErrorStats
from ..methods.grid import ChannelQuantized, GroupQuantized
from ..methods.transfer import transfer_grid

Quantized = tuple[GroupQuantized | ChannelQuantized, dict]


def quantize_from_source(plan, module: str, weight: torch.Tensor, quantize: Callable[[], Quantized]) -> Quantized:
    """``module``'s weight [N, K] (the source's values) on the output's grid: the source's own
    grid where it carries over, else ``quantize()`` (the run's method)."""
    grid = plan.source_grid(module)
    scheme = plan.scheme_of(module)
    moved = None
    if grid is not None and scheme.bits == grid.bits:
        moved = transfer_grid(grid, scheme.group_size, scheme.symmetric, plan.storage_of(module))
    if moved is None:
        q, stats = quantize()
        return (q, stats) if grid is None else (q, {**stats, "source_grid": "rounded"})
    q = GroupQuantized(*(t.to(weight.device) for t in moved.quantized.tensors), moved.quantized.bits)
    err = ErrorStats()
    err.add(weight, q.dequantize(torch.float32))
    return q, {**err.as_dict(), "source_grid": "exact" if moved.exact else "nearest"}
