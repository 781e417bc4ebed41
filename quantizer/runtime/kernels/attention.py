"""One query's attention over the bf16 KV cache in fp32, ``torch.ops.int4q_native.attend_one``
(``csrc/decode_attention.c``): the int8 decode step's attention (see
:func:`..decode.decoder.attend_in_fp32`), reading the cache's bf16 values directly instead of
widening the whole cache to fp32 for PyTorch's attention every token.

It is checked against a float64 reference when first used. Where it fails the check, that
attention stays PyTorch's fp32 attention after one warning; where the library cannot be loaded,
silently (the kernels that need the library already say why).
"""

from __future__ import annotations

import torch

from ...native.build import NativeUnavailable
from ...native.constant import constant_result
from ...native.library import passes_self_test

SELF_TEST_SHAPES = ((9, 3, 64, 130), (4, 4, 12, 5), (8, 2, 128, 33))
"""(heads, kv_heads, head dim, positions) of the load-time check: grouped heads, a head dimension
the vector path does not take, and a cache whose length is not a multiple of 8."""

_choice: list[bool] = []  # has_attend_one's answer, once decided


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The operator's arithmetic in float64, before its bf16 rounding: [1, 1, H * D]."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))
    probabilities = torch.softmax(q.double() @ k.transpose(-1, -2) * scale, dim=-1)
    return (probabilities @ v).transpose(1, 2).reshape(1, 1, -1)


def within_rounding(got: torch.Tensor, q, k, v, scale: float) -> bool:
    """Whether ``got`` is :func:`reference` up to its bf16 rounding plus fp32 summation error
    (relative to the largest value attended over)."""
    exact = reference(q, k, v, scale)
    slack = v.double().abs().amax() * 2**-16
    return bool(((got.double() - exact).abs() <= exact.abs() * 2**-8 + slack).all())


def self_test() -> None:
    """Raise NativeUnavailable unless the operator is :func:`reference` up to rounding on seeded
    inputs of :data:`SELF_TEST_SHAPES`, read through cache views."""
    gen = torch.Generator().manual_seed(0)
    for heads, kv_heads, dim, length in SELF_TEST_SHAPES:
        q = torch.randn(1, heads, 1, dim, generator=gen).to(torch.bfloat16)
        k, v = (torch.randn(1, kv_heads, length + 3, dim, generator=gen).to(torch.bfloat16)[:, :, :length]
                for _ in range(2))
        scale = dim**-0.5
        if not within_rounding(torch.ops.int4q_native.attend_one(q, k, v, scale), q, k, v, scale):
            raise NativeUnavailable("int4q_native::attend_one is off by more than rounding on this machine")


@constant_result
def has_attend_one() -> bool:
    """Whether this process attends through the operator (a constant to torch.compile)."""
    if not _choice:
        _choice.append(_load())
    return _choice[0]


def _load() -> bool:
    return passes_self_test(self_test, "int8 decode attends through PyTorch's fp32 attention instead (slower)")
