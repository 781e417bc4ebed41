"""The prefill dequantization, ``torch.ops.int4q_native.dequant_int4pack`` (``csrc/int4_dequant.c``):
the tinygemm layout to a bf16 weight, bit for bit what
:func:`quantizer.formats.packing.dequantize_int4pack` computes, tens of times faster.

The operator takes the best vector path this CPU has; it is checked against the torch reference
when first used. Where the library cannot be loaded or trusted, :func:`dequantize_int4pack` uses
the torch reference after one warning (with ``INT4Q_NATIVE=0``, without one).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from ...formats import packing
from ...native.build import NativeUnavailable
from ...native.library import load_unless_off, ops

LEVELS = {"native": 2, "avx512-exact-tables": 1, "portable": 0}
"""Vector paths the kernel may take (csrc/int4q.h): the runtime uses "native", the best the CPU
has; the others exist to test every path on one machine (no bf16 conversions; no vectors)."""

_buffers = threading.local()


class NativeKernel:
    """The operator limited to one of :data:`LEVELS`. ``simd``: the path it takes on this CPU (0
    portable C, 1 AVX-512, 2 AVX-512 with bf16-rounded tables)."""

    def __init__(self, variant: str = "native"):
        self.variant, self._ops = variant, ops()
        with self._limited():
            self.simd = int(self._ops.dequant_level())

    @contextlib.contextmanager
    def _limited(self):
        previous = self._ops.limit_level(LEVELS[self.variant])
        try:
            yield
        finally:
            self._ops.limit_level(previous)

    def dequantize(self, int4pack: torch.Tensor, sz: torch.Tensor, group_size: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """bf16 weight [N, K] from int4pack uint8 [N, K/2] (N a multiple of 64) and sz bf16 [G, N, 2],
        written into ``out`` (contiguous bf16 [N, K]) when given."""
        n, half = int4pack.shape
        if (not supports(int4pack, group_size) or int4pack.dtype != torch.uint8 or sz.dtype != torch.bfloat16
                or sz.shape != (half * 2 // group_size, n, 2)):
            raise ValueError(f"expected uint8 [N, K/2] (N a multiple of 64) and bf16 [K/group, N, 2], got "
                             f"{int4pack.dtype} {tuple(int4pack.shape)} and {sz.dtype} {tuple(sz.shape)}")
        if out is None:
            out = torch.empty(n, half * 2, dtype=torch.bfloat16)
        elif out.shape != (n, half * 2) or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise ValueError(f"out must be contiguous bf16 {(n, half * 2)}")
        if self.variant == "native":
            self._ops.dequant_int4pack(int4pack, sz, group_size, out)
        else:
            with self._limited():
                self._ops.dequant_int4pack(int4pack, sz, group_size, out)
        return out


def supports(int4pack: torch.Tensor, group_size: int) -> bool:
    """Whether the kernel reads this weight: whole 64-channel blocks, whole groups."""
    n, half = int4pack.shape
    return n % packing.TINYGEMM_N_BLOCK == 0 and n > 0 and (half * 2) % group_size == 0


SELF_TEST_GROUP = 64


def self_test_weight(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """The weight the operators that read this layout (GEMV, W4A8) are checked on when first
    used, drawn from ``gen``: (codes uint8 [128, 256], scale and zero bf16 [128, 4], int4pack,
    sz) at group :data:`SELF_TEST_GROUP`."""
    n, k = 2 * packing.TINYGEMM_N_BLOCK, 256
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // SELF_TEST_GROUP, generator=gen).to(torch.bfloat16)
    zero = torch.randn(n, k // SELF_TEST_GROUP, generator=gen).to(torch.bfloat16)
    return codes, scale, zero, packing.to_int4pack(packing.pack_nibbles(codes)), packing.scales_and_zeros(scale, zero)


def load(variant: str = "native") -> NativeKernel:
    """The kernel on one of :data:`LEVELS`, after a bit-exact check against torch."""
    kernel_ = NativeKernel(variant)
    self_test(kernel_)
    return kernel_


def self_test(kernel_: NativeKernel) -> None:
    """Raise NativeUnavailable unless the kernel equals the torch reference on a seeded weight."""
    gen = torch.Generator().manual_seed(0)
    n, k = 2 * packing.TINYGEMM_N_BLOCK, 256
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    int4pack = packing.to_int4pack(packing.pack_nibbles(codes))
    for group_size in (32, 128):
        scale = torch.randn(n, k // group_size, generator=gen).to(torch.bfloat16)
        scale[0, 0] = 1e-39  # a denormal: its block and group take the exactly rounded tables
        zero = torch.randn(n, k // group_size, generator=gen).to(torch.bfloat16)
        sz = packing.scales_and_zeros(scale, zero)
        if not torch.equal(kernel_.dequantize(int4pack, sz, group_size),
                           packing.dequantize_int4pack(int4pack, sz, group_size)):
            raise NativeUnavailable(f"int4q_native::dequant_int4pack ({kernel_.variant}) disagrees with the torch "
                                    "reference on this machine")


@functools.lru_cache(maxsize=None)
def kernel() -> NativeKernel | None:
    """This process's kernel, or None (after one warning) where it is off or unavailable."""
    return load_unless_off(load, "prefill dequantizes through torch", "Set CXX to a working C++ compiler")


def dequantize_int4pack(int4pack: torch.Tensor, sz: torch.Tensor, group_size: int,
                        transient: bool = False) -> torch.Tensor:
    """bf16 weight [N, K] from the kernel layout: the native kernel where it applies, else torch's.

    ``transient``: the caller is done with the result before the next transient call, so inside
    :func:`shared_weight_buffer` it may live in that shared buffer.
    """
    native = kernel() if supports(int4pack, group_size) else None
    if native is None:
        return packing.dequantize_int4pack(int4pack, sz, group_size)
    n, half = int4pack.shape
    buffer = _shared_buffer(n * half * 2) if transient else None
    return native.dequantize(int4pack, sz, group_size, None if buffer is None else buffer.view(n, half * 2))


@contextlib.contextmanager
def shared_weight_buffer():
    """Within (on this thread), transient dequantized weights share one buffer, grown to the largest
    layer, instead of fresh pages per layer: a prefill faults in new memory for its largest layer
    once, not for every layer. The buffer is freed on exit."""
    previous = getattr(_buffers, "weight", None)
    _buffers.weight = torch.empty(0, dtype=torch.bfloat16)
    try:
        yield
    finally:
        _buffers.weight = previous


def _shared_buffer(numel: int) -> torch.Tensor | None:
    buffer = getattr(_buffers, "weight", None)
    if buffer is None:
        return None
    if buffer.numel() < numel:
        buffer = _buffers.weight = torch.empty(numel, dtype=torch.bfloat16)
    return buffer[:numel]
