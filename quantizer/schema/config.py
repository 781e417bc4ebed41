"""The ``quantization_config`` block of a cpu_int4 checkpoint, to and from ``config.json``: the
runtime keys, the checkpoint-wide scheme, and per-module schemes that differ from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError, UnsupportedError
from .methods import NAMES as METHODS
from .methods import UNCALIBRATED
from .scheme import KEPT_BITS, ModuleScheme

QUANT_METHOD = "cpu_int4"
FORMAT_VERSION = 1


def matches_ignore(module_name: str, patterns) -> bool:
    """True when ``module_name`` (e.g. ``model.layers.0.mlp.down_proj``) equals a pattern or ends
    with ``.<pattern>``."""
    return any(module_name == p or module_name.endswith("." + p) for p in patterns)


SOURCE_GRIDS = "source_grids"
"""The ``calibration`` key of a checkpoint quantized from an already-quantized one: the source's
layout, whose grids (its producer's, which may clip a group and need not hold the codes nearest to
the float weights) the output carries where it can."""


@dataclass(frozen=True)
class QuantizationConfig:
    """What a cpu_int4 checkpoint holds and how the runtime should run it.

    The runtime keys (``group_size``, ``ignore``, ``quantize_embedding``, ``prefill_dequant``,
    ``direct_dequant``, ``dequant_threshold``, ``use_custom_op``) are the ones the seed vLLM
    runtime reads; the rest describe the run that produced the checkpoint. ``modules`` maps a
    module name to its scheme where that differs from the checkpoint-wide one; it is written
    only when not empty, so a checkpoint without it stays readable by the seed runtime.
    """

    group_size: int
    ignore: tuple[str, ...] = ()
    quantize_embedding: bool = True
    prefill_dequant: bool = True
    direct_dequant: bool = True
    dequant_threshold: int = 2
    use_custom_op: bool = True
    method: str = UNCALIBRATED
    symmetric: bool = False
    clip_search: bool = False
    calibration: dict[str, Any] = field(default_factory=dict)
    bits: int = 4
    quant_method: str = QUANT_METHOD
    format_version: int = FORMAT_VERSION
    modules: dict[str, dict] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.quant_method != QUANT_METHOD:
            raise UnsupportedError(
                f"quant_method is {self.quant_method!r}; this runtime reads {QUANT_METHOD!r} only"
            )
        if self.bits != 4:
            raise UnsupportedError(f"bits is {self.bits}; cpu_int4 checkpoints are 4-bit")
        ModuleScheme(self.bits, self.group_size, self.symmetric)  # raises for a group size the kernel lacks
        if self.format_version > FORMAT_VERSION:
            raise UnsupportedError(
                f"format_version {self.format_version} is newer than this int4q ({FORMAT_VERSION}); upgrade int4q"
            )
        if not isinstance(self.dequant_threshold, int) or self.dequant_threshold < 1:
            raise UnsupportedError(f"dequant_threshold must be an integer >= 1, got {self.dequant_threshold!r}")
        if self.method not in METHODS:
            raise UnsupportedError(f"method {self.method!r} is not one of {', '.join(METHODS)}")
        if not isinstance(self.modules, dict):
            raise UnsupportedError("quantization_config.modules must map module names to schemes")
        for entry in self.modules.values():
            ModuleScheme.from_dict(entry, self.default_scheme)

    def is_ignored(self, module_name: str) -> bool:
        return matches_ignore(module_name, self.ignore)

    @property
    def default_scheme(self) -> ModuleScheme:
        return ModuleScheme(self.bits, self.group_size, self.symmetric)

    def scheme_for(self, module_name: str) -> ModuleScheme:
        """The module's scheme: its ``modules`` entry, kept for an ignored one, else the default."""
        if module_name in self.modules:
            return ModuleScheme.from_dict(self.modules[module_name], self.default_scheme)
        if self.is_ignored(module_name):
            return ModuleScheme(KEPT_BITS)
        return self.default_scheme

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ignore"] = list(self.ignore)
        if not self.modules:
            del d["modules"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QuantizationConfig":
        """Build from a ``quantization_config`` dict; unknown keys are an error, missing ones take defaults."""
        if not isinstance(d, dict):
            raise InputError("quantization_config is not a JSON object")
        if "group_size" not in d:
            raise UnsupportedError("quantization_config has no group_size")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise UnsupportedError(f"quantization_config has keys this int4q does not know: {', '.join(unknown)}")
        kwargs = dict(d)
        if "ignore" in kwargs:
            kwargs["ignore"] = tuple(kwargs["ignore"] or ())
        for key in ("quantize_embedding", "prefill_dequant", "direct_dequant", "use_custom_op", "symmetric", "clip_search"):
            if key in kwargs and not isinstance(kwargs[key], bool):
                raise UnsupportedError(f"quantization_config.{key} must be true or false, got {kwargs[key]!r}")
        return cls(**kwargs)
