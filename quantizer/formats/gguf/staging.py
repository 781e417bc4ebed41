"""The gguf format: int4q's methods round onto GGUF's block types, the run's folder holds each
module's finished blocks, and llama.cpp's converter then writes the one .gguf file from the
source and those blocks (see assemble.py). Per quantized module ``<name>`` with a [N, K] weight:

    <name>.gguf_blocks  uint8 [N, row bytes]  Q4_0 / Q4_1 / Q4_K / IQ4_NL / IQ4_XS (4-bit), Q5_0 / Q5_1 /
                                              Q5_K (5-bit), Q6_K (6-bit), Q8_0 (8-bit); see blocks.py,
                                              kquants.py and iquants.py
"""

from __future__ import annotations

import dataclasses

import torch

from ...errors import InputError
from ...io.shards import TensorSpec
from ...methods.grid import ChannelQuantized, GroupQuantized, Storage
from ...schema.scheme import ModuleScheme
from .blocks import BLOCK, TYPES, BlockType, block_type
from .types import (
    ALL_TYPES,
    DEFAULT,
    GGUF_TYPES,
    GgufType,
    fallback,
    guarded_downs,
    iq4_mixture_bits,
    mixture_bits,
)

SUFFIX = "gguf_blocks"


class GgufFormat:
    """The gguf format for one ``--gguf-type`` (None: Q4_0 or Q4_1, by the run's grid)."""

    name = quant_method = "gguf"
    title, description = "GGUF", "one .gguf file (Q4_0 to Q6_K, Q8_0 8-bit) for llama.cpp"
    quantizes_embedding, marker = True, SUFFIX
    default_symmetric, head_kept_by_default = False, False
    bits = (4, 5, 6, 8)
    read_by = "llama.cpp, Ollama, LM Studio"
    single_file, suffix = True, ".gguf"
    group_sizes = (BLOCK,)
    out_dim_multiple = 1
    one_group_size = False

    def __init__(self, gguf_type: GgufType | None = None):
        self.gguf_type = gguf_type

    @property
    def head_bits(self) -> int | None:
        """The precision a K_M or IQ4 mixture gives the head (and a table tied to it), as llama-quantize."""
        return self.gguf_type.head_bits if self.gguf_type else None

    def type_for(self, symmetric: bool) -> GgufType:
        return self.gguf_type or DEFAULT[symmetric]

    def block_type(self, scheme: ModuleScheme, k: int) -> BlockType:
        """The block type a module with this scheme and input dim k is stored in."""
        t = self.type_for(scheme.symmetric)
        return block_type(scheme.bits, scheme.symmetric, k, t.kquants, t.iq4)

    def fallback(self, scheme: ModuleScheme, k: int) -> tuple[ModuleScheme, str | None]:
        """The scheme a module of input dim k is stored with in this type, and a note where it is
        not ``scheme`` (see :func:`.types.fallback`)."""
        return fallback(scheme, k, self.type_for(scheme.symmetric))

    def grid_storage(self, scheme: ModuleScheme, k: int) -> Storage:
        return self.block_type(scheme, k).storage

    def file_type(self, symmetric: bool) -> str:
        """general.file_type (a LlamaFileType member name) of a run with this grid."""
        return self.type_for(symmetric).file_type

    def tensor_specs(self, module: str, shape: tuple[int, ...], scheme: ModuleScheme) -> list[TensorSpec]:
        n, k = shape
        return [TensorSpec(f"{module}.{SUFFIX}", torch.uint8, (n, self.block_type(scheme, k).row_bytes(k)))]

    def tensors(self, module: str, quantized: GroupQuantized | ChannelQuantized,
                scheme: ModuleScheme) -> dict[str, torch.Tensor]:
        from .blocks import encode

        kind = self.block_type(scheme, quantized.codes.shape[1])
        return {f"{module}.{SUFFIX}": encode(quantized, kind)}

    def quantization_config(self, qconfig, head_quantized: bool) -> dict:
        own = {"gguf_type": self.gguf_type.name} if self.gguf_type else {}
        return {**qconfig.to_dict(), "quant_method": self.quant_method, **own}

    def fit_schemes(self, schemes: dict[str, ModuleScheme], k_dims: dict[str, int], source=None,
                    calibrated: bool = False) -> dict[str, str]:
        """In place: the modules a recipe left at 4 bits take the type's precision (a K_M mixture's
        extra bits by the GGUF names of ``source``'s weights); in a ``calibrated`` run's Q4_0 or
        Q5_0 file the first eighth of ffn_down take the asymmetric type, as llama-quantize gives
        them with an importance matrix; then each module the type's fallback for its input dim,
        with a note for each fallback."""
        t = self.gguf_type
        wanted = source is not None and (calibrated or bool(t and (t.more_bits or t.iq4)))
        names, arch = _names(source) if wanted else ({}, "")
        if t is not None:
            more = mixture_bits(t, names, arch) if t.more_bits else {}
            more.update(iq4_mixture_bits(t, names, _query_groups(source), calibrated) if wanted else {})
            for module, scheme in schemes.items():
                bits = more.get(module, t.bits)
                if scheme.bits == 4 and bits != 4:
                    schemes[module] = t.scheme(bits)
        if calibrated:
            symmetric_type = self.type_for(True)
            for module in guarded_downs(symmetric_type, names) & schemes.keys():
                scheme = schemes[module]
                if scheme.symmetric and scheme.bits == symmetric_type.bits:
                    schemes[module] = dataclasses.replace(scheme, symmetric=False)
        notes = {}
        for module, scheme in schemes.items():
            schemes[module], note = self.fallback(scheme, k_dims[module])
            if note:
                notes[module] = note
        return notes

    def module_problems(self, module: str, infos: dict, scheme: ModuleScheme) -> list[str]:
        name = f"{module}.{SUFFIX}"
        if scheme.bits not in self.bits:
            return [f"{module}: GGUF blocks hold {'/'.join(map(str, self.bits))} bits, not {scheme.bits}"]
        if name not in infos:
            return [f"{name}: missing"]
        info = infos[name]
        kinds = {t for t in TYPES.values() if t.bits == scheme.bits and (t.bits == 8 or t.symmetric == scheme.symmetric)}
        if info.dtype != torch.uint8 or len(info.shape) != 2 or all(info.shape[1] % t.nbytes for t in kinds):
            return [f"{name}: {info.dtype} {list(info.shape)} is not a row of {'/'.join(t.name for t in kinds)} blocks"]
        return []


def _names(source) -> tuple[dict[str, list[str]], str]:
    """(module -> the GGUF names of its weight, the GGUF architecture) of a planned source."""
    from .names import gguf_names

    found = gguf_names(source.model_dir, source.config, source.shapes)
    return found.names, found.arch


def _query_groups(source) -> int:
    """Query heads per key/value head of a planned source's model (1 where its config has no heads)."""
    text = source.config.get("text_config") or source.config
    heads = text.get("num_attention_heads") or 1
    return heads // (text.get("num_key_value_heads") or heads)


def check_gguf_type(gguf_type: str | None, symmetric: bool | None) -> bool | None:
    """The symmetric flag a --gguf-type implies, checked against --sym/--asym."""
    if gguf_type is None:
        return symmetric
    implied = ALL_TYPES[gguf_type].symmetric
    if symmetric is not None and symmetric != implied:
        raise InputError(f"--gguf-type {gguf_type} is {'a symmetric' if implied else 'an asymmetric'} grid; "
                         f"drop --{'asym' if implied else 'sym'}")
    return implied


FORMAT = GgufFormat()


def variant(gguf_type: str) -> GgufFormat:
    """The format for a --gguf-type."""
    if gguf_type not in ALL_TYPES:
        raise InputError(f"--gguf-type {gguf_type} is not one of {', '.join(GGUF_TYPES)}")
    return GgufFormat(ALL_TYPES[gguf_type])
