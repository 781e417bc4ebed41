"""The one-row decode matmul from the checkpoint's own row-major layout,
``torch.ops.int4q_native.gemv_rows`` (``csrc/int4_gemv_rows.c``, AVX2 and FMA): the decode path of
a CPU whose tinygemm layout int4q does not decode (AVX2 without AVX-512), where the int4 linears
keep their row-major tensors anyway (see :class:`..nn.int4.Int4Linear`).

It is checked against the exact product when first used; where the library cannot be loaded or
trusted, decode uses PyTorch's tinygemm after one warning (silently with ``INT4Q_NATIVE=0``, or
where the CPU lacks AVX2 and FMA).
"""

from __future__ import annotations

import torch

from ...formats.packing import pack_nibbles
from ...native.cache import machine_identity
from ...native.constant import constant_result
from ...native.library import load_unless_off, ops
from .dequant import SELF_TEST_GROUP
from .gemv import check_product, has_gemv, int4pack_mm

CPU_FEATURES = {"avx2", "fma"}
"""The kernel's instructions, as /proc/cpuinfo names them."""
GROUP_MULTIPLE = 16
"""Group sizes the kernel reads: multiples of this (one vector step is 16 codes)."""

_choice: list[bool] = []  # has_gemv_rows's answer, once decided


def load() -> bool:
    """Load the library and check the operator; whether it can be used here."""
    if not CPU_FEATURES <= set(machine_identity().split()):
        return False
    ops()
    self_test()
    return True


def self_test() -> None:
    """Raise NativeUnavailable unless the operator is the exact product up to rounding on a seeded weight."""
    check_product("gemv_rows", lambda x, weight: torch.ops.int4q_native.gemv_rows(
        x, pack_nibbles(weight[0]), *weight[1:3], SELF_TEST_GROUP))


@constant_result
def has_gemv_rows() -> bool:
    """Whether this process decodes one row through the operator (a constant to torch.compile)."""
    if not _choice:
        fix = "Set CXX to a working C++ compiler"
        _choice.append(bool(load_unless_off(load, "decode uses PyTorch's tinygemm", fix)))
    return _choice[0]


def gemv_rows_usable(group_size: int) -> bool:
    """Whether the operator reads a weight of this group size on this machine."""
    return group_size % GROUP_MULTIPLE == 0 and has_gemv_rows()


def decode_matmul(x: torch.Tensor, int4pack: torch.Tensor, sz: torch.Tensor, group_size: int,
                  row_major: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x bf16 [M, K] times the weight's transpose -> bf16 [M, N], the decode path: for one row the
    AVX-512 GEMV where this CPU has it, else the row-major operator where ``row_major`` (packed
    uint8 [N, K/2], scale and zero bf16 [N, K/group]) is given and it is usable, else
    :func:`.gemv.int4pack_mm`."""
    if row_major is not None and x.shape[0] == 1 and not has_gemv() and gemv_rows_usable(group_size):
        return torch.ops.int4q_native.gemv_rows(x, *row_major, group_size)
    return int4pack_mm(x, int4pack, sz, group_size)
