"""The int8 KV cache (``--kv-cache int8``): each cached value row (one position of one head) as int8
codes times an fp32 scale, its largest magnitude / 127, and each key row the same per block of
:data:`KEY_DIMS` dimensions, in the layouts of ``csrc/decode_attention_int8.c`` (keys in blocks of
16 positions, values in pairs of positions). A layer's cache is an
:class:`Int8Cache`; ``torch.ops.int4q_native.store_kv_int8`` writes it and ``attend_one_int8`` attends
one query over it (the query heads rounded to int8 too, the weights to int16 units; docs/runtime.md,
"The int8 KV cache"). :func:`rows` reads it back in position order, for tests and for the queries
that attend through PyTorch.

The operator is checked against :func:`.attention.reference` over :func:`rows` when first used;
where the library is not loaded or fails the check, :func:`has_int8_cache` is False.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...native.build import NativeUnavailable
from ...native.library import passes_self_test
from .attention import within_rounding

BLOCK = 16
"""Positions of a key block: a cache holds a multiple of this."""

KEY_DIMS = 32
"""Dimensions of a key block with a scale of its own; head dimensions are multiples of it."""

KEY_OFFSET = 128
"""Added to the keys' codes, so that they are stored unsigned."""

SELF_TEST_SHAPES = ((9, 3, 64, 130), (12, 2, 128, 300), (14, 2, 96, 17))
"""(heads, kv_heads, head dim, positions) of the load-time check: one and several parts and key
blocks (96: three), odd lengths."""

_choice: list[bool] = []  # has_int8_cache's answer, once decided


@dataclass
class Int8Cache:
    """One layer's int8 KV cache for one sequence: keys uint8 and values int8 [1, kv_heads,
    positions, dim] (bytes in the kernel's layouts), key scales fp32 [1, kv_heads, positions,
    dim / KEY_DIMS] (in its layout too) and value scales fp32 [1, kv_heads, positions]."""

    keys: torch.Tensor
    key_scales: torch.Tensor
    values: torch.Tensor
    value_scales: torch.Tensor

    @classmethod
    def empty(cls, kv_heads: int, positions: int, dim: int) -> "Int8Cache":
        """A cache of zero codes and scales for at least ``positions`` positions (rounded up to
        :data:`BLOCK`)."""
        rounded = -(-positions // BLOCK) * BLOCK
        shape = (1, kv_heads, rounded, dim)
        return cls(torch.full(shape, KEY_OFFSET, dtype=torch.uint8), torch.zeros(*shape[:3], dim // KEY_DIMS),
                   torch.zeros(shape, dtype=torch.int8), torch.zeros(shape[:3]))

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.key_scales, self.values, self.value_scales]

    def store(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """k and v bf16 [1, kv_heads, T, dim] at positions start.."""
        torch.ops.int4q_native.store_kv_int8(k, v, *self.tensors(), start)

    def attend(self, q: torch.Tensor, length: int, scale: float) -> torch.Tensor:
        """q bf16 [1, heads, 1, dim] over positions 0..length-1 -> bf16 [1, 1, heads * dim]."""
        return torch.ops.int4q_native.attend_one_int8(q, *self.tensors(), length, scale)


def store_and_attend(cache: Int8Cache, q, k, v, start: int, scale: float, prompt_attention, attention):
    """Store k and v (bf16 [1, kv_heads, T, dim]) at positions start.. and return the attention of
    q [1, heads, T, dim] -> [1, T, heads * dim]: one query through the operator; a prompt from
    position 0 through ``prompt_attention(q, k, v, 0, scale)`` over its own bf16 rows (nothing
    earlier is cached); other queries through ``attention(q, k, v, start, scale)`` (causal from
    ``start``) over :func:`rows` in fp32, rounded to bf16 once."""
    cache.store(k, v, start)
    t = q.shape[2]
    if t == 1:
        return cache.attend(q, start + 1, scale)
    if start == 0:
        return prompt_attention(q, k, v, 0, scale)
    cached_k, cached_v = rows(cache, start + t)
    return attention(q.float(), cached_k, cached_v, start, scale).to(q.dtype)


def rows(cache: Int8Cache, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached keys and values of positions 0..length-1 as fp32 [1, kv_heads, length, dim]:
    each code times its scale (a value row's, a key block's; exact in fp32)."""
    _, kv_heads, positions, dim = cache.keys.shape
    keys = cache.keys.view(kv_heads, positions // BLOCK, dim // 4, BLOCK, 4).permute(0, 1, 3, 2, 4)
    keys = keys.reshape(1, kv_heads, positions, dim).int() - KEY_OFFSET
    blocks = dim // KEY_DIMS
    key_scales = cache.key_scales.view(kv_heads, positions // BLOCK, blocks, BLOCK).permute(0, 1, 3, 2)
    key_scales = key_scales.reshape(1, kv_heads, positions, blocks).repeat_interleave(KEY_DIMS, -1)
    values = cache.values.view(kv_heads, positions // 2, dim, 2).permute(0, 1, 3, 2).reshape(1, kv_heads, positions, dim)
    return tuple((codes[:, :, :length].float() * scales[:, :, :length])
                 for codes, scales in ((keys, key_scales), (values, cache.value_scales[..., None])))


def rounded_query(q: torch.Tensor) -> torch.Tensor:
    """The query heads [..., dim] as the operator multiplies them: int8 codes times each head's
    largest magnitude / 127, in fp32."""
    scale = q.float().abs().amax(-1, keepdim=True) / 127
    return torch.where(scale > 0, torch.round(q.float() / scale), 0) * scale


def self_test() -> None:
    """Raise NativeUnavailable unless stored rows read back within int8 rounding and the operator is
    the attention over them up to rounding, on seeded inputs of :data:`SELF_TEST_SHAPES`."""
    gen = torch.Generator().manual_seed(0)
    for heads, kv_heads, dim, length in SELF_TEST_SHAPES:
        q = torch.randn(1, heads, 1, dim, generator=gen).to(torch.bfloat16)
        k, v = (torch.randn(1, kv_heads, length, dim, generator=gen).to(torch.bfloat16) for _ in range(2))
        cache = Int8Cache.empty(kv_heads, length, dim)
        cache.store(k, v, 0)
        got_k, got_v = rows(cache, length)
        for got, want in ((got_k, k), (got_v, v)):  # the keys' blocks are within their rows' bound too
            if not ((got - want.float()).abs() <= want.float().abs().amax(-1, keepdim=True) / 254 * 1.001).all():
                raise NativeUnavailable("int4q_native::store_kv_int8 does not round rows to int8 on this machine")
        scale = dim**-0.5
        if not within_rounding(cache.attend(q, length, scale), rounded_query(q), got_k, got_v, scale):
            raise NativeUnavailable("int4q_native::attend_one_int8 is off by more than rounding on this machine")


def has_int8_cache() -> bool:
    """Whether this process can decode over an int8 KV cache (the library loaded and checked)."""
    if not _choice:
        _choice.append(_load())
    return _choice[0]


def _load() -> bool:
    return passes_self_test(self_test, "no int8 KV cache here (--kv-cache int8 is refused)")
