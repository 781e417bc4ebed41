"""The structural check of a cpu_int4 checkpoint: its config, its tensors' presence, dtypes and
shapes, its shard index and its head's tying; and the check result every verify check returns.
Nothing here prints."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import Int4qError
from ..formats import cpu_int4, format_of_config
from ..io.checkpoint import INDEX_NAME, CheckpointReader, read_config
from ..io.structure import (
    architecture_mismatches,
    build_empty_model,
    check_against_checkpoint,
    inspect_structure,
    tie_word_embeddings,
)
from ..schema.config import QuantizationConfig

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
    for problem in non_finite_tensors(reader):
        result.fail(problem)
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
        check_against_checkpoint(config, {n: i.shape for n, i in reader.infos.items()})
        structure = inspect_structure(config)
    except Int4qError as e:
        result.fail(f"cannot build the architecture to check tensor names: {e}")
        return result, info
    tied = tie_word_embeddings(config)
    _check_expected_modules(structure, q, tied, info.quantized, set(reader.infos), result)
    shapes = {n: i.shape for n, i in reader.infos.items() if n.rpartition(".")[0] not in set(info.quantized)}
    for module in info.quantized:
        n, cols = reader.infos[f"{module}{marker}"].shape
        shapes[f"{module}.weight"] = structure.linear_shape(module, (n, cols if q.scheme_for(module).bits == 8
                                                                        else 2 * cols))
        if f"{module}.bias" in reader.infos:
            shapes[f"{module}.bias"] = reader.infos[f"{module}.bias"].shape
    for problem in architecture_mismatches(build_empty_model(config), shapes, structure.head if tied else None):
        result.fail(problem)
    return result, info


def non_finite_tensors(reader: CheckpointReader) -> list[str]:
    """A line for each floating tensor (scales, zeros, kept weights, norms) that holds NaN or
    infinite values, which the runtime would turn into NaN logits."""
    import torch

    problems = []
    for name, info in reader.infos.items():
        if not (isinstance(info.dtype, torch.dtype) and info.dtype.is_floating_point):
            continue
        values = reader.get(name).reshape(-1)
        bad = sum(int((~torch.isfinite(part)).sum()) for part in values.split(1 << 24))  # bounded transients
        if bad:
            problems.append(f"{name}: holds {bad} NaN or infinite values")
    return problems


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
            what = f"a {method!r} checkpoint" if method else "a checkpoint whose quantization_config names no quant_method"
            result.fail(f"this is {what}{export}; int4q verify checks {FORMAT.name} checkpoints")
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
