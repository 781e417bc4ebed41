"""Checkpoints other tools already quantized, read as the float model they stand for (GPTQ, AWQ,
compressed-tensors, and int4q's own cpu_int4), with each quantized module's grid, so a run can
carry the producer's codes and scales into its output where the output can hold them."""

from __future__ import annotations

from pathlib import Path

from .schemes import SourceScheme, source_scheme
from .view import QuantizedCheckpoint, float_config

__all__ = ["QuantizedCheckpoint", "SourceScheme", "float_config", "open_quantized", "source_scheme"]


def open_quantized(model_dir: Path, config: dict) -> QuantizedCheckpoint | None:
    """The float view of a quantized checkpoint; None for a float one; UnsupportedError in one
    line for a quantization int4q does not read."""
    scheme = source_scheme(config)
    return None if scheme is None else QuantizedCheckpoint(Path(model_dir), config, scheme)
