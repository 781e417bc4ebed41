"""What this CPU computes natively, decided from its instruction-set flags (/proc/cpuinfo), so
that each bf16 computation runs where this machine is fast: bf16 where it multiplies bf16 in
hardware, fp32 over the same values elsewhere (on AVX2 alone oneDNN's bf16 GEMM is several times
slower than its fp32 one, see docs/runtime.md)."""

from __future__ import annotations

import functools

from .cache import machine_identity

BF16_MATMUL_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
"""Flags of bf16 dot-product instructions: x86's AVX-512 BF16 and AMX-BF16, Arm's BF16."""


@functools.lru_cache(maxsize=None)
def native_bf16_matmul() -> bool:
    """Whether this CPU has bf16 dot-product instructions."""
    return bool(BF16_MATMUL_FLAGS & set(machine_identity().split()))


def fast_matmul_precision() -> str:
    """``"bf16"`` where :func:`native_bf16_matmul`, else ``"fp32"``."""
    return "bf16" if native_bf16_matmul() else "fp32"
