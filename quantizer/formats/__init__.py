"""Checkpoint formats: how a quantized module becomes tensors and a ``quantization_config``.

A format is one module in this package exposing a ``FORMAT`` object with the
:class:`CheckpointFormat` interface, registered by name in ``MODULES``; the pipelines, verify,
the runtime, the CLI and the model card reach formats only through here. Importing this package
does not import torch, so the CLI can list the names cheaply.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..errors import UnsupportedError

if TYPE_CHECKING:
    import torch

    from ..io.shards import TensorSpec
    from ..methods.grid import ChannelQuantized, GroupQuantized, Storage
    from ..schema.scheme import ModuleScheme

@dataclass(frozen=True)
class SourceModel:
    """What a format may consult about the source while fitting schemes: its folder, config.json,
    and each quantized layer module's source weight shape."""

    model_dir: Path
    config: dict
    shapes: dict[str, tuple[int, ...]]


# --format name -> module in this package
MODULES = {"cpu_int4": "cpu_int4", "gptq": "gptq_v1", "awq": "awq", "gguf": "gguf"}
NAMES = tuple(MODULES)
RUNTIME_FORMAT = "cpu_int4"  # the one int4q's runtime runs, verify checks and the card shows how to run


class CheckpointFormat(Protocol):
    name: str  # the --format value
    quant_method: str  # quantization_config.quant_method
    quantizes_embedding: bool  # whether the vocabulary table can be stored quantized
    title: str  # its short name in prose
    description: str  # one line for the model card
    read_by: str  # the runtimes that load it
    marker: str  # the suffix of the tensor that marks a module as quantized
    bits: tuple[int, ...]  # the module precisions it can store (16, kept, is always possible)
    default_symmetric: bool  # the grid a run gets without --sym/--asym
    head_kept_by_default: bool  # whether the head stays bf16 without --head-bits (its loaders' reach)
    single_file: bool  # the output is one file (named ``suffix``), not a folder
    group_sizes: tuple[int, ...]  # the 4-bit group sizes it can hold
    out_dim_multiple: int  # what every quantized module's output dim must be a multiple of
    one_group_size: bool  # its config holds one group size for every 4-bit module
    head_bits: int | None  # the head's precision its type implies (GGUF's K_M mixtures), else None

    def grid_storage(self, scheme: ModuleScheme, k: int) -> Storage:
        """How it stores the grids (or 8-bit scales) of a module with this scheme and input dim k,
        which the methods round against."""

    def tensor_specs(self, module: str, shape: tuple[int, ...], scheme: ModuleScheme) -> list[TensorSpec]:
        """The tensors (names, dtypes, shapes) that ``tensors`` returns for a [N, K] weight."""

    def tensors(self, module: str, quantized: GroupQuantized | ChannelQuantized,
                scheme: ModuleScheme) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of one weight quantized on ``scheme``, by full name."""

    def fit_schemes(self, schemes: dict[str, ModuleScheme], k_dims: dict[str, int],
                    source: SourceModel | None = None, calibrated: bool = False) -> dict[str, str]:
        """Change in place the schemes its type decides (GGUF's file types, which may depend on
        whether the run is ``calibrated``) and the ones it cannot store for a module's input dim;
        a note for each of the latter."""

    def quantization_config(self, qconfig, head_quantized: bool) -> dict:
        """The ``quantization_config`` written to config.json for a run with this QuantizationConfig
        (``head_quantized``: whether the output head is stored quantized)."""

    def module_problems(self, module: str, infos: dict, scheme: ModuleScheme) -> list[str]:
        """What is wrong with one module's tensors (name -> TensorInfo): missing, dtype, shape."""


def get_format(name: str, variant: str | None = None) -> CheckpointFormat:
    """The format named ``name``; ``variant`` one of its own (the gguf format's block types)."""
    if name not in MODULES:
        raise UnsupportedError(f"format {name!r} is not one of {', '.join(NAMES)}")
    module = importlib.import_module(f"{__name__}.{MODULES[name]}")
    return module.FORMAT if variant is None else module.variant(variant)


def format_of_config(quantization_config: dict) -> CheckpointFormat | None:
    """The format a config.json's ``quantization_config`` describes; None for an unknown method."""
    method = quantization_config.get("quant_method") if isinstance(quantization_config, dict) else None
    return next((f for f in map(get_format, NAMES) if f.quant_method == method), None)
