"""``--imatrix-out``: a calibrated run's input statistics as llama.cpp's importance-matrix file.
The target and the GGUF names are settled before the run; the file is written after it, aside
and renamed in, so it never looks complete before it is."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UsageError
from ..io.outdir import check_output_file, output_lock, partial_dir
from .planning import QuantizationPlan
from .report import QuantizeReport
from .single_file import check_file_name

if TYPE_CHECKING:
    from ..formats.gguf.names import GgufNames


@dataclass
class ImatrixOutput:
    """Where the file goes, its GGUF names, and (after the run) the statistics: module ->
    (column mean squares [K] fp32, input rows)."""

    path: Path
    names: GgufNames
    statistics: dict = field(default_factory=dict)

    def keep(self, statistics: dict) -> None:
        self.statistics = statistics


def prepare_imatrix(path: Path, plan: QuantizationPlan, calibrated: bool, out: Path, overwrite: bool,
                    inputs: list[Path]) -> ImatrixOutput:
    """Check the target (UsageError or InputError in one line) and map the modules whose inputs
    the run will measure to the names llama.cpp's converter gives their weights."""
    from ..formats.gguf.imatrix import is_int4q_imatrix
    from ..formats.gguf.names import gguf_names

    if not calibrated:
        raise UsageError("--imatrix-out needs a calibrated method (--method weighted or gptq): minmax measures "
                         "no activations")
    check_file_name(path, ".gguf", "llama.cpp's importance matrix", "--imatrix-out")
    if Path(path).absolute() == Path(out).absolute():
        raise UsageError("--imatrix-out and --out name the same file; choose another name for one of them")
    target = check_output_file(path, overwrite, inputs, is_int4q_imatrix, "--imatrix-out")
    return ImatrixOutput(target, gguf_names(plan.model_dir, plan.source_config, _measured_shapes(plan)))


def _measured_shapes(plan: QuantizationPlan) -> dict[str, tuple[int, ...]]:
    """Source weight shapes of the modules whose inputs a calibrated run measures: the layers'
    quantized linears and the head (a tied head has the table's shape)."""
    infos, head, emb = plan.reader.infos, plan.structure.head, plan.structure.embedding
    shapes = {m: tuple(infos[s].shape) for m, s in plan.targets.items() if m not in (head, emb)}
    if head:
        shapes[head] = tuple((infos.get(f"{head}.weight") or infos[f"{emb}.weight"]).shape)
    return shapes


def write_imatrix_file(imatrix: ImatrixOutput, report: QuantizeReport, overwrite: bool, inputs: list[Path]) -> None:
    """Write the file from the finished run's statistics."""
    from ..formats.gguf.imatrix import is_int4q_imatrix, write_imatrix

    calibration = report.quantization_config["calibration"]
    with output_lock(imatrix.path):
        target = check_output_file(imatrix.path, overwrite, inputs, is_int4q_imatrix, "--imatrix-out")
        tmp = partial_dir(target)
        try:
            write_imatrix(tmp, imatrix.names, imatrix.statistics, calibration["text"], calibration["nsamples"],
                          calibration["seqlen"], {**calibration, "method": report.quantization_config.get("method")})
            tmp.replace(target)
        finally:
            tmp.unlink(missing_ok=True)
