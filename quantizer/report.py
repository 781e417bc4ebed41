"""The end of every quantization run: config.json, the tokenizer files and
``quantization_report.json``, whose sizes count the bytes actually written."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from .checkpoint import copy_aux_files, write_json
from .memory import peak_rss_mb
from .outdir import REPORT_NAME
from .planning import QuantizationPlan


def module_entry(source: str, shape, tensors: dict[str, torch.Tensor], stats: dict) -> dict:
    """A module's report entry: its source tensor, shape, bytes written and error statistics."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"source": source, "shape": list(shape), "bytes": nbytes, **stats}


def build_report(plan: QuantizationPlan, per_tensor: dict[str, dict], shards: list[Path]) -> dict:
    """The quantization_report.json content (an exact tensor's SNR is null). Whole-model bits per
    weight: the output's file bytes x 8 over the source's parameters, a tied table counted once."""
    snrs = [s["snr_db"] for s in per_tensor.values() if s["snr_db"] is not None]
    params = sum(e["shape"][0] * e["shape"][1] for e in per_tensor.values())
    quantized_bytes = sum(e["bytes"] for e in per_tensor.values())
    output_bytes = sum(p.stat().st_size for p in shards)
    model_params = sum(math.prod(i.shape) for n, i in plan.reader.infos.items() if n not in plan.dropped)
    return {
        "source_model": plan.source_name or str(plan.model_dir),
        "base_model": plan.base_model,
        "quantization_config": plan.qconfig.to_dict(),
        "summary": {
            "tensors_quantized": len(per_tensor),
            "quantized_params": params,
            "bits_per_weight": round(8 * quantized_bytes / params, 4) if params else None,
            "snr_db_min": round(min(snrs), 3) if snrs else None,
            "snr_db_mean": round(sum(snrs) / len(snrs), 3) if snrs else None,
            "whole_model_bits_per_weight": round(8 * output_bytes / model_params, 4) if model_params else None,
            "source_bytes": plan.reader.total_bytes,
            "output_bytes": output_bytes,
        },
        "recipe": plan.options.recipe,
        "fallbacks": plan.fallbacks,
        "tensors": per_tensor,
    }


def finish_output(plan: QuantizationPlan, out_dir: Path, shards: list[Path], per_tensor: dict[str, dict],
                  started: float, **summary) -> dict:
    """Write config.json, the tokenizer files and the report beside the finished shards; return the report."""
    copy_aux_files(plan.model_dir, out_dir)
    write_json(out_dir / "config.json", plan.output_config())
    report = build_report(plan, per_tensor, shards)
    report["summary"]["seconds"] = round(time.perf_counter() - started, 3)
    report["summary"]["peak_rss_mb"] = round(peak_rss_mb())
    report["summary"].update(summary)
    write_json(out_dir / REPORT_NAME, report)
    return report
