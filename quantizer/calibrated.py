"""A calibrated run: token windows from the calibration text, the method the plan names, and
the layer-wise driver. Registering a calibrated method is one entry in ``METHODS`` here."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from .calib_state import fingerprint
from .calibration import calibration_windows
from .distributed import SINGLE, Ranks
from .errors import InputError
from .gptq_method import GptqMethod, GptqOptions
from .layerwise import run_layerwise
from .planning import QuantizationPlan
from .weighted_method import WeightedRtnMethod

METHODS = {
    "gptq": lambda options, integer_zero: GptqMethod(options, integer_zero),
    "weighted": lambda options, integer_zero: WeightedRtnMethod(integer_zero),
}


def run_calibrated(plan: QuantizationPlan, out_dir: Path, tokenizer, calib_text: str | None, calib_origin: str,
                   options: GptqOptions, resume: bool = False, progress: Callable[[str], None] | None = None,
                   ranks: Ranks = SINGLE, step=None) -> dict | None:
    """Quantize ``plan`` with its calibrated method into ``out_dir`` (the partial folder). Rank 0
    tokenizes the text (the other ranks pass None for it and the tokenizer) and returns the
    report; the other ranks return None."""
    method = METHODS[plan.options.method](options, plan.format.integer_zero)
    q = dataclasses.replace(plan.qconfig, calibration={
        "text": calib_origin, "nsamples": options.nsamples, "seqlen": options.seqlen, "seed": options.seed,
        **method.settings()})
    plan = dataclasses.replace(plan, qconfig=q)
    windows, fp = None, None
    if ranks.is_main:
        windows = calibration_windows(tokenizer, calib_text, options.nsamples, options.seqlen, options.seed)
        fp = fingerprint(plan.source_config, q.to_dict(), dataclasses.asdict(options), plan.targets,
                         dataclasses.asdict(plan.options), ranks.world_size, files=plan.reader.files,
                         tensors=(windows,))
    windows, fp = ranks.broadcast_object((windows, fp))
    if windows.shape[0] < ranks.world_size:
        raise InputError(f"{windows.shape[0]} calibration windows cannot be shared by {ranks.world_size} "
                         "processes; raise --nsamples or start fewer processes")
    return run_layerwise(plan, out_dir, windows, method, fp, resume=resume, say=progress, ranks=ranks, step=step)
