"""The .gguf file of a finished run: its blocks folder and its source, through assemble.py."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ...io.checkpoint import CheckpointReader, read_config
from .assemble import INT4Q_CONFIG_KEY, QuantizedWeight, write_gguf
from .converter import has_key
from .staging import FORMAT


def quantized_weights(plan, blocks: CheckpointReader) -> dict[str, QuantizedWeight]:
    """Source tensor name -> int4q's blocks, for every quantized module of ``plan`` (an untied head
    made from a tied table under the head's own name)."""
    weights = {}
    for module in plan.targets:
        scheme = plan.scheme_of(module)
        if scheme.kept:
            continue
        name = f"{module}.{FORMAT.marker}"
        shape = plan.weight_shape(module)
        weights[f"{module}.weight"] = QuantizedWeight(shape, plan.format.block_type(scheme, shape[1]),
                                                      lambda name=name: blocks.get(name),
                                                      module in plan.structure.transposed)
    return weights


def write_from_blocks(plan, blocks: CheckpointReader, out_file: Path,
                      written: Callable[[int, int], None] | None = None) -> list[str]:
    """Write ``out_file`` for ``plan`` from its finished blocks folder; the names of the GGUF
    tensors holding int4q's blocks. ``written(done, total)``: bytes of tensors written so far."""
    weights = quantized_weights(plan, blocks)
    qconfig = read_config(blocks.dir)["quantization_config"]
    file_type = plan.format.file_type(plan.options.symmetric)
    return write_gguf(plan.model_dir, plan.source_config, weights, out_file, file_type, qconfig, written)


def is_int4q_gguf(path: Path) -> bool:
    """True for a GGUF file whose metadata int4q wrote."""
    return has_key(path, INT4Q_CONFIG_KEY)
