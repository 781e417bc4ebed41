"""Round-to-nearest on min/max grids stored in bf16 (cpu_int4's default), in one pass over a bf16
weight: codes, scales, zeros and the error statistics together. Pure tensor functions.

The result is :func:`.grid.quantize_groupwise`'s, bit for bit; int4q's native kernel
(``int4q_native::rtn_minmax``) proves that on first use (:mod:`..native.checked`), and where it
cannot the same function runs in torch, row chunk by row chunk.
"""

from __future__ import annotations

import torch

from ..native.checked import CheckedKernel
from .candidates import lane_sum
from .error_stats import ErrorStats
from .grid import BF16, ROW_CHUNK, GroupQuantized, quantize_groupwise


def minmax_rtn(weight: torch.Tensor, group_size: int, symmetric: bool) -> tuple[GroupQuantized, ErrorStats]:
    """bf16 ``weight`` [N, K] on its bf16-stored min/max grids (``group_size`` divides K), and the
    error statistics of the result against it."""
    n, k = weight.shape
    codes = torch.empty(n, k, dtype=torch.uint8)
    scale, zero = (torch.empty(n, k // group_size, dtype=torch.bfloat16) for _ in range(2))
    stats = torch.empty(n, 3, dtype=torch.float64)
    KERNEL()(weight.contiguous(), group_size, symmetric, codes, scale, zero, stats)
    errors = ErrorStats()
    errors.add_sums(float(stats[:, 0].sum()), float(stats[:, 1].sum()), float(stats[:, 2].max()) if n else 0.0)
    return GroupQuantized(codes, scale, zero), errors


def torch_minmax(weight: torch.Tensor, group_size: int, symmetric: bool, codes: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor, stats: torch.Tensor) -> None:
    """:func:`minmax_rtn`'s pass in torch, written into its arguments as the native kernel writes them:
    stats fp64 [N, 3] per row (sum of squared weights, of squared errors, largest absolute error),
    each sum taken with element j of a row in lane j % 8, the lanes then pairwise."""
    for start in range(0, weight.shape[0], ROW_CHUNK):
        rows = slice(start, start + ROW_CHUNK)
        q = quantize_groupwise(weight[rows], group_size, symmetric, storage=BF16)
        codes[rows], scale[rows], zero[rows] = q.codes, q.scale, q.zero
        ref = weight[rows].to(torch.float32)
        err = q.dequantize() - ref
        stats[rows, 0] = _lane_sum(ref.to(torch.float64).pow(2))
        stats[rows, 1] = _lane_sum(err.to(torch.float64).pow(2))
        stats[rows, 2] = err.abs().amax(dim=-1).to(torch.float64) if err.shape[1] else 0.0


def _lane_sum(terms: torch.Tensor) -> torch.Tensor:
    """[n, K] summed per row as the kernel sums (:func:`.candidates.lane_sum`'s order) -> [n]."""
    return lane_sum(terms.unsqueeze(-1))[..., 0]


def _operator(library):
    def native(weight, group_size, symmetric, codes, scale, zero, stats):
        library.rtn_minmax(weight, group_size, symmetric, codes, scale, zero, stats)
    return native


def _probe(kernel) -> list[torch.Tensor]:
    """Seeded weights of 23 rows in groups of 32, 64 and 128, both grids, with a constant group
    (scale 0), an all-zero one and widely spread magnitudes: what ``kernel`` writes."""
    gen = torch.Generator().manual_seed(0)
    written = []
    for group, symmetric in ((32, False), (64, True), (128, False), (128, True)):
        w = torch.randn(23, 3 * group, generator=gen) * torch.logspace(-4, 1, 23)[:, None]
        w[0, :group], w[1, group:2 * group] = 0.5, 0.0
        w = w.to(torch.bfloat16)
        out = (torch.empty(23, 3 * group, dtype=torch.uint8), torch.empty(23, 3, dtype=torch.bfloat16),
               torch.empty(23, 3, dtype=torch.bfloat16), torch.empty(23, 3, dtype=torch.float64))
        kernel(w, group, symmetric, *out)
        written.extend(out)
    return written


KERNEL = CheckedKernel(torch_minmax, _operator, _probe, "round-to-nearest")
