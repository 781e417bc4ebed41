"""The int8-activation matmul from the checkpoint's own row-major layout,
``torch.ops.int4q_native.w4a8_rows`` (``csrc/int4_w4a8_rows.c``, AVX2): the int8 path of up to
:data:`ROWS_LIMIT` rows (decode, batched decode, short prompts) on a CPU without AVX-512, where the
int4 linears keep their row-major tensors (see :class:`..nn.int4.Int4Linear`). It rounds
activations exactly as :mod:`.w4a8` does, so :func:`.w4a8.reference` is its arithmetic too, and it
is checked against it when first used.

Where the CPU lacks AVX2 and FMA, or the library cannot be loaded or trusted, those rows take the
exact path, after one warning where the user asked for int8.
"""

from __future__ import annotations

import torch

from ...formats.packing import pack_nibbles
from ...native.build import NativeUnavailable
from ...native.cache import machine_identity
from ...native.constant import constant_result
from ...native.library import load_unless_off, ops
from .w4a8 import load_int8_operator, within_rounding

CPU_FEATURES = {"avx2", "fma"}
"""The kernel's instructions, as /proc/cpuinfo names them."""
ROWS_LIMIT = 64
"""The most rows the int4 linears send through it: it reads the weight once per row, so past some
rows the GEMM over the dequantized weight wins (docs/runtime.md, CPUs without AVX-512)."""
SELF_TEST_SHAPES = ((1, 64), (7, 64), (3, 32))
"""(rows, group size) of the load-time check: one row, several, and the two-groups-a-step path."""

_choice: list[bool] = []  # has_w4a8_rows's answer, once decided


def reads_group(k: int, group_size: int) -> bool:
    """Whether the kernel reads a weight of K columns at this group size: one 32-byte step spans a
    group of a multiple of 64 codes, or two groups of 32."""
    return k % group_size == 0 and (group_size % 64 == 0 or (group_size == 32 and k % 64 == 0))


def load() -> bool:
    """:func:`.w4a8.load_int8_operator` for ``w4a8_rows``."""
    return load_int8_operator(CPU_FEATURES <= set(machine_identity().split()), "AVX2 and FMA", ops,
                              "w4a8_rows_available", self_test)


def self_test() -> None:
    """Raise NativeUnavailable unless the operator equals :func:`.w4a8.reference` up to rounding on
    seeded weights, for each of :data:`SELF_TEST_SHAPES`."""
    gen = torch.Generator().manual_seed(0)
    n, k = 72, 256  # channels: whole passes of the kernel and a remainder
    for rows, group_size in SELF_TEST_SHAPES:
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        scale = torch.rand(n, k // group_size, generator=gen).to(torch.bfloat16)
        zero = torch.randn(n, k // group_size, generator=gen).to(torch.bfloat16)
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        got = torch.ops.int4q_native.w4a8_rows(x, pack_nibbles(codes), scale, zero, group_size)
        if not within_rounding(got, x, codes, scale, zero):
            raise NativeUnavailable("int4q_native::w4a8_rows is off by more than rounding on this machine")


@constant_result
def has_w4a8_rows() -> bool:
    """Whether this process has the operator (a constant to torch.compile)."""
    if not _choice:
        fix = "Choose exact activations (--decode exact) to skip the int8 path"
        _choice.append(bool(load_unless_off(load, "int8 activations fall back to the exact path", fix)))
    return _choice[0]


def w4a8_rows_usable(packed: torch.Tensor | None, group_size: int) -> bool:
    """Whether the operator reads this row-major weight (packed uint8 [N, K/2], or None where the
    layer keeps no row-major copy) on this machine."""
    return packed is not None and reads_group(packed.shape[1] * 2, group_size) and has_w4a8_rows()
