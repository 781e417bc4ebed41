"""What a quantization run is asked to do: the source, the output, the plan's options and the
calibration inputs, as one value; :func:`checked_request` refuses what cannot be asked together,
for the CLI and the Python API alike."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ..calibrate.windows import CalibrationSettings
from ..errors import UsageError
from ..formats import get_format
from ..schema.scheme import KEPT_BITS
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


def checked_request(request: QuantizeRequest, refine: bool = False) -> QuantizeRequest:
    """``request`` with the grid a ``--gguf-type`` implies decided; UsageError or InputError, in
    one line naming the fix, for options that do not go together (``refine``: GPTQ's descent was
    asked for)."""
    options = request.options
    if options.gguf_type and options.checkpoint_format != "gguf":
        raise UsageError("--gguf-type is for --format gguf")
    if options.target_bpw is not None:
        options = _sized(options)
    if options.checkpoint_format == "gguf":
        from ..formats.gguf.staging import check_gguf_type

        options = dataclasses.replace(options, symmetric=check_gguf_type(options.gguf_type, options.symmetric))
    symmetric = options.symmetric if options.symmetric is not None else \
        get_format(options.checkpoint_format).default_symmetric
    if refine and (options.method != "gptq" or not symmetric):
        raise UsageError("--refine is for --method gptq on symmetric grids: add --method gptq and --sym "
                         "(for GGUF, --gguf-type q4_0 or q5_0)")
    return dataclasses.replace(request, options=options)


def _sized(options: QuantizeOptions) -> QuantizeOptions:
    """``options`` for a ``--target-bpw`` run: its own GGUF type, every module's bits its choice."""
    from ..formats.gguf.types import SIZED

    if options.checkpoint_format != "gguf":
        raise UsageError("--target-bpw is for --format gguf")
    for given, flag in ((options.gguf_type, "--gguf-type"), (options.recipe != "all4", "--recipe"),
                        (options.overrides, "--override"), (options.symmetric is not None, "--sym/--asym"),
                        ({options.head_bits, options.embedding_bits} - {None, KEPT_BITS},
                         "--head-bits/--embedding-bits")):
        if given:
            raise UsageError(f"--target-bpw chooses every module's type; drop {flag}")
    if not options.target_bpw > 0:
        raise UsageError(f"--target-bpw {options.target_bpw:g} is not a positive number of bits per weight")
    return dataclasses.replace(options, gguf_type=SIZED.name)
