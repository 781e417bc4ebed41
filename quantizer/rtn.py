"""Round-to-nearest over a whole checkpoint, streamed: one source tensor is read, quantized and
written at a time, so memory stays at about the largest tensor whatever the model's size."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

import torch

from .memory import release_free_memory
from .grid import ROW_CHUNK, ChannelQuantized, ErrorStats, GroupQuantized, quantize_groupwise, quantize_per_channel
from .planning import QuantizationPlan
from .report import finish_output, module_entry
from .scheme import ModuleScheme
from .shards import ShardWriter

ProgressFn = Callable[[str, int], None]
TRIM_EVERY_BYTES = 512 * 1000**2  # trimming after every tensor measured 37% slower on a 6 GB model


def quantize_rtn(weight: torch.Tensor, scheme: ModuleScheme, clip_search: bool = False, integer_zero: bool = False,
                 column_weights: torch.Tensor | None = None) -> tuple[GroupQuantized | ChannelQuantized, ErrorStats]:
    """Round-to-nearest on the scheme's grid (4-bit groups or 8-bit channels), in row chunks
    written into one result (no concatenated copies); the error statistics against ``weight``.
    ``column_weights`` [K]: 4-bit grids chosen by the weighted search (see grid.quantize_groupwise)."""
    stats = ErrorStats()
    out = None
    for start in range(0, weight.shape[0], ROW_CHUNK):
        rows = weight[start:start + ROW_CHUNK]
        if scheme.bits == 8:
            part = quantize_per_channel(rows)
        else:
            part = quantize_groupwise(rows, scheme.group_size, symmetric=scheme.symmetric, clip_search=clip_search,
                                      integer_zero=integer_zero, column_weights=column_weights)
        stats.add(rows, part.dequantize())
        if out is None:
            out = type(part)(*(torch.empty((weight.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device) for t in _fields(part)))
        for mine, theirs in zip(_fields(out), _fields(part)):
            mine[start:start + ROW_CHUNK] = theirs
    return out, stats


def _fields(q: GroupQuantized | ChannelQuantized) -> tuple[torch.Tensor, ...]:
    return tuple(getattr(q, f.name) for f in dataclasses.fields(q))


def quantize_module(plan: QuantizationPlan, module: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    """One module by round-to-nearest: its checkpoint tensors in the plan's format and its report entry."""
    q, stats = quantize_rtn(weight, plan.scheme_of(module), plan.qconfig.clip_search, plan.format.integer_zero)
    tensors = plan.format.tensors(module, q)
    return tensors, module_entry(plan.targets[module], weight.shape, tensors, stats.as_dict())


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
    since_trim = 0
    for info, modules in plan.reading_order():
        tensor = plan.reader.get(info.name)
        if not modules:
            writer.add(info.name, tensor)
        for module in modules:
            tensors, per_tensor[module] = quantize_module(plan, module, tensor)
            for name, t in tensors.items():
                writer.add(name, t)
        del tensor
        since_trim += info.nbytes
        if since_trim >= TRIM_EVERY_BYTES:  # freed tensors go back to the OS: the heap cannot creep
            release_free_memory()
            since_trim = 0
        if progress:
            progress(info.name, info.nbytes)
    return finish_output(plan, out_dir, writer.finish(), per_tensor, start)
