"""Checks that a cpu_int4 checkpoint is what it claims: structure, round trip against the
source, and the kernel layout. Each check returns findings; nothing here prints."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint import INDEX_NAME, CheckpointReader, read_config, read_quantized
from .config import QuantizationConfig
from .errors import Int4qError
from .minmax import CLIP_SHRINKS, ErrorStats
from .packing import (
    QUANT_SUFFIXES,
    dequantize_codes,
    dequantize_int4pack,
    scales_and_zeros,
    supports_direct_dequant,
    to_int4pack,
    unpack_nibbles,
)
from .structure import architecture_mismatches, build_empty_model, inspect_structure, tie_word_embeddings

MAX_LISTED = 5


@dataclass
class CheckResult:
    """One check, with one of three outcomes: ``ok``; ``failed`` (``problems`` name the tensor or
    key); ``could not run`` (``could_not_run`` says why; never a pass)."""

    name: str
    problems: list[str] = field(default_factory=list)
    could_not_run: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems and self.could_not_run is None

    @property
    def outcome(self) -> str:
        return "failed" if self.problems else "could not run" if self.could_not_run else "ok"

    def fail(self, message: str) -> None:
        self.problems.append(message)

    def as_dict(self) -> dict:
        return {"name": self.name, "outcome": self.outcome, "ok": self.ok, "problems": self.problems,
                "could_not_run": self.could_not_run}


@dataclass
class StructureInfo:
    """What the structure check learned, for the later checks."""

    qconfig: QuantizationConfig | None
    reader: CheckpointReader | None
    quantized: list[str]


def check_structure(qdir: Path) -> tuple[CheckResult, StructureInfo]:
    """config, tensor presence, dtypes, shapes for the group size, shard index, head tying."""
    result = CheckResult("structure")
    info = StructureInfo(None, None, [])
    try:
        config = read_config(qdir)
        qc = config.get("quantization_config")
        if qc is None:
            result.fail("config.json has no quantization_config")
            return result, info
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        if method != "cpu_int4":
            export = " (int4q's GPTQ export: vLLM and GPTQ loaders read it)" if method == "gptq" else ""
            result.fail(f"this is a {method!r} checkpoint{export}; int4q verify checks cpu_int4 checkpoints")
            return result, info
        info.qconfig = QuantizationConfig.from_dict(qc)
        info.reader = CheckpointReader(qdir)
    except Int4qError as e:
        result.fail(str(e))
        return result, info
    reader, q = info.reader, info.qconfig
    names = set(reader.infos)
    _check_index(qdir, reader, result)

    quantized = sorted(n.removesuffix(".weight_packed") for n in names if n.endswith(".weight_packed"))
    info.quantized = quantized
    for module in quantized:
        _check_quantized_tensors(module, reader, q.group_size, result)
    for name in names:
        module, _, suffix = name.rpartition(".")
        if suffix in ("weight_scale", "weight_zero") and module not in quantized:
            result.fail(f"{name}: stray tensor (no {module}.weight_packed)")

    try:
        structure = inspect_structure(config)
    except Int4qError as e:
        result.fail(f"cannot build the architecture to check tensor names: {e}")
        return result, info
    tied = tie_word_embeddings(config)
    expected = set(structure.decoder_linears)
    if structure.embedding and q.quantize_embedding:
        expected.add(structure.embedding)
    if structure.head and not tied and not q.is_ignored(structure.head):
        expected.add(structure.head)
    for module in sorted(expected - set(quantized)):
        if q.is_ignored(module) and f"{module}.weight" in names:
            continue
        result.fail(f"{module}: expected quantized tensors ({module}.weight_packed), missing")
    for module in quantized:
        if f"{module}.weight" in names:
            result.fail(f"{module}: has both weight and weight_packed")
        if q.is_ignored(module):
            result.fail(f"{module}: listed in ignore but quantized")
    if structure.head:
        head_tensors = [n for n in names if n.startswith(structure.head + ".")]
        if tied and head_tensors:
            result.fail(f"tie_word_embeddings is true but the checkpoint has {head_tensors[0]}")
        if not tied and not head_tensors:
            result.fail(f"tie_word_embeddings is false but there is no {structure.head} tensor")

    shapes = {n: i.shape for n, i in reader.infos.items() if n.rpartition(".")[0] not in set(quantized)}
    for module in quantized:
        n, half = reader.infos[f"{module}.weight_packed"].shape
        shapes[f"{module}.weight"] = (n, 2 * half)
        if f"{module}.bias" in reader.infos:
            shapes[f"{module}.bias"] = reader.infos[f"{module}.bias"].shape
    model = build_empty_model(config)
    for problem in architecture_mismatches(model, shapes, structure.head if tied else None):
        result.fail(problem)
    return result, info


def _check_index(qdir: Path, reader: CheckpointReader, result: CheckResult) -> None:
    index = Path(qdir) / INDEX_NAME
    if not index.is_file():
        if len(reader.files) > 1:
            result.fail(f"{len(reader.files)} shards but no {INDEX_NAME}")
        return
    weight_map = json.loads(index.read_text())["weight_map"]
    for name, info in reader.infos.items():
        if weight_map.get(name) != info.file.name:
            result.fail(f"{INDEX_NAME}: {name} is in {info.file.name}, the index says {weight_map.get(name)}")
    for name in set(weight_map) - set(reader.infos):
        result.fail(f"{INDEX_NAME}: names {name}, which is in no shard")
    listed = set(weight_map.values())
    for file in Path(qdir).glob("*.safetensors"):
        if file.name not in listed:
            result.fail(f"{file.name}: a shard the index does not list")


def _check_quantized_tensors(module: str, reader: CheckpointReader, group: int, result: CheckResult) -> None:
    infos = reader.infos
    missing = [f"{module}.{s}" for s in QUANT_SUFFIXES if f"{module}.{s}" not in infos]
    if missing:
        result.fail(f"{missing[0]}: missing")
        return
    packed, scale, zero = (infos[f"{module}.{s}"] for s in QUANT_SUFFIXES)
    if packed.dtype != torch.uint8 or len(packed.shape) != 2:
        result.fail(f"{packed.name}: expected a 2-D uint8 tensor, got {packed.dtype} {list(packed.shape)}")
        return
    n, half = packed.shape
    want = (n, 2 * half // group) if (2 * half) % group == 0 else None
    for t in (scale, zero):
        if t.dtype != torch.bfloat16:
            result.fail(f"{t.name}: dtype {t.dtype}, expected bfloat16")
        if want is None or tuple(t.shape) != want:
            result.fail(f"{t.name}: shape {list(t.shape)} does not match group_size {group} for K={2 * half} "
                        f"(expected {list(want) if want else 'K divisible by the group'})")


@dataclass
class TensorStats:
    module: str
    snr_db: float | None
    max_abs_err: float
    max_excess: float  # largest error beyond the nearest grid point (0 for round-to-nearest)


def check_round_trip(info: StructureInfo, source_dir: Path) -> tuple[CheckResult, list[TensorStats]]:
    """Copied tensors bit-identical to the source; quantized ones within their grid bound.

    Round-to-nearest must land every element on the nearest point of its group's grid (so the
    error is at most half a step inside the grid's range). GPTQ chooses codes with error
    feedback, so for it only the statistics are reported.
    """
    result, stats = CheckResult("round trip"), []
    q, reader = info.qconfig, info.reader
    source = CheckpointReader(source_dir)
    src_config = read_config(source_dir)
    quantized = set(info.quantized)
    tied_src = tie_word_embeddings(src_config)
    structure = inspect_structure(src_config)
    copied = differing = 0
    for name in sorted(reader.infos):
        module, _, suffix = name.rpartition(".")
        if module in quantized:
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
                                  f"(whose weights are {', '.join(dtypes)}): is --model the checkpoint this "
                                  "was quantized from?")
    for module in sorted(quantized):
        src_name = f"{module}.weight"
        if src_name not in source.infos and tied_src and module == structure.head:
            src_name = f"{structure.embedding}.weight"  # an untied head made from the tied table
        if src_name not in source.infos:
            result.fail(f"{module}: no {src_name} in the source")
            continue
        try:
            packed, scale, zero = read_quantized(reader, module)
        except Int4qError as e:
            result.fail(str(e))
            continue
        w = source.get(src_name).float()
        codes = unpack_nibbles(packed)
        if codes.shape != w.shape or scale.shape[1] * q.group_size != w.shape[1]:
            result.fail(f"{module}: shape {list(codes.shape)} / group {q.group_size} does not fit the source "
                        f"{list(w.shape)}")
            continue
        deq = dequantize_codes(codes, scale, zero, torch.float32)
        err_stats = ErrorStats()
        err_stats.add(w, deq)
        excess = _excess_over_nearest(w, deq, scale, zero, q.group_size)
        stats.append(TensorStats(module, err_stats.as_dict()["snr_db"], err_stats.max_abs_err, excess))
        if q.method == "minmax" and excess > 0:
            result.fail(f"{module}: an element is {excess:.3g} further from the source than the nearest point of "
                        "its group's grid (corrupt codes, scales or zeros)")
        uncovered = _uncovered_range(w, scale, zero, q.group_size, CLIP_SHRINKS[-1] if q.clip_search else 1.0)
        if uncovered > 0:
            result.fail(f"{module}: a group's grid misses {uncovered:.3g} of the source's range (corrupt scales or "
                        "zeros)")
    return result, stats


def _excess_over_nearest(w, deq, scale, zero, group) -> float:
    """max(|w - deq| - distance from w to its group's nearest grid point), with fp32 slack."""
    n, k = w.shape
    s = scale.float().repeat_interleave(group, 1)
    z = zero.float().repeat_interleave(group, 1)
    lo, hi = z - 8 * s, z + 7 * s
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
    short = torch.maximum((z - 8 * s) - (mid - half), (mid + half) - (z + 7 * s)) - slack
    return max(short.max().item(), 0.0)


def check_kernel_layout(info: StructureInfo, seed: int = 0) -> CheckResult:
    """Per quantized linear: tinygemm pack + direct dequantization equals the row-major one
    bit for bit, and the tinygemm GEMV agrees with the dequantized reference on random inputs."""
    result = CheckResult("kernel layout")
    q, reader = info.qconfig, info.reader
    gen = torch.Generator().manual_seed(seed)
    for module in info.quantized:
        try:
            packed, scale, zero = read_quantized(reader, module)
        except Int4qError as e:
            result.fail(str(e))
            continue
        n, half = packed.shape
        if n % 16:
            continue  # an embedding table alone never goes through the kernel
        int4pack, sz = to_int4pack(packed), scales_and_zeros(scale, zero)
        reference = dequantize_codes(unpack_nibbles(packed), scale, zero)
        if supports_direct_dequant(n) and not torch.equal(dequantize_int4pack(int4pack, sz, q.group_size), reference):
            result.fail(f"{module}: direct dequantization from the kernel layout differs from row-major")
        x = torch.randn(1, 2 * half, generator=gen).to(torch.bfloat16)
        got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4pack, q.group_size, sz).float()
        want = x.float() @ reference.float().t()
        if (got - want).abs().max().item() > 0.02 * want.abs().max().item() + 1e-3:
            result.fail(f"{module}: tinygemm GEMV disagrees with the dequantized reference")
    return result
