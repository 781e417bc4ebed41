"""GPTQ as a method of the layer-wise driver: its statistic is the Hessian of each step's input,
and each linear is solved by :func:`quantizer.gptq.gptq_quantize`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .calib_state import fingerprint
from .calibration import calibration_windows
from .gptq import HessianAccumulator, gptq_quantize, proxy_loss
from .grid import ROW_CHUNK, ErrorStats, GroupQuantized, quantize_groupwise
from .layerwise import run_layerwise
from .planning import QuantizationPlan
from .scheme import ModuleScheme


@dataclass(frozen=True)
class GptqOptions:
    nsamples: int = 128
    seqlen: int = 512
    act_order: bool = True
    damp: float = 0.01
    block_size: int = 128
    seed: int = 0


@dataclass(frozen=True)
class GptqMethod:
    """GPTQ with ``options``; ``integer_zero`` when the format stores integer zero points."""

    options: GptqOptions
    integer_zero: bool = False

    def accumulator(self, in_features: int) -> HessianAccumulator:
        return HessianAccumulator(in_features)

    def quantize(self, weight: torch.Tensor, stats: HessianAccumulator, scheme: ModuleScheme) -> tuple[GroupQuantized, dict]:
        """GPTQ one weight; the entry compares it with round-to-nearest on the same objective."""
        o, H = self.options, stats.H
        gq, info = gptq_quantize(weight, H, scheme.group_size, symmetric=scheme.symmetric, act_order=o.act_order,
                                 damp=o.damp, block_size=o.block_size, integer_zero=self.integer_zero)
        err, gptq_loss, rtn_loss = ErrorStats(), 0.0, 0.0
        for start in range(0, weight.shape[0], ROW_CHUNK):  # row chunks bound the fp32 copies of a large head
            rows = slice(start, start + ROW_CHUNK)
            w = weight[rows]
            deq = gq.rows(rows).dequantize()
            err.add(w, deq)
            gptq_loss += proxy_loss(w, deq, H)
            rtn = quantize_groupwise(w, scheme.group_size, symmetric=scheme.symmetric).dequantize()
            rtn_loss += proxy_loss(w, rtn, H)
        return gq, {
            **err.as_dict(), "method": "gptq", "gptq_loss": gptq_loss, "rtn_loss": rtn_loss,
            "damp": info.damp, "damp_retries": info.retries, "dead_columns": info.dead_columns,
        }


def run_gptq(plan: QuantizationPlan, out_dir: Path, tokenizer, calib_text: str, calib_origin: str,
             options: GptqOptions, resume: bool = False, progress: Callable[[str], None] | None = None) -> dict:
    """Quantize ``plan`` with GPTQ into ``out_dir`` (the partial folder). Returns the report."""
    q = dataclasses.replace(plan.qconfig, calibration={
        "text": calib_origin, "nsamples": options.nsamples, "seqlen": options.seqlen, "seed": options.seed,
        "act_order": options.act_order, "damp": options.damp})
    plan = dataclasses.replace(plan, qconfig=q)
    windows = calibration_windows(tokenizer, calib_text, options.nsamples, options.seqlen, options.seed)
    fp = fingerprint(plan.source_config, q.to_dict(), dataclasses.asdict(options), plan.targets,
                     dataclasses.asdict(plan.options), files=plan.reader.files, tensors=(windows,))
    method = GptqMethod(options, integer_zero=plan.format.integer_zero)
    return run_layerwise(plan, out_dir, windows, method, fp, resume=resume, say=progress)
