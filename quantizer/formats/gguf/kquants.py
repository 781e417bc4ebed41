"""GGUF's K-quant super-blocks (256 weights) as int4q grids, both ways. Pure tensor code.

    Q4_K  144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit levels (8 scales and 8 minimums, one
          each per group of 32), 128 bytes of nibbles                 w = (d * sc) * q - dmin * m
    Q5_K  176 bytes: as Q4_K, with 32 bytes of fifth bits before the nibbles (codes 0..31)
    Q6_K  210 bytes: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per
          group of 16), fp16 d                                        w = (d * sc) * (q - 32)

Q4_K/Q5_K levels: bytes 0-3 hold sc 0-3 and bytes 4-7 m 0-3 in their low six bits, the top two
bits of sc 4-7 and m 4-7; bytes 8-11 hold the low four bits of sc 4-7 (low half) and m 4-7 (high
half). Nibble byte l of chunk c (32 bytes each) holds element l of group 2c (low half) and of
group 2c + 1 (high); Q5_K's fifth-bit byte l holds element l of group j in bit j. Q6_K: per half
of 128 weights, low-nibble byte l holds elements l (low) and l + 64 (high), byte l + 32 elements
l + 32 and l + 96, and high byte l the top two bits of elements l, l + 32, l + 64, l + 96.

int4q's grid per group is ``(q - mid) * scale + zero`` with ``scale = d * sc`` and, for Q4_K and
Q5_K, ``zero = mid * scale - dmin * m`` (see ``methods.superblock``).
"""

from __future__ import annotations

import torch

from ...methods.codes import code_range
from ...methods.grid import GroupQuantized
from ...methods.superblock import SIGNED_LEVELS, SUPER_LEVELS, fp16_units
from .types import SUPER


def fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    """[..., B] fp32 or fp64 holding fp16 values -> [..., B * 2] uint8, little-endian."""
    return values.to(torch.float16).contiguous().view(torch.uint8)


def stored_fp16(values: torch.Tensor, what: str) -> torch.Tensor:
    """``values``, checked to be fp16 values; ValueError naming ``what`` where they are not."""
    if not torch.equal(values.to(torch.float16).to(values.dtype), values):
        raise ValueError(f"the {what} are not fp16 values; quantize on a GGUF storage")
    return values


def nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2L] codes (their low four bits) -> [..., L] bytes: the first half low, the second high."""
    c = codes.to(torch.uint8) & 0xF
    half = c.shape[-1] // 2
    return c[..., :half] | (c[..., half:] << 4)


def unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`nibbles`: [..., L] bytes -> [..., 2L] values 0..15."""
    return torch.cat([data & 0xF, data >> 4], dim=-1)


def _units(values: torch.Tensor, levels: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~quantizer.methods.superblock.fp16_units`; ValueError where no fp16 unit gives them."""
    unit, found_levels, found = fp16_units(values, levels)
    if not bool(found.all()):
        raise ValueError("the scales or minimums are not levels of an fp16 unit per super-block; quantize on the "
                         "K-quant's storage")
    return unit, found_levels


def _check(gq: GroupQuantized, group: int, bits: int, name: str) -> tuple[int, int]:
    n, k = gq.codes.shape
    if gq.group_size != group or k % SUPER:
        raise ValueError(f"{name} holds rows of whole {SUPER}-weight super-blocks of {group}-weight groups")
    if gq.bits != bits:
        raise ValueError(f"{name} holds {bits}-bit codes, not {gq.bits}-bit")
    return n, k


def _six_bit_levels(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The 12 bytes of eight 6-bit scale levels and eight minimum levels [..., 8] each."""
    sc, m = sc.to(torch.uint8), m.to(torch.uint8)
    return torch.cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                      (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)], dim=-1)


def _encode_min_k(gq: GroupQuantized, bits: int, name: str) -> torch.Tensor:
    """Q4_K or Q5_K: a group-32 weight on its super-block grids -> uint8 [N, K / 256 * bytes]."""
    n, k = _check(gq, 32, bits, name)
    mid = code_range(bits)[0]
    scale = gq.scale.to(torch.float64).reshape(n, k // SUPER, 8)
    minimum = mid * scale - gq.zero.to(torch.float64).reshape(n, k // SUPER, 8)
    if bool((scale < 0).any()) or bool((minimum < 0).any()):
        raise ValueError(f"{name} holds grids with a step >= 0 and a lowest point <= 0 only")
    d, sc = _units(scale, (0, SUPER_LEVELS))
    dmin, m = _units(minimum, (0, SUPER_LEVELS))
    chunks = gq.codes.to(torch.uint8).reshape(n, k // SUPER, 4, 64)  # groups 2c and 2c + 1
    parts = [fp16_bytes(d), fp16_bytes(dmin), _six_bit_levels(sc, m)]
    if bits == 5:
        fifth = ((chunks >> 4) & 1).reshape(n, k // SUPER, 8, 32).to(torch.int32)
        parts.append((fifth << torch.arange(8, dtype=torch.int32).view(8, 1)).sum(-2).to(torch.uint8))
    parts.append(nibbles(chunks).reshape(n, k // SUPER, 128))
    return torch.cat(parts, dim=-1).reshape(n, -1)


def _decode_min_k(data: torch.Tensor, bits: int, nbytes: int) -> tuple[torch.Tensor, ...]:
    """Q4_K or Q5_K bytes -> (codes [N, K] uint8, scale d * sc [N, K / 32], offset -dmin * m
    [N, K / 32]), fp32 as GGML computes them, so a weight is ``codes * scale + offset``."""
    n = data.shape[0]
    blocks = data.reshape(n, -1, nbytes)
    d, dmin = (blocks[..., i:i + 2].contiguous().view(torch.float16).to(torch.float32) for i in (0, 2))
    b = blocks[..., 4:16].to(torch.int32)
    sc = torch.cat([b[..., 0:4] & 63, (b[..., 8:12] & 0xF) | ((b[..., 0:4] >> 6) << 4)], dim=-1)
    m = torch.cat([b[..., 4:8] & 63, (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 6) << 4)], dim=-1)
    codes = unpack_nibbles(blocks[..., nbytes - 128:].reshape(n, -1, 4, 32))  # [n, S, 4, 64]
    if bits == 5:
        qh = blocks[..., 16:48].to(torch.int32).reshape(n, -1, 1, 32)
        fifth = (qh >> torch.arange(8, dtype=torch.int32).view(8, 1)) & 1  # [n, S, 8 groups, 32]
        codes = codes | (fifth.reshape(n, -1, 4, 64).to(torch.uint8) << 4)
    return codes.reshape(n, -1), (d * sc.to(torch.float32)).reshape(n, -1), -(dmin * m.to(torch.float32)).reshape(n, -1)


def encode_q6_k(gq: GroupQuantized) -> torch.Tensor:
    """A group-16 symmetric 6-bit weight on Q6_K super-block grids -> uint8 [N, K / 256 * 210]."""
    n, k = _check(gq, 16, 6, "Q6_K")
    if bool((gq.zero != 0).any()):
        raise ValueError("Q6_K holds symmetric grids (zero 0) only")
    d, sc = _units(gq.scale.to(torch.float64).reshape(n, k // SUPER, 16), SIGNED_LEVELS)
    q = gq.codes.to(torch.uint8).reshape(n, k // SUPER, 2, 4, 32)  # halves of 128, quarters of 32
    low = torch.cat([q[..., 0, :] & 0xF | (q[..., 2, :] & 0xF) << 4,
                     q[..., 1, :] & 0xF | (q[..., 3, :] & 0xF) << 4], dim=-1)
    high = sum((q[..., j, :] >> 4) << (2 * j) for j in range(4))
    return torch.cat([low.reshape(n, -1, 128), high.reshape(n, -1, 64), sc.to(torch.int8).view(torch.uint8),
                      fp16_bytes(d)], dim=-1).reshape(n, -1)


def decode_q6_k(data: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q6_K bytes -> (codes [N, K] uint8 0..63, scale d * sc [N, K / 16] fp32, None, 32)."""
    n = data.shape[0]
    blocks = data.reshape(n, -1, 210)
    low = blocks[..., :128].reshape(n, -1, 2, 2, 32)  # [half, byte run (l, l + 32), l]
    high = blocks[..., 128:192].reshape(n, -1, 2, 1, 32)
    quarters = torch.stack([low[..., 0, :] & 0xF, low[..., 1, :] & 0xF, low[..., 0, :] >> 4, low[..., 1, :] >> 4],
                           dim=-2)
    tops = (high >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3
    codes = (quarters | (tops << 4)).reshape(n, -1)
    sc = blocks[..., 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = blocks[..., 208:210].contiguous().view(torch.float16).to(torch.float32)
    return codes, (d * sc).reshape(n, -1), None, code_range(6)[0]


K_ENCODERS = {"Q4_K": lambda gq: _encode_min_k(gq, 4, "Q4_K"), "Q5_K": lambda gq: _encode_min_k(gq, 5, "Q5_K"),
              "Q6_K": encode_q6_k}
K_DECODERS = {"Q4_K": lambda data: _decode_min_k(data, 4, 144), "Q5_K": lambda data: _decode_min_k(data, 5, 176),
              "Q6_K": decode_q6_k}
