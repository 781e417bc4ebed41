"""GGUF's IQ4 types as int4q's non-linear grids (``methods.codebook``), both ways. Pure tensor code.

    IQ4_NL  18 bytes per 32 weights: fp16 d, 16 bytes of nibbles           w = d * levels[q]
    IQ4_XS  136 bytes per 256: fp16 d, a 16-bit word of high scale bits, 4 bytes of low scale
            nibbles, 128 bytes of nibbles                                    w = d * (ls - 32) * levels[q]

Nibbles as Q4_0's: byte j of a group holds element j (low half) and j + 16 (high half). IQ4_XS's
6-bit level ls of group i: low four bits in byte i / 2 of the low nibbles (low half for even i),
top two bits at bit 2i of the word. int4q's grid per group: ``scale = d`` (IQ4_NL) or
``d * (ls - 32)`` (IQ4_XS), zero 0.
"""

from __future__ import annotations

import torch

from ...methods.codebook import IQ4_LEVELS, XS_SCALE_LEVELS
from ...methods.grid import GroupQuantized
from ...methods.superblock import fp16_units
from .kquants import fp16_bytes, nibbles, stored_fp16, unpack_nibbles
from .types import BLOCK, SUPER

GROUPS = SUPER // BLOCK  # IQ4_XS groups per super-block


def _check(gq: GroupQuantized, name: str, row_multiple: int) -> tuple[int, int]:
    n, k = gq.codes.shape
    if gq.group_size != BLOCK or k % row_multiple:
        raise ValueError(f"{name} holds rows of whole {row_multiple}-weight blocks of {BLOCK}-weight groups")
    if gq.levels != IQ4_LEVELS or bool((gq.zero != 0).any()):
        raise ValueError(f"{name} holds IQ4 level grids (zero 0) only; quantize on its storage")
    return n, k


def encode_iq4_nl(gq: GroupQuantized) -> torch.Tensor:
    """A group-32 weight on IQ4 levels with fp16 scales -> uint8 [N, K / 32 * 18]."""
    n, k = _check(gq, "IQ4_NL", BLOCK)
    scale = stored_fp16(gq.scale.to(torch.float32), "IQ4_NL scales")
    codes = gq.codes.to(torch.uint8).reshape(n, k // BLOCK, BLOCK)
    return torch.cat([fp16_bytes(scale.unsqueeze(-1)), nibbles(codes)], dim=-1).reshape(n, -1)


def encode_iq4_xs(gq: GroupQuantized) -> torch.Tensor:
    """A group-32 weight on IQ4 levels whose scales are levels -32..31 of an fp16 unit per 256
    weights -> uint8 [N, K / 256 * 136]."""
    n, k = _check(gq, "IQ4_XS", SUPER)
    unit, found_levels, found = fp16_units(gq.scale.to(torch.float64).reshape(n, k // SUPER, GROUPS), XS_SCALE_LEVELS)
    if not bool(found.all()):
        raise ValueError("the IQ4_XS scales are not levels of an fp16 unit per super-block; quantize on its storage")
    ls = (found_levels - XS_SCALE_LEVELS[0]).to(torch.int32)  # 0..63
    low = (ls[..., 0::2] & 0xF) | ((ls[..., 1::2] & 0xF) << 4)
    high = (((ls >> 4) & 3) << (2 * torch.arange(GROUPS, dtype=torch.int32))).sum(-1, keepdim=True)
    word = torch.cat([high & 0xFF, high >> 8], dim=-1)
    codes = gq.codes.to(torch.uint8).reshape(n, k // SUPER, GROUPS, BLOCK)
    parts = [fp16_bytes(unit), word.to(torch.uint8), low.to(torch.uint8), nibbles(codes).reshape(n, k // SUPER, -1)]
    return torch.cat(parts, dim=-1).reshape(n, -1)


def decode_iq4_nl(data: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """IQ4_NL bytes -> (codes [N, K] uint8 0..15, d [N, K / 32] fp32)."""
    n = data.shape[0]
    blocks = data.reshape(n, -1, 18)
    d = blocks[..., :2].contiguous().view(torch.float16).squeeze(-1).to(torch.float32)
    return unpack_nibbles(blocks[..., 2:]).reshape(n, -1), d


def decode_iq4_xs(data: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """IQ4_XS bytes -> (codes [N, K] uint8 0..15, each group's scale d * (ls - 32) [N, K / 32]
    fp32, as GGML computes it)."""
    n = data.shape[0]
    blocks = data.reshape(n, -1, 136)
    d = blocks[..., :2].contiguous().view(torch.float16).to(torch.float32)
    word = blocks[..., 2].to(torch.int32) | (blocks[..., 3].to(torch.int32) << 8)
    low = blocks[..., 4:8].to(torch.int32)
    low = torch.stack([low & 0xF, low >> 4], dim=-1).reshape(n, -1, GROUPS)
    high = (word.unsqueeze(-1) >> (2 * torch.arange(GROUPS, dtype=torch.int32))) & 3
    ls = (low | (high << 4)) + XS_SCALE_LEVELS[0]
    codes = unpack_nibbles(blocks[..., 8:].reshape(n, -1, GROUPS, 16))
    return codes.reshape(n, -1), (d * ls.to(torch.float32)).reshape(n, -1)


I_ENCODERS = {"IQ4_NL": encode_iq4_nl, "IQ4_XS": encode_iq4_xs}
I_DECODERS = {"IQ4_NL": decode_iq4_nl, "IQ4_XS": decode_iq4_xs}
