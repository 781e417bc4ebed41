"""Checks that a cpu_int4 checkpoint is what it claims: structure, round trip against the
source, and the kernel layout. Each check returns findings; nothing here prints."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint import INDEX_NAME, CheckpointReader, read_config
from .config import QuantizationConfig
from .errors import Int4qError
from .formats import cpu_int4, format_of_config
from .grid import CLIP_SHRINKS, MID, QMAX, ErrorStats, dequantize_codes
from .packing import dequantize_int4pack, scales_and_zeros, supports_direct_dequant, to_int4pack, unpack_nibbles
from .structure import architecture_mismatches, build_empty_model, inspect_structure, tie_word_embeddings

FORMAT = cpu_int4.FORMAT


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
    config = _read_checkpoint(qdir, result, info)
    if config is None:
        return result, info
    reader, q = info.reader, info.qconfig
    _check_index(qdir, reader, result)
    marker = "." + FORMAT.marker
    info.quantized = sorted(n.removesuffix(marker) for n in reader.infos if n.endswith(marker))
    for module in info.quantized:
        for problem in FORMAT.module_problems(module, reader.infos, q.scheme_for(module)):
            result.fail(problem)
    for name in reader.infos:
        module, _, suffix = name.rpartition(".")
        if suffix in cpu_int4.SUFFIXES and module not in info.quantized:
            result.fail(f"{name}: stray tensor (no {module}{marker})")
    try:
        structure = inspect_structure(config)
    except Int4qError as e:
        result.fail(f"cannot build the architecture to check tensor names: {e}")
        return result, info
    tied = tie_word_embeddings(config)
    _check_expected_modules(structure, q, tied, info.quantized, set(reader.infos), result)
    shapes = {n: i.shape for n, i in reader.infos.items() if n.rpartition(".")[0] not in set(info.quantized)}
    for module in info.quantized:
        n, half = reader.infos[f"{module}{marker}"].shape
        shapes[f"{module}.weight"] = (n, 2 * half)
        if f"{module}.bias" in reader.infos:
            shapes[f"{module}.bias"] = reader.infos[f"{module}.bias"].shape
    for problem in architecture_mismatches(build_empty_model(config), shapes, structure.head if tied else None):
        result.fail(problem)
    return result, info


def _read_checkpoint(qdir: Path, result: CheckResult, info: StructureInfo) -> dict | None:
    """config.json, with ``info``'s config and reader filled in; None (and a problem) if it is not
    a readable cpu_int4 checkpoint."""
    try:
        config = read_config(qdir)
        qc = config.get("quantization_config")
        if qc is None:
            result.fail("config.json has no quantization_config")
            return None
        fmt = format_of_config(qc)
        if fmt is not FORMAT:
            method = qc.get("quant_method") if isinstance(qc, dict) else None
            export = f" (int4q's {fmt.title} export: {fmt.read_by} read it)" if fmt else ""
            result.fail(f"this is a {method!r} checkpoint{export}; int4q verify checks {FORMAT.name} checkpoints")
            return None
        info.qconfig = QuantizationConfig.from_dict(qc)
        info.reader = CheckpointReader(qdir)
    except Int4qError as e:
        result.fail(str(e))
        return None
    return config


def _check_expected_modules(structure, q: QuantizationConfig, tied: bool, quantized: list[str], names: set[str],
                            result: CheckResult) -> None:
    """The quantized modules are the ones the config says, and the head is tied as it says."""
    expected = set(structure.quantized_modules(q.ignore, q.quantize_embedding, tied))
    for module in sorted(expected - set(quantized)):
        result.fail(f"{module}: expected quantized tensors ({module}.{FORMAT.marker}), missing")
    for module in quantized:
        if f"{module}.weight" in names:
            result.fail(f"{module}: has both weight and {FORMAT.marker}")
        if q.is_ignored(module):
            result.fail(f"{module}: listed in ignore but quantized")
    if structure.head:
        head_tensors = [n for n in names if n.startswith(structure.head + ".")]
        if tied and head_tensors:
            result.fail(f"tie_word_embeddings is true but the checkpoint has {head_tensors[0]}")
        if not tied and not head_tensors:
            result.fail(f"tie_word_embeddings is false but there is no {structure.head} tensor")


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


def _read_module(info: StructureInfo, module: str, result: CheckResult):
    """((packed, scale, zero), group size) of one module, or None with the problem recorded."""
    scheme = info.qconfig.scheme_for(module)
    try:
        return FORMAT.read_module(info.reader, module, scheme), scheme.group_size
    except Int4qError as e:
        result.fail(str(e))
        return None


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
        read = _read_module(info, module, result)
        if read is None:
            continue
        (packed, scale, zero), group = read
        w = source.get(src_name).float()
        codes = unpack_nibbles(packed)
        if codes.shape != w.shape or scale.shape[1] * group != w.shape[1]:
            result.fail(f"{module}: shape {list(codes.shape)} / group {group} does not fit the source "
                        f"{list(w.shape)}")
            continue
        deq = dequantize_codes(codes, scale, zero, torch.float32)
        err_stats = ErrorStats()
        err_stats.add(w, deq)
        excess = _excess_over_nearest(w, deq, scale, zero, group)
        stats.append(TensorStats(module, err_stats.as_dict()["snr_db"], err_stats.max_abs_err, excess))
        if q.method == "minmax" and excess > 0:
            result.fail(f"{module}: an element is {excess:.3g} further from the source than the nearest point of "
                        "its group's grid (corrupt codes, scales or zeros)")
        uncovered = _uncovered_range(w, scale, zero, group, CLIP_SHRINKS[-1] if q.clip_search else 1.0)
        if uncovered > 0:
            result.fail(f"{module}: a group's grid misses {uncovered:.3g} of the source's range (corrupt scales or "
                        "zeros)")
    return result, stats


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
    """Per quantized linear: tinygemm pack + direct dequantization equals the row-major one
    bit for bit, and the tinygemm GEMV agrees with the dequantized reference on random inputs."""
    result = CheckResult("kernel layout")
    q, reader = info.qconfig, info.reader
    gen = torch.Generator().manual_seed(seed)
    for module in info.quantized:
        read = _read_module(info, module, result)
        if read is None:
            continue
        (packed, scale, zero), group = read
        n, half = packed.shape
        if n % 16:
            continue  # an embedding table alone never goes through the kernel
        int4pack, sz = to_int4pack(packed), scales_and_zeros(scale, zero)
        reference = dequantize_codes(unpack_nibbles(packed), scale, zero)
        if supports_direct_dequant(n) and not torch.equal(dequantize_int4pack(int4pack, sz, group), reference):
            result.fail(f"{module}: direct dequantization from the kernel layout differs from row-major")
        x = torch.randn(1, 2 * half, generator=gen).to(torch.bfloat16)
        got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4pack, group, sz).float()
        want = x.float() @ reference.float().t()
        if (got - want).abs().max().item() > 0.02 * want.abs().max().item() + 1e-3:
            result.fail(f"{module}: tinygemm GEMV disagrees with the dequantized reference")
    return result
