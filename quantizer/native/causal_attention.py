"""A whole sequence's causal attention from position 0, ``torch.ops.int4q_native.causal_attention``
(``csrc/causal_attention.c``): bf16 queries, keys and values, every product exact and the sums in
fp32, each softmax weight carried to the values as two bf16 numbers (16 bits, where PyTorch's bf16
attention rounds it to 8), so the output is the exact attention rounded once to bf16 nearly
everywhere; grouped heads read their shared keys and values without copies.

It is checked against a float64 reference when first used. Where it fails the check, the caller
keeps PyTorch's attention after one warning; where the library cannot be loaded or the CPU lacks
AVX-512 BF16, silently (the kernels that need the library already say why).
"""

from __future__ import annotations

import logging

import torch

from .build import NativeUnavailable
from .library import native_off, ops

SELF_TEST_SHAPES = ((1, 9, 3, 130, 64), (2, 4, 4, 25, 12), (1, 2, 1, 49, 80), (1, 3, 3, 1, 128))
"""(batch, heads, kv heads, positions, head dim) of the load-time check: grouped heads, a batch,
positions that end inside a block of queries and of keys, head dimensions the value tiles do not
divide, and a single position."""

log = logging.getLogger(__name__)

_choice: list[bool] = []  # has_causal_attention's answer, once decided


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The operator's arithmetic in float64, before any bf16 rounding: [B, T, H, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))
    positions = q.shape[2]
    later = torch.ones(positions, positions, dtype=torch.bool).triu(1)
    scores = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(later, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


def within_rounding(got: torch.Tensor, q, k, v, scale: float) -> bool:
    """Whether ``got`` is :func:`reference` up to its bf16 rounding (2^-8 relative) and what the
    weights' 16 bits leave (2^-14 of the largest value attended over)."""
    exact = reference(q, k, v, scale)
    slack = v.double().abs().amax() * 2**-14
    return bool(((got.double() - exact).abs() <= exact.abs() * 2**-8 + slack).all())


def self_test() -> None:
    """Raise NativeUnavailable unless the operator is :func:`reference` up to rounding on seeded
    inputs of :data:`SELF_TEST_SHAPES`, the queries read through a transposed view as models pass them."""
    gen = torch.Generator().manual_seed(0)
    for batch, heads, kv_heads, positions, dim in SELF_TEST_SHAPES:
        q = torch.randn(batch, positions, heads, dim, generator=gen).to(torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(batch, kv_heads, positions, dim, generator=gen).to(torch.bfloat16) for _ in range(2))
        scale = dim**-0.5
        if not within_rounding(torch.ops.int4q_native.causal_attention(q, k, v, scale), q, k, v, scale):
            raise NativeUnavailable("int4q_native::causal_attention is off by more than rounding on this machine")


def has_causal_attention() -> bool:
    """Whether this process can attend through the operator (decided once)."""
    if not _choice:
        _choice.append(_load())
    return _choice[0]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q bf16 [B, H, T, D], k and v bf16 [B, Hkv, T, D], H a multiple of Hkv, D even -> bf16
    [B, T, H, D]: query i attends to positions 0..i. Only where :func:`has_causal_attention`."""
    return torch.ops.int4q_native.causal_attention(q, k, v, scale)


def _load() -> bool:
    if native_off():
        return False
    try:
        if not ops().causal_attention_available():
            return False
    except NativeUnavailable:
        return False
    try:
        self_test()
    except NativeUnavailable as e:
        log.warning("causal attention stays PyTorch's (slower): %s", e)
        return False
    return True
