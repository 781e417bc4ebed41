"""GGUF's 32-weight block types as int4q grids, both ways. Pure tensor code.

    Q4_0  18 bytes: fp16 d, 16 bytes of nibbles      w = (q - 8) * d           (symmetric)
    Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes         w = q * d + m             (asymmetric)
    Q8_0  34 bytes: fp16 d, 32 int8 codes            w = q * d
    Q4_K  super-blocks of 256 weights (see kquants.py)

A block's nibble byte j holds element j in its low half and element j + 16 in its high half.
int4q's grid for Q4_1 is ``(q - 8) * d + zero`` with ``zero = m + 8 * d`` (``Storage`` "min").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...methods.grid import MID, ChannelQuantized, GroupQuantized, Storage
from .kquants import decode_q4_k, encode_q4_k, fp16_bytes

BLOCK = 32


@dataclass(frozen=True)
class BlockType:
    name: str  # GGML's name: ggml_type and the gguf package's GGMLQuantizationType member
    bits: int  # the module precision it stores
    symmetric: bool | None  # the 4-bit grid it holds (None: 8-bit)
    nbytes: int  # bytes per block of ``weights`` weights
    weights: int = BLOCK

    def row_bytes(self, k: int) -> int:
        return k // self.weights * self.nbytes

    def holds(self, k: int) -> bool:
        """Whether a row of k weights is whole blocks of this type."""
        return k % self.weights == 0


Q4_0 = BlockType("Q4_0", 4, True, 18)
Q4_1 = BlockType("Q4_1", 4, False, 20)
Q8_0 = BlockType("Q8_0", 8, None, 34)
Q4_K = BlockType("Q4_K", 4, False, 144, 256)
TYPES = {t.name: t for t in (Q4_0, Q4_1, Q8_0, Q4_K)}

Q4_0_STORAGE = Storage(torch.float16, "integer", BLOCK, signed_scale=True)  # as llama.cpp rounds Q4_0
Q4_1_STORAGE = Storage(torch.float16, "min", BLOCK)
Q4_K_STORAGE = Storage(torch.float16, "min", BLOCK, superblock=Q4_K.weights // BLOCK)  # Q4_1 where K does not fit


def block_type(bits: int, symmetric: bool, k: int, kquants: bool = False) -> BlockType:
    """The block type of a module with this scheme and input dim k; with ``kquants`` an asymmetric
    4-bit one is Q4_K where its rows are whole super-blocks (else Q4_1, as Q4_K_STORAGE rounds it)."""
    if bits == 8:
        return Q8_0
    if symmetric:
        return Q4_0
    return Q4_K if kquants and Q4_K.holds(k) else Q4_1


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., B, 32] codes 0..15 -> [..., B, 16] bytes."""
    c = codes.to(torch.uint8)
    return c[..., :16] | (c[..., 16:] << 4)


def encode_q4(gq: GroupQuantized, kind: BlockType) -> torch.Tensor:
    """A group-32 weight on a Q4_0 (zero 0) or Q4_1 grid -> uint8 [N, K / 32 * bytes]. ValueError
    when its scales or zeros are not what ``kind`` can hold."""
    n, k = gq.codes.shape
    if gq.group_size != BLOCK:
        raise ValueError(f"GGUF blocks hold groups of {BLOCK}, not {gq.group_size}")
    scale, zero = gq.scale.to(torch.float32), gq.zero.to(torch.float32)
    if not torch.equal(scale.to(torch.float16).to(torch.float32), scale):
        raise ValueError("the scales are not fp16 values; quantize on a GGUF storage")
    codes = gq.codes.reshape(n, k // BLOCK, BLOCK)
    parts = [fp16_bytes(scale.unsqueeze(-1))]
    if kind.symmetric and bool((zero != 0).any()):
        raise ValueError(f"{kind.name} holds symmetric grids (zero 0) only")
    if not kind.symmetric:
        parts.append(fp16_bytes((zero - MID * scale).unsqueeze(-1)))
    parts.append(_nibbles(codes))
    return torch.cat(parts, dim=-1).reshape(n, -1)


def encode_q8(cq: ChannelQuantized) -> torch.Tensor:
    """An 8-bit weight with one fp16 scale per 32 columns -> Q8_0 bytes uint8 [N, K / 32 * 34]."""
    n, k = cq.codes.shape
    if cq.scale.shape[1] != k // BLOCK or cq.scale.dtype != torch.float16:
        raise ValueError(f"Q8_0 needs one fp16 scale per {BLOCK} columns")
    codes = cq.codes.reshape(n, k // BLOCK, BLOCK).contiguous().view(torch.uint8)
    return torch.cat([fp16_bytes(cq.scale.unsqueeze(-1)), codes], dim=-1).reshape(n, -1)


def encode(quantized: GroupQuantized | ChannelQuantized, kind: BlockType) -> torch.Tensor:
    """One module's blocks, row by row: uint8 [N, kind.row_bytes(K)]."""
    if kind is Q4_K:
        return encode_q4_k(quantized)
    return encode_q8(quantized) if kind.bits == 8 else encode_q4(quantized, kind)


@dataclass(frozen=True)
class DecodedBlocks:
    """The stored fields of a block tensor: codes [N, K] (0..15 for 4-bit, -127..127 for Q8_0),
    d [N, K / 32] and, for Q4_1 and Q4_K, m [N, K / 32] (w = q * d + m), all fp32 as GGML
    computes them (Q4_K's per group: d * sc and -dmin * m)."""

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    def values(self) -> torch.Tensor:
        """The weights [N, K] fp32, computed as GGML computes them."""
        n, k = self.codes.shape
        c = self.codes.to(torch.float32).reshape(n, -1, BLOCK)
        d = self.d.unsqueeze(-1)
        if self.m is not None:
            w = c * d + self.m.unsqueeze(-1)
        elif self.codes.dtype == torch.uint8:
            w = (c - MID) * d
        else:
            w = c * d
        return w.reshape(n, k)


def decode(data: torch.Tensor, kind: BlockType) -> DecodedBlocks:
    """uint8 [N, row bytes] of ``kind`` -> its stored fields."""
    n = data.shape[0]
    blocks = data.reshape(n, -1, kind.nbytes)

    def fp16(offset: int) -> torch.Tensor:
        return blocks[..., offset:offset + 2].contiguous().view(torch.float16).squeeze(-1).to(torch.float32)

    if kind is Q4_K:
        return DecodedBlocks(*decode_q4_k(data))
    if kind.bits == 8:
        return DecodedBlocks(blocks[..., 2:].contiguous().view(torch.int8).reshape(n, -1), fp16(0))
    qs = blocks[..., kind.nbytes - 16:]
    codes = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(n, -1)
    return DecodedBlocks(codes, fp16(0), fp16(2) if kind is Q4_1 else None)
