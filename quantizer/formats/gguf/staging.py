"""The gguf format: int4q's methods round onto GGUF's block types, the run's folder holds each
module's finished blocks, and llama.cpp's converter then writes the one .gguf file from the
source and those blocks (see assemble.py). Per quantized module ``<name>`` with a [N, K] weight:

    <name>.gguf_blocks  uint8 [N, row bytes]  Q4_0 / Q4_1 / Q4_K (4-bit), Q8_0 (8-bit); see blocks.py
"""

from __future__ import annotations

import torch

from ...errors import InputError
from ...io.shards import TensorSpec
from ...methods.grid import ChannelQuantized, GroupQuantized, Storage
from ...spec.scheme import KEPT_BITS, ModuleScheme
from .blocks import BLOCK, Q4_0_STORAGE, Q4_1_STORAGE, Q4_K, Q4_K_STORAGE, BlockType, block_type

SUFFIX = "gguf_blocks"
GGUF_TYPES = {"q4_0": True, "q4_1": False, "q4_k": False}  # --gguf-type -> symmetric grid
KQUANT_TYPES = ("q4_k",)
FILE_TYPES = {"Q4_K": "MOSTLY_Q4_K_S", "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1"}  # general.file_type, by
# the first of these types among the 4-bit modules'


class GgufFormat:
    """The gguf format; with ``kquants`` its asymmetric 4-bit modules are Q4_K where their rows are
    whole super-blocks (Q4_1 elsewhere)."""

    name = quant_method = "gguf"
    title, description = "GGUF", "one .gguf file (Q4_0/Q4_1/Q4_K 4-bit, Q8_0 8-bit) for llama.cpp"
    quantizes_embedding, marker = True, SUFFIX
    default_symmetric, head_kept_by_default = False, False
    bits = (4, 8)
    read_by = "llama.cpp, Ollama, LM Studio"
    single_file, suffix = True, ".gguf"
    group_sizes = (BLOCK,)
    out_dim_multiple = 1
    one_group_size = False

    def __init__(self, kquants: bool = False):
        self.kquants = kquants

    def grid_storage(self, symmetric: bool) -> Storage:
        if symmetric:
            return Q4_0_STORAGE
        return Q4_K_STORAGE if self.kquants else Q4_1_STORAGE

    def block_type(self, scheme: ModuleScheme, k: int) -> BlockType:
        """The block type a module with this scheme and input dim k is stored in."""
        return block_type(scheme.bits, scheme.symmetric, k, self.kquants)

    def tensor_specs(self, module: str, shape: tuple[int, ...], scheme: ModuleScheme) -> list[TensorSpec]:
        n, k = shape
        return [TensorSpec(f"{module}.{SUFFIX}", torch.uint8, (n, self.block_type(scheme, k).row_bytes(k)))]

    def tensors(self, module: str, quantized: GroupQuantized | ChannelQuantized,
                scheme: ModuleScheme) -> dict[str, torch.Tensor]:
        from .blocks import encode

        kind = self.block_type(scheme, quantized.codes.shape[1])
        return {f"{module}.{SUFFIX}": encode(quantized, kind)}

    def quantization_config(self, qconfig, head_quantized: bool) -> dict:
        kquants = {"gguf_type": KQUANT_TYPES[0]} if self.kquants else {}
        return {**qconfig.to_dict(), "quant_method": self.quant_method, **kquants}

    def fit_schemes(self, schemes: dict[str, ModuleScheme], k_dims: dict[str, int]) -> dict[str, str]:
        """Keep in bf16 (in place) the modules whose K no block of 32 divides; a note for each, and
        for each K-quant module whose K no super-block divides (stored as Q4_1)."""
        notes = {}
        for module, scheme in schemes.items():
            k = k_dims[module]
            if scheme.bits != KEPT_BITS and k % BLOCK:
                schemes[module] = ModuleScheme(KEPT_BITS)
                notes[module] = f"K={k} is not a multiple of GGUF's {BLOCK}-weight blocks: kept in bf16"
            elif self.kquants and scheme.bits == 4 and not scheme.symmetric and not Q4_K.holds(k):
                notes[module] = f"K={k} is not a multiple of Q4_K's {Q4_K.weights}-weight super-blocks: Q4_1"
        return notes

    def module_problems(self, module: str, infos: dict, scheme: ModuleScheme) -> list[str]:
        name = f"{module}.{SUFFIX}"
        if scheme.bits not in self.bits:
            return [f"{module}: GGUF blocks hold 4 or 8 bits, not {scheme.bits}"]
        if name not in infos:
            return [f"{name}: missing"]
        info = infos[name]
        kinds = {block_type(scheme.bits, scheme.symmetric, k, self.kquants) for k in (BLOCK, Q4_K.weights)}
        if info.dtype != torch.uint8 or len(info.shape) != 2 or all(info.shape[1] % t.nbytes for t in kinds):
            return [f"{name}: {info.dtype} {list(info.shape)} is not a row of {'/'.join(t.name for t in kinds)} blocks"]
        return []


def file_type(kinds: set[str]) -> str:
    """general.file_type for a file whose quantized tensors have these block types."""
    return next((FILE_TYPES[k] for k in FILE_TYPES if k in kinds), "MOSTLY_Q8_0")


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


def variant(gguf_type: str) -> GgufFormat:
    """The format for a --gguf-type."""
    if gguf_type not in GGUF_TYPES:
        raise InputError(f"--gguf-type {gguf_type} is not one of {', '.join(GGUF_TYPES)}")
    return GgufFormat(kquants=gguf_type in KQUANT_TYPES)
