"""Runs whose output is one file (GGUF): the method's run fills a hidden folder of blocks beside
the file (kept for --resume when interrupted), the file is written aside and renamed in, and the
folder is removed."""

from __future__ import annotations

import dataclasses
import errno
import shutil
from pathlib import Path
from typing import Callable

from ..errors import InputError
from ..io.checkpoint import CheckpointReader
from ..io.outdir import check_output_file, output_lock, partial_dir
from .planning import QuantizationPlan
from .report import QuantizeReport, source_params
from .request import QuantizeRequest


def blocks_dir(out: Path) -> Path:
    """The folder a single-file run's method writes (stable, so the run can resume)."""
    out = Path(out).absolute()
    return out.parent / f".{out.name}.int4q-blocks"


def check_file_name(out: Path, suffix: str, title: str, option: str = "--out") -> None:
    if Path(out).suffix.lower() != suffix:
        raise InputError(f"{option} {out}: {title} is one file; give it a name ending in {suffix}")


def run_single_file(plan: QuantizationPlan, request: QuantizeRequest, inputs: list[Path],
                    run_folder: Callable[[QuantizeRequest], QuantizeReport], progress) -> QuantizeReport:
    """``run_folder`` writes the blocks folder for a request; then the file is assembled from it,
    its bytes told to ``progress`` (a :class:`.run.Progress`) as they are written."""
    from ..formats.gguf.write import is_int4q_gguf, write_from_blocks

    out = Path(request.out)
    check_output_file(out, request.overwrite, inputs, is_int4q_gguf)
    folder = blocks_dir(out)
    report = run_folder(dataclasses.replace(request, out=folder, overwrite=True))
    try:  # nothing resumes from a finished blocks folder: it goes, whatever happens now
        with output_lock(out):
            target = check_output_file(out, request.overwrite, inputs, is_int4q_gguf)
            tmp = partial_dir(target)  # a file here: the same hidden name beside the target
            try:
                write_from_blocks(plan, CheckpointReader(folder), tmp,
                                  lambda done, total: progress.wrote(f"write {out.name}", done, total))
                tmp.replace(target)
            except OSError as e:
                if e.errno is None:  # numpy's short write: the device filled up
                    raise OSError(errno.ENOSPC, str(e), str(target)) from None
                raise
            finally:
                tmp.unlink(missing_ok=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    size, params = target.stat().st_size, source_params(plan)
    report.summary = dataclasses.replace(report.summary, output_bytes=size,
                                         whole_model_bits_per_weight=round(8 * size / params, 4) if params else None)
    return report
