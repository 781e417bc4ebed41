"""C = beta * C + alpha * x^T x for bf16 rows x into an fp32 C, with every product exact and the
sums in fp32: MKL's bf16 GEMM with an fp32 result (``cblas_gemm_bf16bf16f32``) where the torch
build ships it, which runs at the bf16 rate; elsewhere x in fp32 and torch's fp32 GEMM, the same
values up to the order of the sums. The MKL path proves itself on first use against the fp32
one, and one warning names the fallback where it fails."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_kernel: list = []  # the checked MKL function, or None once it was found unusable


def add_gram(C: torch.Tensor, x: torch.Tensor, alpha: float, beta: float) -> None:
    """C [K, K] fp32 (contiguous, CPU or not) becomes beta * C + alpha * x^T x, x [m, K]."""
    if x.dtype == torch.bfloat16 and C.device.type == "cpu" and C.is_contiguous():
        fn = _mkl_gemm()
        if fn is not None:
            _call(fn, C, x.contiguous(), alpha, beta)
            return
    x = x.to(torch.float32)
    C.mul_(beta).addmm_(x.t(), x, alpha=alpha)


def _call(fn, C: torch.Tensor, x: torch.Tensor, alpha: float, beta: float) -> None:
    m, k = x.shape
    fn(_ROW_MAJOR, _TRANS, _NO_TRANS, k, k, m, ctypes.c_float(alpha), ctypes.c_void_p(x.data_ptr()), k,
       ctypes.c_void_p(x.data_ptr()), k, ctypes.c_float(beta), ctypes.c_void_p(C.data_ptr()), k)


def _mkl_gemm():
    if not _kernel:
        _kernel.append(_checked(_find()))
    return _kernel[0]


def _find():
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        fn = ctypes.CDLL(str(library)).cblas_gemm_bf16bf16f32
    except (OSError, AttributeError):
        return None
    fn.restype = None
    fn.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                        ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    return fn


def _checked(fn):
    """``fn`` where it computes a known x^T x, else None after one warning."""
    if fn is None:
        return None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(67, 45, generator=g).to(torch.bfloat16)
    C = torch.randn(45, 45, generator=g)
    expected = 0.5 * C + 0.25 * (x.float().t() @ x.float())
    _call(fn, C, x, 0.25, 0.5)
    if not torch.allclose(C, expected, rtol=1e-5, atol=1e-5):
        log.warning("MKL's bf16 GEMM gave wrong results here; GPTQ's Hessians are accumulated in fp32 (slower)")
        return None
    return fn
