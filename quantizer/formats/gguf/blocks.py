"""GGUF's block types as int4q grids, both ways. Pure tensor code.

    Q4_0  18 bytes: fp16 d, 16 bytes of nibbles                   w = (q - 8) * d        (symmetric)
    Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes                      w = q * d + m          (asymmetric)
    Q5_0  22 bytes: fp16 d, 4 bytes of fifth bits, 16 bytes       w = (q - 16) * d       (symmetric)
    Q5_1  24 bytes: fp16 d, fp16 m, 4 bytes of fifth bits, 16     w = q * d + m          (asymmetric)
    Q8_0  34 bytes: fp16 d, 32 int8 codes                         w = q * d
    Q4_K, Q5_K, Q6_K  super-blocks of 256 weights (see kquants.py)
    IQ4_NL, IQ4_XS    4-bit codes on a non-linear table of levels (see iquants.py)

A block's nibble byte j holds element j in its low half and element j + 16 in its high half; bit
e of the little-endian word of fifth bits is element e's. int4q's grid for Q4_1/Q5_1 is
``(q - mid) * d + zero`` with ``zero = m + mid * d`` (``Storage`` "min").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...methods.codebook import IQ4_LEVELS, codebook_values
from ...methods.codes import code_range
from ...methods.grid import ChannelQuantized, GroupQuantized, Storage
from .iquants import I_DECODERS, I_ENCODERS
from .kquants import K_DECODERS, K_ENCODERS, fp16_bytes, nibbles, stored_fp16, unpack_nibbles
from .types import BLOCK, SUPER


@dataclass(frozen=True)
class BlockType:
    """One GGML block type: the module precision it stores (``bits``: 4, 5, 6, or 8 for Q8_0),
    its grid (``symmetric``), ``nbytes`` per block of ``weights`` weights, and how int4q's
    methods round onto it (``storage``)."""

    name: str  # GGML's name: ggml_type and the gguf package's GGMLQuantizationType member
    bits: int
    symmetric: bool
    nbytes: int
    storage: Storage
    weights: int = BLOCK

    def row_bytes(self, k: int) -> int:
        return k // self.weights * self.nbytes

    def holds(self, k: int) -> bool:
        """Whether a row of k weights is whole blocks of this type."""
        return k % self.weights == 0

    @property
    def kquant(self) -> bool:
        return self.name in K_ENCODERS


def _legacy(bits: int, symmetric: bool) -> Storage:
    """The storage of a 32-weight type: fp16 scale, and an fp16 minimum (asymmetric); a symmetric
    grid's largest magnitude gets code 0 whatever its sign, as llama.cpp rounds Q4_0 and Q5_0."""
    if symmetric:
        return Storage(torch.float16, "integer", BLOCK, signed_scale=True, bits=bits)
    return Storage(torch.float16, "min", BLOCK, bits=bits)


Q4_0 = BlockType("Q4_0", 4, True, 18, _legacy(4, True))
Q4_1 = BlockType("Q4_1", 4, False, 20, _legacy(4, False))
Q5_0 = BlockType("Q5_0", 5, True, 22, _legacy(5, True))
Q5_1 = BlockType("Q5_1", 5, False, 24, _legacy(5, False))
Q8_0 = BlockType("Q8_0", 8, True, 34, Storage(torch.float16, int8_block=BLOCK))
Q4_K = BlockType("Q4_K", 4, False, 144, Storage(torch.float16, "min", BLOCK, superblock=SUPER // 32), SUPER)
Q5_K = BlockType("Q5_K", 5, False, 176, Storage(torch.float16, "min", BLOCK, superblock=SUPER // 32, bits=5), SUPER)
Q6_K = BlockType("Q6_K", 6, True, 210, Storage(torch.float16, "float", BLOCK, signed_scale=True,
                                               superblock=SUPER // 16, bits=6), SUPER)
IQ4_NL = BlockType("IQ4_NL", 4, True, 18, Storage(torch.float16, "float", BLOCK, signed_scale=True,
                                                   codebook=IQ4_LEVELS))
IQ4_XS = BlockType("IQ4_XS", 4, True, 136, Storage(torch.float16, "float", BLOCK, signed_scale=True,
                                                   superblock=SUPER // BLOCK, codebook=IQ4_LEVELS), SUPER)
TYPES = {t.name: t for t in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)}
Q4_0_STORAGE, Q4_1_STORAGE, Q4_K_STORAGE = Q4_0.storage, Q4_1.storage, Q4_K.storage


def block_type(bits: int, symmetric: bool, k: int, kquants: bool = False, iq4: str | None = None) -> BlockType:
    """The block type of a module with this precision, grid and input dim k. 6 bits is Q6_K and 8
    bits Q8_0; with ``kquants`` an asymmetric 4- or 5-bit module is Q4_K/Q5_K where its rows are
    whole super-blocks, Q4_1/Q5_1 elsewhere (as those storages round it); with ``iq4`` ("IQ4_NL" or
    "IQ4_XS") a symmetric 4-bit module is that type (IQ4_XS: IQ4_NL where its rows are not whole
    super-blocks, as llama-quantize falls back); otherwise Q4_0/Q5_0 (symmetric) or Q4_1/Q5_1."""
    if bits == 8:
        return Q8_0
    if bits == 6:
        return Q6_K
    if iq4 and symmetric and bits == 4:
        return IQ4_XS if iq4 == "IQ4_XS" and k % SUPER == 0 else IQ4_NL
    if symmetric:
        return Q4_0 if bits == 4 else Q5_0
    if kquants and k % SUPER == 0:
        return Q4_K if bits == 4 else Q5_K
    return Q4_1 if bits == 4 else Q5_1


def _fifth_bits(codes: torch.Tensor) -> torch.Tensor:
    """[..., 32] codes 0..31 -> [..., 4] bytes: the little-endian word whose bit e is code e's bit 4."""
    bits = ((codes >> 4) & 1).reshape(*codes.shape[:-1], 4, 8).to(torch.int32)
    return (bits << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8)


def encode_legacy(gq: GroupQuantized, kind: BlockType) -> torch.Tensor:
    """A group-32 weight on a Q4_0/Q5_0 (zero 0) or Q4_1/Q5_1 grid -> uint8 [N, K / 32 * bytes].
    ValueError when its scales, zeros or codes are not what ``kind`` can hold."""
    n, k = gq.codes.shape
    if gq.group_size != BLOCK:
        raise ValueError(f"GGUF blocks hold groups of {BLOCK}, not {gq.group_size}")
    if gq.bits != kind.bits:
        raise ValueError(f"{kind.name} holds {kind.bits}-bit codes, not {gq.bits}-bit")
    mid = code_range(kind.bits)[0]
    scale = stored_fp16(gq.scale.to(torch.float32), "scales")
    zero = gq.zero.to(torch.float32)
    codes = gq.codes.to(torch.uint8).reshape(n, k // BLOCK, BLOCK)
    parts = [fp16_bytes(scale.unsqueeze(-1))]
    if kind.symmetric and bool((zero != 0).any()):
        raise ValueError(f"{kind.name} holds symmetric grids (zero 0) only")
    if not kind.symmetric:
        parts.append(fp16_bytes((zero - mid * scale).unsqueeze(-1)))
    if kind.bits == 5:
        parts.append(_fifth_bits(codes))
    parts.append(nibbles(codes & 0xF))
    return torch.cat(parts, dim=-1).reshape(n, -1)


def encode_q8(cq: ChannelQuantized) -> torch.Tensor:
    """An 8-bit weight with one fp16 scale per 32 columns -> Q8_0 bytes uint8 [N, K / 32 * 34]."""
    n, k = cq.codes.shape
    if cq.scale.shape[1] != k // BLOCK or cq.scale.dtype != torch.float16:
        raise ValueError(f"Q8_0 needs one fp16 scale per {BLOCK} columns")
    codes = cq.codes.reshape(n, k // BLOCK, BLOCK).contiguous().view(torch.uint8)
    return torch.cat([fp16_bytes(cq.scale.unsqueeze(-1)), codes], dim=-1).reshape(n, -1)


ENCODE_ROWS = 4096
"""Rows encoded at a time: the encoders' transients stay a few MB whatever the weight's size."""


def encode(quantized: GroupQuantized | ChannelQuantized, kind: BlockType) -> torch.Tensor:
    """One module's blocks, row by row: uint8 [N, kind.row_bytes(K)]."""
    encoder = K_ENCODERS.get(kind.name) or I_ENCODERS.get(kind.name) or (
        encode_q8 if kind is Q8_0 else lambda q: encode_legacy(q, kind))
    n, k = quantized.codes.shape
    if n <= ENCODE_ROWS:
        return encoder(quantized)
    out = torch.empty(n, kind.row_bytes(k), dtype=torch.uint8)
    for start in range(0, n, ENCODE_ROWS):
        rows = slice(start, start + ENCODE_ROWS)
        out[rows] = encoder(quantized.rows(rows))
    return out


@dataclass(frozen=True)
class DecodedBlocks:
    """The stored fields of a block tensor: codes [N, K] (0..2^bits - 1, or -127..127 for Q8_0),
    d [N, G] per group and, for asymmetric types, m [N, G] (w = q * d + m; symmetric: w =
    (q - mid) * d; IQ4: w = levels[q] * d), all fp32 as GGML computes them (K-quants' per group:
    d * sc and -dmin * m)."""

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    mid: int = 0
    levels: tuple[int, ...] | None = None

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.d.shape[1]

    def values(self) -> torch.Tensor:
        """The weights [N, K] fp32, computed as GGML computes them."""
        n, k = self.codes.shape
        if self.levels:
            return codebook_values(self.codes.reshape(n, -1, self.group), self.d, self.levels).reshape(n, k)
        c = self.codes.to(torch.float32).reshape(n, -1, self.group)
        d = self.d.unsqueeze(-1)
        w = c * d + self.m.unsqueeze(-1) if self.m is not None else (c - self.mid) * d
        return w.reshape(n, k)


def decode(data: torch.Tensor, kind: BlockType) -> DecodedBlocks:
    """uint8 [N, row bytes] of ``kind`` -> its stored fields."""
    if kind.kquant:
        return DecodedBlocks(*K_DECODERS[kind.name](data))
    if kind.name in I_DECODERS:
        return DecodedBlocks(*I_DECODERS[kind.name](data), levels=IQ4_LEVELS)
    n = data.shape[0]
    blocks = data.reshape(n, -1, kind.nbytes)

    def fp16(offset: int) -> torch.Tensor:
        return blocks[..., offset:offset + 2].contiguous().view(torch.float16).squeeze(-1).to(torch.float32)

    if kind is Q8_0:
        return DecodedBlocks(blocks[..., 2:].contiguous().view(torch.int8).reshape(n, -1), fp16(0))
    codes = unpack_nibbles(blocks[..., kind.nbytes - 16:])
    if kind.bits == 5:
        word = blocks[..., kind.nbytes - 20:kind.nbytes - 16].to(torch.int32)
        fifth = (word.unsqueeze(-1) >> torch.arange(8, dtype=torch.int32)) & 1
        codes = codes | (fifth.reshape(*codes.shape).to(torch.uint8) << 4)
    minimum = None if kind.symmetric else fp16(2)
    return DecodedBlocks(codes.reshape(n, -1), fp16(0), minimum, code_range(kind.bits)[0] if kind.symmetric else 0)
