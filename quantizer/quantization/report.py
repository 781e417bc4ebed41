"""The end of every quantization run: config.json, the tokenizer files and
``quantization_report.json``, whose sizes count the bytes actually written."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..io.aux_files import copy_aux_files
from ..io.checkpoint import write_json
from ..io.outdir import REPORT_NAME
from ..memory import peak_rss_mb
from .planning import QuantizationPlan


def module_entry(source: str, shape, tensors: dict[str, torch.Tensor], stats: dict) -> dict:
    """A module's report entry: its source tensor, shape, bytes written and error statistics."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"source": source, "shape": list(shape), "bytes": nbytes, **stats}


@dataclass
class Summary:
    """The run in numbers. Bits per weight: of the quantized tensors, and of the whole model (the
    output's file bytes x 8 over the source's parameters, a tied table counted once)."""

    tensors_quantized: int
    quantized_params: int
    bits_per_weight: float | None
    snr_db_min: float | None  # dB; an exact tensor's SNR is left out
    snr_db_mean: float | None
    whole_model_bits_per_weight: float | None
    source_bytes: int
    output_bytes: int
    seconds: float = 0.0
    peak_rss_mb: int = 0
    source_grids: dict[str, int] | None = None  # a quantized source's: modules carried exact, nearest, rounded
    damping_retries: int | None = None  # the calibrated runs' own figures from here on
    world_size: int | None = None
    windows_per_rank: list[int] | None = None
    calibration_peak_rss_mb_per_rank: list[int] | None = None

    def to_json(self) -> dict:
        """The report's ``summary``: a streamed run's has none of the calibrated runs' figures."""
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if v is not None or k in _ALWAYS_WRITTEN}


_ALWAYS_WRITTEN = {f.name for f in dataclasses.fields(Summary)} - {
    "source_grids", "damping_retries", "world_size", "windows_per_rank", "calibration_peak_rss_mb_per_rank"}


@dataclass
class QuantizeReport:
    """What a run wrote and how well: ``quantization_report.json`` (:meth:`to_json`)."""

    source_model: str
    base_model: str | None
    quantization_config: dict
    summary: Summary
    recipe: str
    fallbacks: dict[str, str]  # module -> why its group or bits differ from the plan's
    tensors: dict[str, dict]  # module -> its source, shape, bytes and error statistics

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**d, "summary": self.summary.to_json()}


def source_params(plan: QuantizationPlan) -> int:
    """The source's parameters, a tied table counted once (its dropped copies are not)."""
    return sum(math.prod(i.shape) for n, i in plan.reader.infos.items() if n not in plan.dropped)


def build_report(plan: QuantizationPlan, per_tensor: dict[str, dict], shards: list[Path]) -> QuantizeReport:
    """The report of a finished output (``seconds`` and ``peak_rss_mb`` still to fill in)."""
    snrs = [s["snr_db"] for s in per_tensor.values() if s["snr_db"] is not None]
    params = sum(e["shape"][0] * e["shape"][1] for e in per_tensor.values())
    quantized_bytes = sum(e["bytes"] for e in per_tensor.values())
    output_bytes = sum(p.stat().st_size for p in shards)
    model_params = source_params(plan)
    summary = Summary(
        tensors_quantized=len(per_tensor),
        quantized_params=params,
        bits_per_weight=round(8 * quantized_bytes / params, 4) if params else None,
        snr_db_min=round(min(snrs), 3) if snrs else None,
        snr_db_mean=round(sum(snrs) / len(snrs), 3) if snrs else None,
        whole_model_bits_per_weight=round(8 * output_bytes / model_params, 4) if model_params else None,
        source_bytes=plan.reader.total_bytes,
        output_bytes=output_bytes,
        source_grids=_source_grids(per_tensor) if plan.source_quantized else None,
    )
    return QuantizeReport(plan.source_name or str(plan.model_dir), plan.base_model, plan.qconfig.to_dict(), summary,
                          plan.options.recipe, plan.fallbacks, per_tensor)


def _source_grids(per_tensor: dict[str, dict]) -> dict[str, int]:
    """How many modules kept a quantized source's grid exactly, to the nearest stored values, or
    were rounded again by the method (see quantization.carried)."""
    kinds = [e.get("source_grid") for e in per_tensor.values()]
    return {kind: kinds.count(kind) for kind in ("exact", "nearest", "rounded")}


def finish_output(plan: QuantizationPlan, out_dir: Path, shards: list[Path], per_tensor: dict[str, dict],
                  started: float, **calibrated) -> QuantizeReport:
    """Write config.json, the tokenizer files and the report beside the finished shards; return the
    report. ``calibrated``: the calibrated runs' own :class:`Summary` fields."""
    copy_aux_files(plan.model_dir, out_dir)
    write_json(out_dir / "config.json", plan.output_config())
    report = build_report(plan, per_tensor, shards)
    report.summary = dataclasses.replace(report.summary, seconds=round(time.perf_counter() - started, 3),
                                         peak_rss_mb=round(peak_rss_mb()), **calibrated)
    write_json(out_dir / REPORT_NAME, report.to_json())
    return report
