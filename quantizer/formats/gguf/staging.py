"""The gguf format: int4q's methods round onto GGUF's block types, the run's folder holds each
module's finished blocks, and llama.cpp's converter then writes the one .gguf file from the
source and those blocks (see assemble.py). Per quantized module ``<name>`` with a [N, K] weight:

    <name>.gguf_blocks  uint8 [N, K / 32 * bytes]  Q4_0 / Q4_1 (4-bit), Q8_0 (8-bit); see blocks.py
"""

from __future__ import annotations

import torch

from ...errors import InputError
from ...io.shards import TensorSpec
from ...methods.grid import ChannelQuantized, GroupQuantized, Storage
from ...spec.scheme import KEPT_BITS, ModuleScheme
from .blocks import BLOCK, Q4_0_STORAGE, Q4_1_STORAGE, TYPES, block_type

SUFFIX = "gguf_blocks"
GGUF_TYPES = {"q4_0": True, "q4_1": False}  # --gguf-type -> symmetric grid
FILE_TYPES = {"Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1"}  # general.file_type, from the 4-bit modules' type


class GgufFormat:
    name = quant_method = "gguf"
    title, description = "GGUF", "one .gguf file (Q4_0/Q4_1 4-bit, Q8_0 8-bit blocks of 32) for llama.cpp"
    quantizes_embedding, marker = True, SUFFIX
    default_symmetric, head_kept_by_default = False, False
    bits = (4, 8)
    read_by = "llama.cpp, Ollama, LM Studio"
    single_file, suffix = True, ".gguf"
    group_sizes = (BLOCK,)
    out_dim_multiple = 1

    def grid_storage(self, symmetric: bool) -> Storage:
        return Q4_0_STORAGE if symmetric else Q4_1_STORAGE

    def tensor_specs(self, module: str, shape: tuple[int, ...], scheme: ModuleScheme) -> list[TensorSpec]:
        n, k = shape
        kind = block_type(scheme.bits, scheme.symmetric)
        return [TensorSpec(f"{module}.{SUFFIX}", torch.uint8, (n, kind.row_bytes(k)))]

    def tensors(self, module: str, quantized: GroupQuantized | ChannelQuantized,
                scheme: ModuleScheme) -> dict[str, torch.Tensor]:
        from .blocks import encode

        return {f"{module}.{SUFFIX}": encode(quantized, block_type(scheme.bits, scheme.symmetric))}

    def quantization_config(self, qconfig, head_quantized: bool) -> dict:
        return {**qconfig.to_dict(), "quant_method": self.quant_method}

    def fit_schemes(self, schemes: dict[str, ModuleScheme], k_dims: dict[str, int]) -> dict[str, str]:
        """Keep in bf16 (in place) the modules whose K no block of 32 divides; a note for each."""
        notes = {}
        for module, scheme in schemes.items():
            if scheme.bits != KEPT_BITS and k_dims[module] % BLOCK:
                schemes[module] = ModuleScheme(KEPT_BITS)
                notes[module] = f"K={k_dims[module]} is not a multiple of GGUF's {BLOCK}-weight blocks: kept in bf16"
        return notes

    def module_problems(self, module: str, infos: dict, scheme: ModuleScheme) -> list[str]:
        name = f"{module}.{SUFFIX}"
        if scheme.bits not in self.bits:
            return [f"{module}: GGUF blocks hold 4 or 8 bits, not {scheme.bits}"]
        if name not in infos:
            return [f"{name}: missing"]
        info = infos[name]
        kind = block_type(scheme.bits, scheme.symmetric)
        if info.dtype != torch.uint8 or len(info.shape) != 2 or info.shape[1] % kind.nbytes:
            return [f"{name}: {info.dtype} {list(info.shape)} is not a row of {kind.name} blocks"]
        return []


def file_type(kinds: set[str]) -> str:
    """general.file_type for a file whose quantized tensors have these block types."""
    four = sorted(k for k in kinds if TYPES[k].bits == 4)
    return FILE_TYPES[four[0]] if four else "MOSTLY_Q8_0"


def check_gguf_type(gguf_type: str | None, symmetric: bool | None) -> bool | None:
    """The symmetric flag a --gguf-type implies, checked against --sym/--asym."""
    if gguf_type is None:
        return symmetric
    implied = GGUF_TYPES[gguf_type]
    if symmetric is not None and symmetric != implied:
        raise InputError(f"--gguf-type {gguf_type} is {'a symmetric' if implied else 'an asymmetric'} grid; "
                         f"drop --{'asym' if implied else 'sym'}")
    return implied


FORMAT = GgufFormat()
