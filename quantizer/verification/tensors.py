"""The tensor checks of a cpu_int4 checkpoint: each quantized module against its source (round
trip) and against the kernels that will run it. Nothing here prints."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import Int4qError
from ..formats.packing import (
    kernel_layout_matches,
    scales_and_zeros,
    to_int4pack,
    unpack_nibbles,
)
from ..io.checkpoint import CheckpointReader, read_config
from ..io.structure import ModelStructure, tie_word_embeddings
from ..methods.error_stats import ErrorStats
from ..methods.grid import (
    CLIP_SHRINKS,
    MID,
    QMAX,
    QMAX8,
    ChannelQuantized,
    dequantize_codes,
)
from ..runtime.kernels.dequant import dequantize_int4pack
from ..runtime.kernels.gemv_rows import decode_matmul
from ..schema.config import SOURCE_GRIDS
from ..schema.methods import get_method
from .structure import FORMAT, CheckResult, StructureInfo


def _read_module(info: StructureInfo, module: str, result: CheckResult):
    """((packed, scale, zero), group size) of one module, or None with the problem recorded."""
    scheme = info.qconfig.scheme_for(module)
    try:
        return FORMAT.read_module(info.reader, module, scheme), scheme.group_size
    except Int4qError as e:
        result.fail(str(e))
        return None


def searched_grids(q) -> bool:
    """Whether the grids were chosen by the weighted search, which may clip a group's range."""
    return get_method(q.method).searched_grids(q.calibration)


def carried_grids(q) -> bool:
    """Whether the grids came from an already-quantized source: its producer's, which may clip a
    group and need not hold the codes nearest to the float weights."""
    return bool(q.calibration.get(SOURCE_GRIDS))


@dataclass
class TensorStats:
    module: str
    snr_db: float | None
    max_abs_err: float
    max_excess: float  # largest error beyond the nearest grid point (0 for round-to-nearest)


def check_round_trip(info: StructureInfo, source_dir: Path,
                     structure: ModelStructure) -> tuple[CheckResult, list[TensorStats]]:
    """Copied tensors bit-identical to the source; quantized ones within their grid bound.

    Round-to-nearest (plain or weighted) must land every element on the nearest point of its
    group's grid (so the error is at most half a step inside the grid's range); GPTQ chooses codes
    with error feedback, so for its 4-bit modules only the statistics are reported. Min/max grids
    must cover their group's range; searched grids (weighted) and grids carried from a quantized
    source (its producer's) may clip it, and carried codes need not be nearest. 8-bit modules are
    always round-to-nearest on a covering grid. ``structure`` is the source's.
    """
    result, stats = CheckResult("round trip"), []
    source = CheckpointReader(source_dir)
    _check_copied(info.reader, set(info.quantized), source, source_dir, result)
    src_config = read_config(source_dir)
    for module in sorted(info.quantized):
        src_name = f"{module}.weight"
        if src_name not in source.infos and tie_word_embeddings(src_config) and module == structure.head:
            src_name = f"{structure.embedding}.weight"  # an untied head made from the tied table
        if src_name not in source.infos:
            result.fail(f"{module}: no {src_name} in the source")
            continue
        read = _read_module(info, module, result)
        w = structure.as_linear(module, source.get(src_name)).float()
        bad = int((~torch.isfinite(w)).sum())  # the stored scales and zeros: check_structure, which runs first
        if bad:
            result.fail(f"{module}: the source weight holds {bad} NaN or infinite values")
        elif read is not None:
            check = _check_8bit if len(read[0]) == 2 else _check_4bit
            stat = check(module, w, read, info.qconfig, result)
            if stat is not None:
                stats.append(stat)
    return result, stats


def _check_copied(reader, quantized: set[str], source, source_dir: Path, result: CheckResult) -> None:
    copied = differing = 0
    for name in sorted(reader.infos):
        if name.rpartition(".")[0] in quantized:
            continue
        if name not in source.infos:
            result.fail(f"{name}: not in the source checkpoint")
            continue
        a, b = reader.get(name), source.get(name)
        copied += 1
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            differing += 1
            result.fail(f"{name}: differs from the source (copied tensors must be bit-identical)")
    if copied and differing == copied:
        dtypes = sorted({str(i.dtype).removeprefix("torch.") for i in source.infos.values()})
        result.problems.insert(0, f"none of the {copied} copied tensors equals its source in {source_dir} "
                                  f"(whose weights are {', '.join(dtypes)}): is --reference the checkpoint this "
                                  "was quantized from?")


def _check_4bit(module: str, w: torch.Tensor, read, q, result: CheckResult) -> TensorStats | None:
    (packed, scale, zero), group = read
    codes = unpack_nibbles(packed)
    if codes.shape != w.shape or scale.shape[1] * group != w.shape[1]:
        result.fail(f"{module}: shape {list(codes.shape)} / group {group} does not fit the source {list(w.shape)}")
        return None
    deq = dequantize_codes(codes, scale, zero, torch.float32)
    err_stats = ErrorStats()
    err_stats.add(w, deq)
    excess = _excess_over_nearest(w, deq, scale, zero, group)
    if get_method(q.method).nearest_codes and not carried_grids(q) and excess > 0:
        result.fail(f"{module}: an element is {excess:.3g} further from the source than the nearest point of "
                    "its group's grid (corrupt codes, scales or zeros)")
    uncovered = _uncovered_range(w, scale, zero, group, CLIP_SHRINKS[-1] if q.clip_search else 1.0)
    if not searched_grids(q) and not carried_grids(q) and uncovered > 0:
        result.fail(f"{module}: a group's grid misses {uncovered:.3g} of the source's range (corrupt scales or "
                    "zeros)")
    return TensorStats(module, err_stats.as_dict()["snr_db"], err_stats.max_abs_err, excess)


def _check_8bit(module: str, w: torch.Tensor, read, q, result: CheckResult) -> TensorStats | None:
    """Every element within half a step of its channel's grid, and the grid covering the channel."""
    (codes, scale), _ = read
    if codes.shape != w.shape:
        result.fail(f"{module}: shape {list(codes.shape)} does not fit the source {list(w.shape)}")
        return None
    deq = ChannelQuantized(codes, scale).dequantize()
    s = scale.float()
    err_stats = ErrorStats()
    err_stats.add(w, deq)
    slack = 1e-5 * (w.abs() + s) + 1e-12
    inside = w.abs() <= QMAX8 * s
    excess = max(((w - deq).abs() - s / 2 - slack)[inside].max().item() if inside.any() else 0.0, 0.0)
    if excess > 0:
        result.fail(f"{module}: an element is {excess:.3g} further from the source than half a step of its "
                    "channel's 8-bit grid (corrupt codes or scales)")
    short = (w.abs().amax(1, keepdim=True) - QMAX8 * s * (1 + 2.0**-7)).max().item()
    if short > 0:
        result.fail(f"{module}: a channel's 8-bit grid misses {short:.3g} of the source's range (corrupt scales)")
    return TensorStats(module, err_stats.as_dict()["snr_db"], err_stats.max_abs_err, excess)


def _excess_over_nearest(w, deq, scale, zero, group) -> float:
    """max(|w - deq| - distance from w to its group's nearest grid point), with fp32 slack."""
    n, k = w.shape
    s = scale.float().repeat_interleave(group, 1)
    z = zero.float().repeat_interleave(group, 1)
    lo, hi = z - MID * s, z + (QMAX - MID) * s
    inside = w.clamp(min=lo, max=hi)
    nearest = (inside - lo) - torch.round((inside - lo) / torch.where(s == 0, 1, s)) * s
    distance = nearest.abs() + (w - inside).abs()
    slack = 1e-5 * (w.abs() + s + z.abs()) + 1e-12
    return max(((w - deq).abs() - distance - slack).max().item(), 0.0)


def _uncovered_range(w, scale, zero, group, min_shrink: float) -> float:
    """How far the groups' grids [zero - 8 scale, zero + 7 scale] fall short of covering the
    source groups' value range (shrunk by ``min_shrink`` about its centre for clip search),
    beyond bf16 rounding of the parameters."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    mid, half = (lo + hi) / 2, (hi - lo) / 2 * min_shrink
    s, z = scale.float(), zero.float()
    slack = 2.0**-7 * (z.abs() + 8 * s + lo.abs() + hi.abs()) + 1e-12
    short = torch.maximum((z - MID * s) - (mid - half), (mid + half) - (z + (QMAX - MID) * s)) - slack
    return max(short.max().item(), 0.0)


def check_kernel_layout(info: StructureInfo, seed: int = 0) -> CheckResult:
    """Per quantized linear: where the runtime dequantizes from the kernel layout (this CPU's
    tinygemm layout is the one int4q decodes), tinygemm pack + that direct dequantization (the
    native kernel where it is available) equals the row-major one bit for bit; and the decode
    kernel the runtime takes here for such a layer (int4q's GEMV, the row-major one where the
    layer keeps row-major tensors, tinygemm, or the 8-bit GEMV) agrees with the dequantized
    reference on random inputs."""
    result = CheckResult("kernel layout")
    gen = torch.Generator().manual_seed(seed)
    for module in info.quantized:
        read = _read_module(info, module, result)
        if read is None:
            continue
        tensors, group = read
        if len(tensors) == 2:
            codes, scale = tensors
            x = torch.randn(1, codes.shape[1], generator=gen).to(torch.bfloat16)
            got = torch.ops.aten._weight_int8pack_mm(x, codes, scale.reshape(-1)).float()
            reference = ChannelQuantized(codes, scale).dequantize(torch.bfloat16)
        else:
            packed, scale, zero = tensors
            n, half = packed.shape
            if n % 16:
                continue  # an embedding table alone never goes through the kernel
            int4pack, sz = to_int4pack(packed), scales_and_zeros(scale, zero)
            reference = dequantize_codes(unpack_nibbles(packed), scale, zero)
            direct = kernel_layout_matches(n)  # where the runtime dequantizes from the kernel layout
            if direct and not torch.equal(dequantize_int4pack(int4pack, sz, group), reference):
                result.fail(f"{module}: direct dequantization from the kernel layout differs from row-major")
            x = torch.randn(1, 2 * half, generator=gen).to(torch.bfloat16)
            got = decode_matmul(x, int4pack, sz, group, None if direct else (packed, scale, zero)).float()
        want = x.float() @ reference.float().t()
        if (got - want).abs().max().item() > 0.02 * want.abs().max().item() + 1e-3:
            result.fail(f"{module}: the kernel's GEMV disagrees with the dequantized reference")
    return result
