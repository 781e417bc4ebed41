"""One call from a request to a finished output folder: resolve the model, check the output
target, plan, run the method (joining the other ranks under torchrun), and leave either the
complete folder or nothing that looks complete."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..calibrate import ranks as rank_session
from ..calibrate.ranks import Ranks
from ..calibrate.state import STATE_DIR, BadResumeState
from ..errors import InterruptedRun, UsageError
from ..methods import NAMES as METHOD_NAMES
from ..methods import get_method
from .imatrix_out import ImatrixOutput, prepare_imatrix, write_imatrix_file
from .planning import QuantizationPlan, plan_quantization
from .report import QuantizeReport
from .request import QuantizeRequest


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

    def wrote(self, what: str, done: int, total: int) -> None:
        """``done`` of ``total`` bytes of ``what`` (a file) are written."""

    def note(self, message: str) -> None:
        """A choice the plan made that the user did not ask for."""


def quantize_checkpoint(request: QuantizeRequest, progress: Progress = Progress()) -> QuantizeReport | None:
    """Quantize ``request.model`` into ``request.out``. Returns the report; None on a rank other
    than 0 under torchrun, which writes no output.

    A calibrated run joins torchrun's other ranks (if any) for its duration. An interrupted one
    keeps its finished layers for ``resume`` and raises InterruptedRun saying where they are."""
    info = get_method(request.options.method)
    if not info.calibrated and (request.calib_text or request.resume):
        calibrated = ", ".join(m for m in METHOD_NAMES if get_method(m).calibrated)
        raise UsageError(f"--calib and --resume apply to calibrated methods only ({calibrated})")
    if not info.calibrated:
        if rank_session.in_launcher() and os.environ.get("RANK", "0") != "0":
            return None  # an uncalibrated run is rank 0's alone
        return _quantize(request, progress, rank_session.SINGLE)
    ranks = rank_session.join(request.device)
    try:
        return _quantize(request, progress if ranks.is_main else Progress(), ranks)
    finally:
        rank_session.leave(ranks)


def _quantize(request: QuantizeRequest, progress: Progress, ranks: Ranks) -> QuantizeReport | None:
    from ..io.outdir import check_free_space, check_output_target
    from ..io.source import base_model_id, resolve_model_dir
    from .single_file import check_file_name, run_single_file

    info = get_method(request.options.method)
    fmt = request.options.output_format
    if fmt.single_file:
        check_file_name(request.out, fmt.suffix, fmt.title)
    model_dir = resolve_model_dir(request.model)
    inputs = [model_dir] + ([request.calib_text] if request.calib_text else [])
    if ranks.is_main and not fmt.single_file:
        check_output_target(request.out, request.overwrite, inputs)
    plan = plan_quantization(model_dir, request.options)
    plan = dataclasses.replace(plan, source_name=request.model,
                               base_model=base_model_id(request.model, plan.source_config, request.base_model))
    windows = request.windows.resolved(info.default_nsamples) if info.calibrated else None
    imatrix = None
    if ranks.is_main:
        if request.imatrix_out is not None:
            imatrix = prepare_imatrix(request.imatrix_out, plan, info.calibrated, request.out, request.overwrite, inputs)
        for note in plan.notes + _imatrix_notes(imatrix):
            progress.note(note)
        check_free_space(request.out, plan.disk_bytes_needed(windows.nsamples * windows.seqlen if windows else 0))
    if info.calibrated:
        request = dataclasses.replace(request, windows=windows)

    def run_folder(req: QuantizeRequest) -> QuantizeReport | None:
        if info.calibrated:
            return _run_calibrated(plan, model_dir, req, inputs, progress, ranks, imatrix and imatrix.keep)
        return _run_streamed(plan, req, inputs, progress)

    if fmt.single_file and ranks.is_main:
        report = run_single_file(plan, request, inputs, run_folder, progress)
    elif fmt.single_file:
        from .single_file import blocks_dir

        report = run_folder(dataclasses.replace(request, out=blocks_dir(request.out)))
    else:
        report = run_folder(request)
    if imatrix is not None:
        write_imatrix_file(imatrix, report, request.overwrite, inputs)
    return report


def _imatrix_notes(imatrix: ImatrixOutput | None) -> tuple[str, ...]:
    left_out = imatrix.names.left_out if imatrix else []
    if not left_out:
        return ()
    return (f"--imatrix-out: {len(left_out)} module(s) have no GGUF weight of their own over the same inputs "
            f"(stacked or reshaped by llama.cpp's converter), so the imatrix leaves them out: {left_out[0]}, ...",)


def _run_streamed(plan: QuantizationPlan, request: QuantizeRequest, inputs: list[Path],
                  progress: Progress) -> QuantizeReport:
    from ..io.outdir import atomic_output_dir
    from .streamed import run_quantization

    progress.start(plan.reader.total_bytes)
    with atomic_output_dir(request.out, request.overwrite, inputs=inputs) as tmp:
        return run_quantization(plan, tmp, progress=lambda name, nbytes: progress.advance(nbytes))


def _run_calibrated(plan: QuantizationPlan, model_dir: Path, request: QuantizeRequest, inputs: list[Path],
                    progress: Progress, ranks: Ranks, keep_importance=None) -> QuantizeReport | None:
    from ..io.outdir import atomic_output_dir, partial_dir
    from ..io.text import load_text, text_budget
    from ..io.tokenizer import load_tokenizer
    from .calibrated import run_calibrated

    if not ranks.is_main:
        return _run_worker(plan, partial_dir(request.out), request, ranks)
    if request.resume:
        _check_resumable(partial_dir(request.out))
    text, origin = load_text(request.calib_text, "calib",
                             text_budget(request.windows.nsamples * request.windows.seqlen))
    tokenizer = load_tokenizer(model_dir)
    try:
        with atomic_output_dir(request.out, request.overwrite, keep_partial=True, resume=request.resume,
                               inputs=inputs) as tmp:
            return run_calibrated(plan, tmp, tokenizer, text, origin, request.windows, request.method_settings,
                                  resume=request.resume, progress=progress.say, ranks=ranks, step=progress.step,
                                  keep_importance=keep_importance)
    except BaseException as e:
        if partial_dir(request.out).exists() and not isinstance(e, BadResumeState):
            raise InterruptedRun(e, f"; the finished layers are kept in {partial_dir(request.out)}: rerun the same "
                                    "command with --resume to continue, or delete that folder") from e
        raise


def _check_resumable(partial: Path) -> None:
    """A partial folder holds only the calibration state int4q wrote there; anything else, a link
    above all, would be carried into the output, so it is refused before any work."""
    if partial.is_symlink() or (partial.exists() and not partial.is_dir()):
        raise BadResumeState(f"{partial} is not the folder int4q left (a link or a file); remove it yourself, "
                             "then rerun without --resume")
    foreign = sorted(e.name for e in partial.iterdir() if e.name != STATE_DIR) if partial.is_dir() else []
    if foreign:
        raise BadResumeState(f"{partial} holds {foreign[0]}, which int4q did not leave there; move it out of that "
                             "folder and --resume again, or rerun without --resume")


def _run_worker(plan: QuantizationPlan, partial: Path, request: QuantizeRequest, ranks: Ranks) -> None:
    """A rank other than 0: its share of the windows, its hidden states under rank 0's partial
    folder path (on its own machine's disk when it runs elsewhere), no output of its own."""
    from .calibrated import run_calibrated

    run_calibrated(plan, partial, None, None, "", request.windows, request.method_settings, resume=request.resume,
                   ranks=ranks)
    for folder in (partial / STATE_DIR, partial):  # left empty on a machine that holds no output
        try:
            folder.rmdir()
        except OSError:
            pass
    return None
