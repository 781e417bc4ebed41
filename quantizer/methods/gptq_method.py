"""GPTQ as a method of the layer-wise driver: its statistic is the Hessian of each step's input,
and each linear is solved by :func:`quantizer.methods.gptq.gptq_quantize`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..schema.methods import UNCALIBRATED
from ..schema.scheme import ModuleScheme
from .error_stats import ErrorStats
from .gptq import HessianAccumulator, error_objective, gptq_quantize
from .gptq_refine import refine_symmetric
from .grid import (
    BF16,
    ROW_CHUNK,
    GroupQuantized,
    Storage,
    quantize_groupwise,
    row_chunks,
)
from .rtn import quantize_rtn

REPORT_WORK = 1 << 36  # multiply-adds of the report's round-to-nearest objective over all rows, at most


@dataclass(frozen=True)
class GptqSettings:
    act_order: bool = True  # visit columns by decreasing diag(H), groups static
    damp: float = 0.01  # added to diag(H), as a fraction of its mean
    block_size: int = 128  # columns per lazy block update
    weighted_grids: bool = True  # each static group's grid by the diag(H)-weighted search
    refine: bool = False  # symmetric grids: coordinate descent on codes and scales after the solve


@dataclass(frozen=True)
class GptqMethod:
    """GPTQ with ``settings`` (None: the defaults)."""

    settings: GptqSettings | None = None

    def __post_init__(self) -> None:
        if self.settings is None:
            object.__setattr__(self, "settings", GptqSettings())

    def accumulator(self, in_features: int, device: str = "cpu") -> HessianAccumulator:
        return HessianAccumulator(in_features, device)

    def calibration_record(self) -> dict:
        """What the run's calibration record adds for this method."""
        o = self.settings
        return {"act_order": o.act_order, "damp": o.damp, "weighted_grids": o.weighted_grids, "refine": o.refine}

    def quantize(self, weight: torch.Tensor, stats: HessianAccumulator, scheme: ModuleScheme,
                 storage: Storage = BF16) -> tuple[GroupQuantized, dict]:
        """GPTQ one weight onto its grids as ``storage`` holds them; the entry compares it with
        round-to-nearest on the same objective. An 8-bit module is rounded to nearest: its error
        is already far below the 4-bit modules'."""
        if scheme.bits == 8:
            q, err = quantize_rtn(weight, scheme, storage=storage)
            return q, {**err.as_dict(), "method": UNCALIBRATED}
        o, H = self.settings, stats.H
        gq, info = gptq_quantize(weight, H, scheme.group_size, symmetric=scheme.symmetric, act_order=o.act_order,
                                 damp=o.damp, block_size=o.block_size, storage=storage,
                                 weighted_grids=o.weighted_grids, factor=stats.factor(o.damp, o.act_order))
        loss = info.objective
        if o.refine and scheme.symmetric and not storage.superblock and not storage.codebook:  # linear, free scales
            gq, loss = refine_symmetric(weight, H, gq, storage)
        err, rtn_loss, rtn_rows = _report(weight, gq, H, scheme, storage)
        return gq, {
            **err.as_dict(), "method": "gptq", "gptq_loss": loss, "rtn_loss": rtn_loss, "rtn_loss_rows": rtn_rows,
            "damp": info.damp, "damp_retries": info.retries, "dead_columns": info.dead_columns,
        }


def _report(weight: torch.Tensor, gq: GroupQuantized, H: torch.Tensor, scheme: ModuleScheme,
            storage: Storage) -> tuple[ErrorStats, float, int]:
    """GPTQ's error statistics against ``weight`` [N, K], and round-to-nearest's objective on the
    same H with the rows it was measured on. Rows' objectives add up, so where all N would cost
    more than :data:`REPORT_WORK` multiply-adds (N K^2; a 7B down projection's 1.3e12 take as
    long as its factorisation) it is the sum over every s-th row times N over their count. Row
    chunks bound the fp32 copies of a large head, and the elementwise passes run on cache-sized
    pieces of them."""
    n, k = weight.shape
    err = ErrorStats()
    for start in range(0, n, ROW_CHUNK):
        w, q = weight[start:start + ROW_CHUNK], gq.rows(slice(start, start + ROW_CHUNK))
        for rows in row_chunks(*w.shape):
            err.add(w[rows].to(torch.float32), q.rows(rows).dequantize())
    sampled = weight[::max(1, -(-n * k * k // REPORT_WORK))]
    rtn_storage = dataclasses.replace(BF16, bits=storage.bits, codebook=storage.codebook)
    rtn_loss = 0.0
    for start in range(0, sampled.shape[0], ROW_CHUNK):
        w = sampled[start:start + ROW_CHUNK].contiguous()
        rtn_error = torch.empty(w.shape, dtype=torch.float32, device=w.device)
        for rows in row_chunks(*w.shape):
            rtn = quantize_groupwise(w[rows], scheme.group_size, symmetric=scheme.symmetric, storage=rtn_storage)
            torch.sub(w[rows].to(torch.float32), rtn.dequantize(), out=rtn_error[rows])
        rtn_loss += error_objective(rtn_error, H)
    return err, rtn_loss * n / sampled.shape[0], sampled.shape[0]
