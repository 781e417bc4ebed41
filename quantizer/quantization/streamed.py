"""Round-to-nearest over a whole checkpoint, streamed: one source tensor is read and quantized at a
time while the previous one's outputs are written, so memory stays at about the largest tensor's
whatever the model's size."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from ..errors import InputError
from ..io.shards import ShardWriter
from ..memory import heap_kept
from ..methods import UNCALIBRATED, get_method
from ..methods.grid import ROW_CHUNK
from ..methods.rtn import RtnSettings
from .carried import quantize_from_source
from .planning import QuantizationPlan
from .report import finish_output, module_entry

ProgressFn = Callable[[str, int], None]


def refuse_non_finite(plan: QuantizationPlan, module: str, weight: torch.Tensor) -> None:
    """InputError when a weight about to be quantized holds NaN or infinite values."""
    if not weight.numel() or all(bool(torch.isfinite(t)) for t in torch.aminmax(weight)):  # NaN, inf are extremes
        return
    bad = sum(int((~torch.isfinite(rows)).sum()) for rows in weight.split(ROW_CHUNK))  # bounded transients
    if bad:
        raise InputError(f"{plan.targets[module]} holds {bad} NaN or infinite values, which no grid can hold; fix the "
                         f"checkpoint, or keep {module} in bf16 with --ignore {module}")


def quantize_module(plan: QuantizationPlan, module: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    """One module by round-to-nearest from its source tensor: its checkpoint tensors in the plan's
    format and its report entry."""
    weight = plan.linear_weight(module, weight)
    refuse_non_finite(plan, module, weight)
    method = get_method(UNCALIBRATED).make(RtnSettings(plan.qconfig.clip_search))
    q, stats = quantize_from_source(plan, module, weight, lambda: method.quantize(
        weight, None, plan.scheme_of(module), plan.storage_of(module)))
    tensors = plan.format.tensors(module, q, plan.scheme_of(module))
    return tensors, module_entry(plan.targets[module], weight.shape, tensors, stats)


def _write_all(writer: ShardWriter, tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        writer.add(name, t)


def run_quantization(plan: QuantizationPlan, out_dir: Path, progress: ProgressFn | None = None) -> dict:
    """Stream every tensor of the plan into ``out_dir`` (which must exist and be empty).

    Returns the report (also written as quantization_report.json). ``progress(name, nbytes)``
    is called after each source tensor.
    """
    start = time.perf_counter()
    writer = ShardWriter(out_dir, plan.output_specs(), plan.options.max_shard_bytes)
    per_tensor: dict[str, dict] = {}
    if progress:
        for name in sorted(plan.dropped):
            progress(name, plan.reader.infos[name].nbytes)
    with heap_kept(), ThreadPoolExecutor(1, thread_name_prefix="int4q-write") as background:
        written = None  # the previous source tensor's writes, on the background thread while this one computes
        for info, modules in plan.reading_order():
            tensor = plan.reader.get(info.name)
            outputs = {} if modules else {info.name: tensor}
            for module in modules:
                tensors, per_tensor[module] = quantize_module(plan, module, tensor)
                outputs.update(tensors)
            del tensor
            if written is not None:
                written.result()
            written = background.submit(_write_all, writer, outputs)
            if progress:
                progress(info.name, info.nbytes)
        if written is not None:
            written.result()
    return finish_output(plan, out_dir, writer.finish(), per_tensor, start)
