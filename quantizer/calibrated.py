"""A calibrated run: token windows from the calibration text, the method the plan names, and
the layer-wise driver. Registering a calibrated method is one entry in ``METHODS`` here."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from .calib_state import fingerprint
from .calibration import calibration_windows
from .gptq_method import GptqMethod, GptqOptions
from .layerwise import run_layerwise
from .planning import QuantizationPlan
from .weighted_method import WeightedRtnMethod

METHODS = {
    "gptq": lambda options, integer_zero: GptqMethod(options, integer_zero),
    "weighted": lambda options, integer_zero: WeightedRtnMethod(integer_zero),
}


def run_calibrated(plan: QuantizationPlan, out_dir: Path, tokenizer, calib_text: str, calib_origin: str,
                   options: GptqOptions, resume: bool = False, progress: Callable[[str], None] | None = None) -> dict:
    """Quantize ``plan`` with its calibrated method into ``out_dir`` (the partial folder). Returns the report."""
    method = METHODS[plan.options.method](options, plan.format.integer_zero)
    q = dataclasses.replace(plan.qconfig, calibration={
        "text": calib_origin, "nsamples": options.nsamples, "seqlen": options.seqlen, "seed": options.seed,
        **method.settings()})
    plan = dataclasses.replace(plan, qconfig=q)
    windows = calibration_windows(tokenizer, calib_text, options.nsamples, options.seqlen, options.seed)
    fp = fingerprint(plan.source_config, q.to_dict(), dataclasses.asdict(options), plan.targets,
                     dataclasses.asdict(plan.options), files=plan.reader.files, tensors=(windows,))
    return run_layerwise(plan, out_dir, windows, method, fp, resume=resume, say=progress)
