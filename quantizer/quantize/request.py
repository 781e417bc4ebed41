"""What a quantization run is asked to do: the source, the output, the plan's options and the
calibration inputs, as one value the CLI builds from its options."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..calibrate.windows import CalibrationSettings
from .planning import QuantizeOptions


@dataclass(frozen=True)
class QuantizeRequest:
    """``model``: a folder or a Hub repo id. ``base_model``: the source's Hub id for the model card
    when neither ``model`` nor its config says it. ``windows`` and ``method_settings`` apply to
    calibrated methods (an unset ``windows.nsamples`` takes the method's default; None settings
    take the method's defaults); ``calib_text`` None is the built-in text. ``device`` is where a
    calibrated run computes, and under torchrun which backend joins the ranks (cpu: gloo).
    ``imatrix_out``: a file for the run's input statistics as llama.cpp's importance matrix."""

    model: str
    out: Path
    options: QuantizeOptions = field(default_factory=QuantizeOptions)
    overwrite: bool = False
    base_model: str | None = None
    calib_text: Path | None = None
    windows: CalibrationSettings = field(default_factory=CalibrationSettings)
    method_settings: object | None = None
    resume: bool = False
    device: str = "cpu"
    imatrix_out: Path | None = None
