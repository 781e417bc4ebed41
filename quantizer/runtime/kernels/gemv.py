"""The decode matmul of a few rows: ``torch.ops.int4q_native.gemv`` (``csrc/int4_gemv.c`` with the
operator registration of ``csrc/int4_ops.cpp``), faster than PyTorch's tinygemm on the same
weights (docs/runtime.md), each row's result the one it has alone (so batched decode gives each
sequence what it gets decoded by itself).

It is a PyTorch operator, not a ctypes call, because a compiled decode step calls it 100+ times a
token: from C++ through the dispatcher it costs a few microseconds, from Python more than it
saves. It is checked against the exact product when first used. Where the library cannot be
loaded or trusted (or the CPU lacks AVX-512 VBMI and BF16), decode uses tinygemm: after one
warning, or silently where the CPU is the reason or ``INT4Q_NATIVE=0``. The same library holds
``mean_square``, the compiled step's RMSNorm variance, on every CPU (see :func:`has_mean_square`).
"""

from __future__ import annotations

import torch

from ...native.build import NativeUnavailable
from ...native.cache import machine_identity
from ...native.constant import constant_result
from ...native.library import load_unless_off, native_off, ops
from .dequant import SELF_TEST_GROUP, self_test_weight, supports

CPU_FEATURES = {"avx512f", "avx512bw", "avx512vbmi", "avx512_bf16"}
"""The kernel's instructions, as /proc/cpuinfo names them."""

_choice: list[bool] = []  # has_gemv's answer, once decided
_mean_square: list[bool] = []  # has_mean_square's answer, once decided


def load() -> bool:
    """Load the library and check the operator; whether it can be used here."""
    if not CPU_FEATURES <= set(machine_identity().split()):
        return False
    if not ops().gemv_available():
        return False
    self_test()
    return True


def self_test() -> None:
    """Raise NativeUnavailable unless the operator is the exact product up to rounding on a seeded weight."""
    check_product("gemv", lambda x, weight: torch.ops.int4q_native.gemv(x, *weight[3:], SELF_TEST_GROUP),
                  SELF_TEST_ROWS)


SELF_TEST_ROWS = 5
"""Rows of the load-time check of ``gemv``: a whole pass of four rows over the weight and one more."""


def check_product(operator: str, product, rows: int = 1) -> None:
    """Raise NativeUnavailable unless ``product(x, weight)`` is x times the weight's transpose up to
    rounding, for seeded rows x [rows, K] and :func:`.dequant.self_test_weight`'s weight (codes,
    scale, zero, int4pack, sz) at group :data:`.dequant.SELF_TEST_GROUP`."""
    gen = torch.Generator().manual_seed(0)
    weight = self_test_weight(gen)
    codes, scale, zero = weight[:3]
    x = torch.randn(rows, codes.shape[1], generator=gen).to(torch.bfloat16)
    if not within_rounding(product(x, weight), x, codes, scale, zero):
        raise NativeUnavailable(f"int4q_native::{operator} is off by more than rounding on this machine")


MEAN_SQUARE_WIDTHS = (1, 7, 64, 100, 128, 576, 896, 960, 1536, 2048, 2560, 3584, 4096, 5120, 8192, 16384)
"""Row widths the load-time check covers: every branch of the summation order, hidden sizes of
common models, and widths whose cascade reaches its second and third levels."""


@constant_result
def has_mean_square() -> bool:
    """Whether ``int4q_native.mean_square`` is loaded here (a constant to torch.compile), with its own
    summation where that is eager's bit for bit (see :func:`mean_square_is_eagers`). Silent where
    it is not: the kernels that need the library already say why it cannot load."""
    if not _mean_square:
        _mean_square.append(_load_mean_square())
    return _mean_square[0]


def _load_mean_square() -> bool:
    if native_off():
        return False
    try:
        library = ops()
    except NativeUnavailable:
        return False
    library.use_own_mean_square(True)
    library.use_own_mean_square(mean_square_is_eagers())
    return True


def mean_square_is_eagers() -> bool:
    """Whether the operator's own summation gives ``x.pow(2).mean(-1, keepdim=True)`` bit for bit
    here (torch's sum kernel could change with its version or CPU); where not, it uses ATen's."""
    library = torch.ops.int4q_native
    gen = torch.Generator().manual_seed(0)
    for width in MEAN_SQUARE_WIDTHS:
        x = torch.randn(3, width, generator=gen) * torch.logspace(-3, 3, 3).unsqueeze(1)
        if not torch.equal(library.mean_square(x), x.pow(2).mean(-1, keepdim=True)):
            return False
    return True


def within_rounding(got: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                    zero: torch.Tensor) -> bool:
    """Whether a product ``got`` [M, N] is the exact x @ W^T (W from codes [N, K], scale and
    zero [N, G]) up to its bf16 rounding plus fp32 accumulation error (sums of magnitudes up to
    136 |x| |scale| per term, see int4_gemv.c)."""
    group_size = codes.shape[1] // scale.shape[1]
    s = scale.double().repeat_interleave(group_size, 1)
    w = (codes.double() - 8) * s + zero.double().repeat_interleave(group_size, 1)
    exact = x.double() @ w.t()
    magnitude = x.double().abs() @ (w.abs() + 136 * s.abs()).t()
    return bool(((got.double() - exact).abs() <= exact.abs() * 2**-8 + magnitude * 2**-16).all())


@constant_result
def has_gemv() -> bool:
    """Whether this process decodes through the operator (a constant to torch.compile)."""
    if not _choice:
        _choice.append(_decide())
    return _choice[0]


def _decide() -> bool:
    return bool(load_unless_off(load, "decode uses PyTorch's tinygemm", "Set CXX to a working C++ compiler"))


def int4pack_mm(x: torch.Tensor, int4pack: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
    """x bf16 [M, K] times the weight's transpose -> [M, N], the decode path: the operator where it
    is available and reads the weight, else tinygemm."""
    if group_size % 2 == 0 and supports(int4pack, group_size) and has_gemv():
        return torch.ops.int4q_native.gemv(x, int4pack, sz, group_size)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), int4pack, group_size, sz)
