"""verify for a .gguf file int4q wrote: its structure and metadata against what llama.cpp's
converter writes for the source, each quantized tensor against the source (round trip), and the
dequantized model's fidelity (through transformers' GGUF loader). Nothing here prints."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..methods.error_stats import ErrorStats
from ..schema.config import SOURCE_GRIDS
from ..schema.methods import get_method
from .structure import CheckResult
from .tensors import TensorStats

QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
OWN_KEYS = ("general.file_type", "general.quantized_by", "int4q.quantization_config")


def read_gguf(path: Path):
    """(the gguf package's reader, int4q's quantization_config); Int4qError for a file that is
    not a GGUF int4q wrote."""
    from ..errors import InputError
    from ..formats.gguf.assemble import INT4Q_CONFIG_KEY
    from ..formats.gguf.converter import load

    gguf = load()[1]
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as e:
        raise InputError(f"{path} is not a readable GGUF file ({e})") from None
    field = reader.fields.get(INT4Q_CONFIG_KEY)
    if field is None:
        raise InputError(f"{path} has no {INT4Q_CONFIG_KEY}: it is not a GGUF int4q wrote")
    try:
        config = json.loads(field.contents())
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise InputError(f"{path}: its {INT4Q_CONFIG_KEY} is not the JSON int4q writes ({e}); the file was "
                         "changed after int4q wrote it: quantize again") from None
    if not isinstance(config, dict):
        raise InputError(f"{path}: its {INT4Q_CONFIG_KEY} is not a JSON object; the file was changed after int4q "
                         "wrote it: quantize again")
    return reader, config


def _same_value(got, want) -> bool:
    if isinstance(want, float):
        return np.float32(got) == np.float32(want)
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(_same_value(g, w) for g, w in zip(got, want))
    return got == (int(want) if hasattr(want, "value") else want)


def check_structure(reader, expected: dict, expected_kv: dict, source_tied: bool) -> CheckResult:
    """Every tensor the converter writes, with its shape; kept ones with its type, quantized ones
    with a GGUF block type; every metadata key with the converter's value (int4q's own aside)."""
    result = CheckResult("structure")
    got = {t.name: t for t in reader.tensors}
    for name, want in expected.items():
        t = got.get(name)
        if t is None:
            result.fail(f"{name}: missing")
            continue
        shape = tuple(reversed([int(n) for n in t.shape]))
        if shape != want.shape:
            result.fail(f"{name}: shape {list(shape)}, the converter writes {list(want.shape)}")
        if t.tensor_type.name != want.type_name and t.tensor_type.name not in QUANTIZED_TYPES:
            result.fail(f"{name}: type {t.tensor_type.name}, the converter writes {want.type_name}")
    own_keys = set(OWN_KEYS)
    for name in sorted(set(got) - set(expected)):
        if source_tied and name == "output.weight" and got[name].tensor_type.name in QUANTIZED_TYPES:
            own_keys.add("general.size_label")  # an untied head adds its parameters
        else:
            result.fail(f"{name}: not a tensor the converter writes")
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    for key, want in expected_kv.items():
        if key in own_keys:
            continue
        if key not in fields:
            result.fail(f"metadata {key}: missing")
        elif not _same_value(fields[key].contents(), want):
            result.fail(f"metadata {key}: differs from the converter's")
    for key in sorted(set(fields) - set(expected_kv) - own_keys):
        result.fail(f"metadata {key}: not a key the converter writes")
    return result


def _nearest_excess(stored, source: torch.Tensor, kind) -> float:
    """Largest |error| beyond the block grid's nearest point, over a tensor."""
    from ..methods.codebook import codebook_values, round_to_levels
    from ..methods.codes import code_range

    n, k = source.shape
    w = source.reshape(n, -1, stored.group)
    d = stored.d.unsqueeze(-1)
    safe = torch.where(d == 0, 1.0, d)
    if stored.levels:
        best = codebook_values(round_to_levels(w, stored.d, stored.levels), stored.d, stored.levels)
    elif kind.bits == 8:
        best = torch.round(w / safe).clamp(-127, 127) * d
    else:
        top = code_range(kind.bits)[1]
        offset = stored.m.unsqueeze(-1) if stored.m is not None else -stored.mid * d
        best = torch.round((w - offset) / safe).clamp(0, top) * d + offset
    have = stored.values().reshape(n, -1, stored.group)
    return ((w - have).abs() - (w - best).abs()).max().item()


def check_round_trip(reader, expected: dict, qconfig: dict, source_embedding) -> tuple[CheckResult, list[TensorStats]]:
    """Kept tensors bit-equal to the converter's; each quantized one against the converted source
    (round-to-nearest methods: every element on its block grid's nearest point, unless the grids
    were carried from a quantized source, whose producer chose its codes)."""
    from ..formats.gguf.blocks import TYPES, decode

    result, stats = CheckResult("round trip"), []
    carried = bool((qconfig.get("calibration") or {}).get(SOURCE_GRIDS))
    nearest = get_method(qconfig.get("method", "minmax")).nearest_codes and not carried
    for t in reader.tensors:
        want = expected.get(t.name) or (source_embedding if t.name == "output.weight" else None)
        if want is None:
            continue
        source = torch.from_numpy(np.ascontiguousarray(want.values())).float()
        kind = TYPES.get(t.tensor_type.name)
        if kind is None:
            if t.tensor_type.name == want.type_name and not np.array_equal(_values(t), want.values()):
                result.fail(f"{t.name}: differs from the converter's {want.type_name} tensor")
            continue
        data = np.array(t.data)  # a writable copy of the mapped bytes
        stored = decode(torch.from_numpy(data).reshape(-1, data.shape[-1]), kind)
        flat = source.reshape(-1, source.shape[-1])
        err = ErrorStats()
        err.add(flat, stored.values())
        excess = max(0.0, _nearest_excess(stored, flat, kind))
        if nearest and excess > 1e-5 * max(1.0, flat.abs().max().item()):
            result.fail(f"{t.name}: an element is {excess:.3g} further than its block grid's nearest point")
        stats.append(TensorStats(t.name, err.snr_db, err.max_abs_err, excess))
    return result, stats


def _values(t) -> np.ndarray:
    """A tensor of the file as fp32 values, as GGML computes them."""
    from ..formats.gguf.converter import load

    return load()[1].quants.dequantize(t.data, t.tensor_type)


def load_dequantized(path: Path):
    """The file's model through transformers' GGUF loader, dequantized to fp32 (its grids'
    values are fp16 products that bf16 does not hold)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def is_gguf_path(path: Path) -> bool:
    return Path(path).suffix.lower() == ".gguf" and Path(path).is_file()

