"""What a quantized checkpoint's ``quantization_config`` says, checked before any tensor is read:
the producers' 4-bit weight-only layouts int4q reads, and one line for anything else."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UnsupportedError

SUPPORTED = ("GPTQ (v1 and v2 packing, 4-bit)", "AWQ (GEMM packing, 4-bit)",
             "compressed-tensors pack-quantized W4A16", "int4q's cpu_int4")
ZERO_POINT_FORMATS = {"gptq": 1, "gptq_v2": 0}  # GPTQ's checkpoint_format -> what its qzeros add


@dataclass(frozen=True)
class SourceScheme:
    """A quantized source's layout: ``method`` (gptq, awq, compressed-tensors or cpu_int4), its
    ``marker`` (the tensor suffix of a quantized module), ``group_size`` (None: one group per row),
    ``symmetric``, and ``zero_offset`` (what a GPTQ v1 checkpoint's stored zero points lack)."""

    method: str
    marker: str
    group_size: int | None
    symmetric: bool
    zero_offset: int = 0
    desc: str = ""

    @property
    def title(self) -> str:
        grid = "symmetric" if self.symmetric else "asymmetric"
        group = f"group {self.group_size}" if self.group_size else "per channel"
        return f"{self.desc or self.method} 4-bit, {grid}, {group}"


def _unsupported(found: str) -> UnsupportedError:
    return UnsupportedError(f"this checkpoint is {found}; int4q reads {', '.join(SUPPORTED)}; start from one of "
                            "those or from the bf16/fp16/fp32 original")


def _bits(value, what: str) -> None:
    if value != 4:
        raise _unsupported(f"{value}-bit {what}")


def _group(value) -> int | None:
    if value in (-1, None, 0):
        return None
    if not isinstance(value, int) or value < 0:
        raise _unsupported(f"quantized with group_size {value!r}")
    return value


def _gptq(config: dict) -> SourceScheme:
    _bits(config.get("bits"), "GPTQ")
    fmt = config.get("checkpoint_format") or config.get("format") or "gptq"
    if fmt not in ZERO_POINT_FORMATS:
        raise _unsupported(f"GPTQ in the {fmt!r} packing (repacked for one kernel)")
    dynamic = config.get("dynamic") or {}
    if any(isinstance(v, dict) and v.get("bits", 4) != 4 for v in dynamic.values()):
        raise _unsupported("GPTQ with per-module bit widths other than 4 (dynamic)")
    return SourceScheme("gptq", "qweight", _group(config.get("group_size")), bool(config.get("sym", True)),
                        ZERO_POINT_FORMATS[fmt], desc=f"GPTQ ({fmt})")


def _awq(config: dict) -> SourceScheme:
    _bits(config.get("bits", config.get("w_bit")), "AWQ")
    version = str(config.get("version") or config.get("format") or "gemm").lower()
    if version != "gemm":
        raise _unsupported(f"AWQ in the {version!r} packing")
    if config.get("zero_point") is False:
        raise _unsupported("AWQ without zero points")
    return SourceScheme("awq", "qweight", _group(config.get("group_size", config.get("q_group_size"))), False,
                        desc="AWQ (GEMM)")


def _compressed(config: dict) -> SourceScheme:
    fmt = config.get("format")
    groups = config.get("config_groups") or {}
    if fmt != "pack-quantized" or len(groups) != 1:
        found = f"the {fmt!r} format" if fmt != "pack-quantized" else f"{len(groups)} config groups"
        raise _unsupported(f"compressed-tensors with {found}")
    group = next(iter(groups.values())) or {}
    weights = group.get("weights") or {}
    if group.get("input_activations"):
        raise _unsupported("compressed-tensors with quantized activations")
    _bits(weights.get("num_bits"), "compressed-tensors")
    strategy = weights.get("strategy")
    if weights.get("type", "int") != "int" or strategy not in ("group", "channel"):
        raise _unsupported(f"compressed-tensors {weights.get('type')} weights by {strategy}")
    if weights.get("actorder") not in (None, "static", False):
        raise _unsupported(f"compressed-tensors with actorder {weights.get('actorder')!r}")
    size = _group(weights.get("group_size")) if strategy == "group" else None
    return SourceScheme("compressed-tensors", "weight_packed", size, bool(weights.get("symmetric", True)),
                        desc="compressed-tensors")


def _cpu_int4(config: dict) -> SourceScheme:
    from ...schema.config import QuantizationConfig

    q = QuantizationConfig.from_dict(config)
    return SourceScheme("cpu_int4", "weight_packed", q.group_size, q.symmetric, desc="int4q cpu_int4")


READERS = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed, "cpu_int4": _cpu_int4}


def source_scheme(config: dict) -> SourceScheme | None:
    """The layout of a checkpoint whose config.json is ``config``: None for a float checkpoint;
    UnsupportedError in one line for a quantization int4q does not read."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise _unsupported("quantized (its quantization_config is not an object)")
    method = q.get("quant_method")
    if method not in READERS:
        raise _unsupported(f"quantized by {method!r}" if method else "quantized (no quant_method)")
    return READERS[method](q)
