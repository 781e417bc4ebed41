"""GGUF's Q4_K super-blocks as int4q grids, both ways. Pure tensor code.

    Q4_K  144 bytes per 256 weights: fp16 d, fp16 dmin, 12 bytes of 6-bit levels (8 scales and
          8 minimums, one each per group of 32), 128 bytes of nibbles
          w = (d * sc) * q - dmin * m

Bytes 0-3 hold sc 0-3 and bytes 4-7 m 0-3 in their low six bits, the top two bits of sc 4-7 and
m 4-7; bytes 8-11 hold the low four bits of sc 4-7 (low half) and m 4-7 (high half). Nibble byte
l of chunk c (32 bytes each) holds element l of group 2c (low half) and of group 2c + 1 (high).
int4q's grid per group is ``(q - 8) * scale + zero`` with ``scale = d * sc`` and
``zero = 8 * scale - dmin * m`` (see ``methods.superblock``).
"""

from __future__ import annotations

import torch

from ...methods.grid import MID, GroupQuantized
from ...methods.superblock import SUPER_LEVELS

GROUPS = 8  # groups of 32 per super-block
SUPER = 256


def _units(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [..., 8] (fp64, each an fp16 unit times 0..63) -> (the unit [..., 1] as fp64, the
    levels [..., 8] uint8); ValueError where no fp16 unit gives them. Any unit that reproduces
    the values exactly is as good as another: the products are what is stored."""
    top = values.amax(dim=-1, keepdim=True)
    unit = torch.zeros_like(top)
    found = top == 0
    for top_level in range(SUPER_LEVELS, 0, -1):
        if bool(found.all()):
            break
        u = (top / top_level).to(torch.float16).to(torch.float64)
        levels = torch.round(values / torch.where(u == 0, 1.0, u))
        ok = ~found & (u > 0) & ((levels <= SUPER_LEVELS) & (levels * u == values)).all(dim=-1, keepdim=True)
        unit, found = torch.where(ok, u, unit), found | ok
    if not bool(found.all()):
        raise ValueError("the scales or minimums are not 6-bit multiples of an fp16 unit; quantize on Q4_K storage")
    return unit, torch.round(values / torch.where(unit == 0, 1.0, unit)).to(torch.uint8)


def fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    """[..., B] fp32 or fp64 holding fp16 values -> [..., B * 2] uint8, little-endian."""
    return values.to(torch.float16).contiguous().view(torch.uint8)


def encode_q4_k(gq: GroupQuantized) -> torch.Tensor:
    """A group-32 weight on Q4_K super-block grids (K a multiple of 256) -> uint8 [N, K / 256 * 144];
    ValueError for a weight whose grids Q4_K cannot hold."""
    n, k = gq.codes.shape
    if gq.group_size != 32 or k % SUPER:
        raise ValueError(f"Q4_K holds rows of whole {SUPER}-weight super-blocks of 32-weight groups")
    scale = gq.scale.to(torch.float64).reshape(n, k // SUPER, GROUPS)
    minimum = MID * scale - gq.zero.to(torch.float64).reshape(n, k // SUPER, GROUPS)
    if bool((scale < 0).any()) or bool((minimum < 0).any()):
        raise ValueError("Q4_K holds grids with a step >= 0 and a lowest point <= 0 only")
    d, sc = _units(scale)
    dmin, m = _units(minimum)
    levels = torch.cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                        (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)], dim=-1)
    c = gq.codes.to(torch.uint8).reshape(n, k // SUPER, GROUPS // 2, 2, 32)
    nibbles = (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(n, k // SUPER, 128)
    return torch.cat([fp16_bytes(d), fp16_bytes(dmin), levels, nibbles], dim=-1).reshape(n, -1)


def decode_q4_k(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 [N, K / 256 * 144] -> (codes [N, K] uint8, scale d * sc [N, K / 32], offset -dmin * m
    [N, K / 32]), fp32 as GGML computes them, so a weight is ``codes * scale + offset``."""
    n = data.shape[0]
    blocks = data.reshape(n, -1, 144)
    d, dmin = (blocks[..., i:i + 2].contiguous().view(torch.float16).to(torch.float32) for i in (0, 2))
    b = blocks[..., 4:16].to(torch.int32)
    sc = torch.cat([b[..., 0:4] & 63, (b[..., 8:12] & 0xF) | ((b[..., 0:4] >> 6) << 4)], dim=-1)
    m = torch.cat([b[..., 4:8] & 63, (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 6) << 4)], dim=-1)
    qs = blocks[..., 16:].reshape(n, -1, GROUPS // 2, 1, 32)
    codes = torch.cat([qs & 0xF, qs >> 4], dim=-2).reshape(n, -1)
    return codes, (d * sc.to(torch.float32)).reshape(n, -1), -(dmin * m.to(torch.float32)).reshape(n, -1)
