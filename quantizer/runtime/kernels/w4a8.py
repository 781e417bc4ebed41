"""The int8-activation matmul, ``torch.ops.int4q_native.w4a8_mm`` (``csrc/int4_w4a8.c``): any number
of rows times a 4-bit weight in the tinygemm layout, each row's activations rounded to int8 per
weight group and multiplied in int32 (AVX-512 VNNI).

:func:`reference` is its arithmetic in float64; the operator is checked against it when first used.
Where the CPU lacks AVX-512 VBMI and VNNI, or the library cannot be loaded or trusted, the int4
linears take their exact paths, after one warning where the user asked for int8.
"""

from __future__ import annotations

import torch

from ...native.build import NativeUnavailable
from ...native.cache import machine_identity
from ...native.constant import constant_result
from ...native.library import load_unless_off, ops
from ..activations import chosen_explicitly
from .dequant import SELF_TEST_GROUP, self_test_weight, supports

CPU_FEATURES = {"avx512f", "avx512bw", "avx512vbmi", "avx512_vnni"}
"""The kernel's instructions, as /proc/cpuinfo names them."""
INT8_MAX = 127

_choice: list[bool] = []  # has_w4a8's answer, once decided


def quantize_activations(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes [M, K] int8 in [-127, 127], scale [M, K/group] fp32), per group
    ``codes = rint(x * (127 / max|x|))`` and ``scale = max|x| / 127``: x ≈ codes * scale."""
    m, k = x.shape
    groups = x.float().view(m, k // group_size, group_size)
    top = groups.abs().amax(-1, keepdim=True)
    # a tensor divided (127 / top as the kernel rounds it), not Python's 127 / top: torch takes that as 127 * (1 / top)
    inverse = torch.where(top > 0, torch.full_like(top, INT8_MAX) / top, torch.zeros_like(top))
    codes = torch.round(groups * inverse).to(torch.int8).view(m, k)
    return codes, (top / INT8_MAX).squeeze(-1)


def reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """What the operator computes, in float64 before its bf16 rounding: x bf16 [M, K] with its
    activations rounded as :func:`quantize_activations`, times W = (codes - 8) * scale + zero
    (codes [N, K], scale and zero [N, G]), where the zero term takes the exact x."""
    group_size = codes.shape[1] // scale.shape[1]
    xq, xscale = quantize_activations(x, group_size)
    x_rounded = xq.double() * xscale.double().repeat_interleave(group_size, 1)
    steps = (codes.double() - 8) * scale.double().repeat_interleave(group_size, 1)
    return x_rounded @ steps.t() + x.double() @ zero.double().repeat_interleave(group_size, 1).t()


def within_rounding(got: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                    zero: torch.Tensor) -> bool:
    """Whether ``got`` [M, N] is :func:`reference` up to its bf16 rounding and fp32 accumulation."""
    group_size = codes.shape[1] // scale.shape[1]
    expected = reference(x, codes, scale, zero)
    s = scale.double().abs().repeat_interleave(group_size, 1)
    magnitude = x.double().abs() @ (8 * s + zero.double().abs().repeat_interleave(group_size, 1)).t()
    return bool(((got.double() - expected).abs() <= expected.abs() * 2**-8 + magnitude * 2**-18).all())


def load_int8_operator(has_features: bool, lacking: str, open_library, available: str, check) -> bool:
    """Load the library (``open_library()``) and ``check()`` an int8 operator whose CPU test is
    ``has_features`` and whose library test is the operator named ``available``; NativeUnavailable
    says why it cannot be used. Where int8 is only the default, not the user's choice, a CPU
    without the instructions (``lacking`` names them) or a library that cannot load (the exact
    paths already say so) is a silent False."""
    if not has_features:
        if not chosen_explicitly():
            return False
        raise NativeUnavailable(f"this CPU lacks {lacking}")
    try:
        library = open_library()
    except NativeUnavailable:
        if not chosen_explicitly():
            return False
        raise
    if not getattr(library, available)():
        raise NativeUnavailable("the int8 kernel is limited off on this CPU")
    check()
    return True


def load() -> bool:
    """:func:`load_int8_operator` for ``w4a8_mm``."""
    return load_int8_operator(CPU_FEATURES <= set(machine_identity().split()), "AVX-512 VBMI or VNNI", ops,
                              "w4a8_available", self_test)


def self_test() -> None:
    """Raise NativeUnavailable unless the operator equals :func:`reference` up to rounding on a
    seeded weight, for one row and for a multiple of the kernel's row tiles plus a remainder."""
    gen = torch.Generator().manual_seed(0)
    codes, scale, zero, int4pack, sz = self_test_weight(gen)
    for rows in (1, 7):
        x = torch.randn(rows, codes.shape[1], generator=gen).to(torch.bfloat16)
        if not within_rounding(torch.ops.int4q_native.w4a8_mm(x, int4pack, sz, SELF_TEST_GROUP), x, codes, scale,
                               zero):
            raise NativeUnavailable("int4q_native::w4a8_mm is off by more than rounding on this machine")


@constant_result
def has_w4a8() -> bool:
    """Whether this process has the int8 operator (a constant to torch.compile)."""
    if not _choice:
        fix = "Choose exact activations (--decode exact --prefill exact) to skip the int8 path"
        _choice.append(bool(load_unless_off(load, "int8 activations fall back to the exact path", fix)))
    return _choice[0]


def w4a8_usable(int4pack: torch.Tensor, group_size: int) -> bool:
    """Whether the operator reads this weight (whole 64-channel blocks, groups of a multiple of 4)
    on this machine."""
    return group_size % 4 == 0 and supports(int4pack, group_size) and has_w4a8()
