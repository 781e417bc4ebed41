"""Nibble packing, the tinygemm kernel layout, and dequantization. Pure tensor functions.

Row-major (on disk)::

    packed [N, K // 2] uint8, byte j = code[2j] | code[2j + 1] << 4

tinygemm (``_convert_weight_to_int4pack_for_cpu(codes, 1)``, AVX-512)::

    [N / 64][K][32 bytes], byte d of each run = channel d (low nibble) | channel d + 32 (high)

For N < 64 (16, 32, 48) it is [K][N / 2] with *adjacent* channels 2d, 2d + 1 in byte d (measured
here; the seed notes assumed the d / d + N/2 split). An N above 64 that is not a multiple of 64
ends in a tail block this module does not decode (see :func:`supports_direct_dequant`).
"""

from __future__ import annotations

import functools

import torch

from ..methods.grid import dequantize_codes

PACK_N_ALIGN = 16
"""The tinygemm packer needs N to be a multiple of this."""

TINYGEMM_N_BLOCK = 64
"""Output channels per block of the AVX-512 tinygemm layout."""

INNER_K_TILES = 1

_CONVERT_CHUNK_ROWS = 4096  # a multiple of TINYGEMM_N_BLOCK: chunks pack like the whole


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] integer codes in [0, 15] -> [N, K // 2] uint8, even column in the low nibble."""
    if codes.dim() != 2 or codes.shape[1] % 2:
        raise ValueError(f"expected [N, K] with even K, got {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[N, K // 2] uint8 -> [N, K] uint8 codes in [0, 15]."""
    n, half = packed.shape
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(n, half * 2)


def to_int4pack(packed: torch.Tensor) -> torch.Tensor:
    """Row-major nibbles [N, K // 2] -> the tinygemm kernel layout (same shape, uint8).

    Converted in row chunks so the int32 code transient stays bounded for large vocabularies.
    """
    n = packed.shape[0]
    if n % PACK_N_ALIGN:
        raise ValueError(f"N={n} is not a multiple of {PACK_N_ALIGN}, which the tinygemm packer requires")
    chunks = []
    for start in range(0, n, _CONVERT_CHUNK_ROWS):
        codes = unpack_nibbles(packed[start : start + _CONVERT_CHUNK_ROWS]).to(torch.int32)
        chunks.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES))
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def scales_and_zeros(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """scale, zero [N, G] -> [G, N, 2] bf16, the kernel's parameter layout."""
    return torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)


def supports_direct_dequant(n: int) -> bool:
    """Whether N output channels tile the 64-channel block, so the kernel layout can be decoded."""
    if n < TINYGEMM_N_BLOCK:
        return n % PACK_N_ALIGN == 0
    return n % TINYGEMM_N_BLOCK == 0


def codes_from_int4pack(int4pack: torch.Tensor) -> torch.Tensor:
    """Kernel layout [N, K // 2] -> row-major codes [N, K] uint8. Requires supports_direct_dequant(N)."""
    n, half = int4pack.shape
    k = half * 2
    if n < TINYGEMM_N_BLOCK:
        runs = int4pack.reshape(k, n // 2)
        return torch.stack([runs & 0x0F, runs >> 4], dim=-1).reshape(k, n).t().contiguous()
    runs = int4pack.reshape(n // TINYGEMM_N_BLOCK, k, TINYGEMM_N_BLOCK // 2)
    # The channel within a block: d from the low nibble, d + 32 from the high one.
    codes = torch.cat([runs & 0x0F, runs >> 4], dim=2)  # [N / 64, K, 64]
    return codes.transpose(1, 2).reshape(n, k)


def dequantize_int4pack(int4pack: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
    """bf16 weight [N, K] straight from the kernel layout and its [G, N, 2] parameters."""
    codes = codes_from_int4pack(int4pack)
    return dequantize_codes(codes, sz[..., 0].t(), sz[..., 1].t())


@functools.lru_cache(maxsize=None)
def kernel_layout_matches(n: int) -> bool:
    """Pack a known pattern with N=n channels on this CPU and check it decodes back exactly.

    The layout is a property of the kernel build and the CPU's vector width, so it is checked
    once per process for each block shape rather than assumed.
    """
    if not supports_direct_dequant(n):
        return False
    rows = n if n < TINYGEMM_N_BLOCK else 2 * TINYGEMM_N_BLOCK
    k = 64
    idx = torch.arange(rows * k, dtype=torch.int64).reshape(rows, k)
    codes = ((idx * 7 + idx // k) % 16).to(torch.uint8)
    packed = to_int4pack(pack_nibbles(codes))
    return bool(torch.equal(codes_from_int4pack(packed), codes))
