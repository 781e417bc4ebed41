"""One call from a model name to a finished output folder: resolve the model, check the output
target, plan, run the method, and leave either the complete folder or nothing that looks complete."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .calib_state import STATE_DIR
from .distributed import SINGLE, Ranks
from .errors import InputError
from .gptq_method import GptqOptions
from .config import CALIBRATED_METHODS
from .planning import QuantizationPlan, QuantizeOptions, plan_quantization


class Progress:
    """What a run reports while it works; the default reports nothing."""

    def start(self, total_bytes: int) -> None:
        """A streamed run is about to read ``total_bytes`` of source tensors."""

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more of them are done."""

    def say(self, message: str) -> None:
        """A progress line."""

    def step(self, what: str, done: int, total: int, note: str = "") -> None:
        """``done`` of ``total`` units of ``what`` (layers) are finished; ``note``: how the last went."""

    def note(self, message: str) -> None:
        """A choice the plan made that the user did not ask for."""


@dataclasses.dataclass(frozen=True)
class CalibrationInputs:
    """A calibrated method's inputs: the text file (None: the built-in default) and its settings."""

    text_file: Path | None = None
    gptq: GptqOptions = GptqOptions()
    resume: bool = False


def quantize_checkpoint(model: str, out: Path, options: QuantizeOptions, overwrite: bool = False,
                        calibration: CalibrationInputs = CalibrationInputs(),
                        progress: Progress = Progress(), ranks: Ranks = SINGLE,
                        base_model: str | None = None) -> tuple[QuantizationPlan, dict | None]:
    """Quantize ``model`` (a folder or a Hub repo id) into ``out``. Returns the plan and the report
    (None on a rank other than 0 of a distributed calibrated run, which writes no output).

    An interrupted calibrated run keeps its finished layers for ``resume``; the exception then
    carries ``int4q_kept``, a sentence saying where they are. ``base_model`` names the source's Hub
    id for the model card when neither ``model`` nor its config says it."""
    from .hub import base_model_id, resolve_model_dir
    from .outdir import check_free_space, check_output_target

    calibrated = options.method in CALIBRATED_METHODS
    if ranks.distributed and not calibrated:
        raise InputError(f"--method {options.method} needs no calibration and runs in one process; "
                         "start it without torchrun")
    model_dir = resolve_model_dir(model)
    inputs = [model_dir] + ([calibration.text_file] if calibration.text_file else [])
    if ranks.is_main:
        check_output_target(out, overwrite, inputs)
    plan = plan_quantization(model_dir, options)
    plan = dataclasses.replace(plan, source_name=model, base_model=base_model_id(model, plan.source_config, base_model))
    if ranks.is_main:
        for note in plan.notes:
            progress.note(note)
        tokens = calibration.gptq.nsamples * calibration.gptq.seqlen if calibrated else 0
        check_free_space(out, plan.disk_bytes_needed(tokens))
    if calibrated:
        return plan, _run_calibrated(plan, model_dir, out, overwrite, inputs, calibration, progress, ranks)
    return plan, _run_streamed(plan, out, overwrite, inputs, progress)


def _run_streamed(plan, out: Path, overwrite: bool, inputs: list[Path], progress: Progress) -> dict:
    from .outdir import atomic_output_dir
    from .rtn import run_quantization

    progress.start(plan.reader.total_bytes)
    with atomic_output_dir(out, overwrite, inputs=inputs) as tmp:
        return run_quantization(plan, tmp, progress=lambda name, nbytes: progress.advance(nbytes))


def _run_calibrated(plan, model_dir: Path, out: Path, overwrite: bool, inputs: list[Path],
                    calibration: CalibrationInputs, progress: Progress, ranks: Ranks) -> dict | None:
    from .calibrated import run_calibrated
    from .outdir import atomic_output_dir, partial_dir
    from .runtime import load_tokenizer
    from .textdata import load_text

    if not ranks.is_main:
        return _run_worker(plan, partial_dir(out), calibration, ranks)
    text, origin = load_text(calibration.text_file, "calib")
    tokenizer = load_tokenizer(model_dir)
    try:
        with atomic_output_dir(out, overwrite, keep_partial=True, resume=calibration.resume, inputs=inputs) as tmp:
            return run_calibrated(plan, tmp, tokenizer, text, origin, calibration.gptq, resume=calibration.resume,
                                  progress=progress.say, ranks=ranks, step=progress.step)
    except BaseException as e:
        if partial_dir(out).exists():
            e.int4q_kept = (f"; the finished layers are kept in {partial_dir(out)}: rerun the same command "
                            "with --resume to continue, or delete that folder")
        raise


def _run_worker(plan, partial: Path, calibration: CalibrationInputs, ranks: Ranks) -> None:
    """A rank other than 0: its share of the windows, its hidden states under rank 0's partial
    folder path (on its own machine's disk when it runs elsewhere), no output of its own."""
    from .calibrated import run_calibrated

    run_calibrated(plan, partial, None, None, "", calibration.gptq, resume=calibration.resume, ranks=ranks)
    for folder in (partial / STATE_DIR, partial):  # left empty on a machine that holds no output
        try:
            folder.rmdir()
        except OSError:
            pass
    return None
