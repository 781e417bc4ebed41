"""A calibrated run: token windows from the calibration text, the method the plan names (see
``quantizer.methods``), and the layer-wise driver."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from ..calibrate.ranks import SINGLE, Ranks
from ..calibrate.state import fingerprint
from ..calibrate.windows import CalibrationSettings, calibration_windows
from ..errors import InputError
from ..memory import heap_kept
from ..methods import get_method
from .layerwise import run_layerwise
from .planning import QuantizationPlan


def run_calibrated(plan: QuantizationPlan, out_dir: Path, tokenizer, calib_text: str | None, calib_origin: str,
                   windows_settings: CalibrationSettings, method_settings=None, resume: bool = False,
                   progress: Callable[[str], None] | None = None, ranks: Ranks = SINGLE, step=None,
                   keep_importance=None) -> dict | None:
    """Quantize ``plan`` with its calibrated method (its own ``method_settings``; None: the
    defaults) into ``out_dir`` (the partial folder). Rank 0 tokenizes the text (the other ranks
    pass None for it and the tokenizer) and returns the report; the other ranks return None.
    ``keep_importance``: as for :func:`~quantizer.quantization.layerwise.run_layerwise`."""
    info = get_method(plan.options.method)
    method = info.make(method_settings)
    s = windows_settings.resolved(info.default_nsamples)
    q = dataclasses.replace(plan.qconfig, calibration={
        **plan.qconfig.calibration, "text": calib_origin, "nsamples": s.nsamples, "seqlen": s.seqlen, "seed": s.seed,
        "precision": s.precision, **method.calibration_record()})
    plan = dataclasses.replace(plan, qconfig=q)
    windows, fp = None, None
    if ranks.is_main:
        windows = calibration_windows(tokenizer, calib_text, s.nsamples, s.seqlen, s.seed)
        settings = {**dataclasses.asdict(s), **(dataclasses.asdict(method.settings) if method.settings else {})}
        fp = fingerprint(plan.source_config, q.to_dict(), settings, plan.targets, dataclasses.asdict(plan.options),
                         ranks.world_size, files=plan.reader.files, tensors=(windows,))
    windows, fp = ranks.broadcast_object((windows, fp))
    if windows.shape[0] < ranks.world_size:
        raise InputError(f"{windows.shape[0]} calibration windows cannot be shared by {ranks.world_size} "
                         "processes; raise --nsamples or start fewer processes")
    with heap_kept():
        return run_layerwise(plan, out_dir, windows, method, fp, resume=resume, say=progress, ranks=ranks,
                             step=step, dtype=s.dtype, keep_importance=keep_importance)
