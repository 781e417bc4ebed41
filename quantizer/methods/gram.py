"""C = beta * C + alpha * x^T x for rows x into an fp32 C, for GPTQ's Hessians. For bf16 rows
every product is exact and the sums are fp32 whichever kernel runs, so the kernels differ only
in the order of the sums:

- int4q's own (``int4q_native::gram_bf16``, AVX-512 BF16), which computes only the tiles on and
  above the diagonal;
- MKL's bf16 GEMM with an fp32 result (``cblas_gemm_bf16bf16f32``) where the torch build ships it;
- x in fp32 and ATen's fp32 GEMM (any other dtype too).

Whichever runs, C's upper triangle is the result and :func:`mirror_upper` makes the whole of it.
Each accelerated kernel proves itself on first use against the fp32 one; where it fails, one
warning names the fallback."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_kernels: dict[str, object] = {}  # name -> the checked kernel, or None once found unusable


def add_gram(C: torch.Tensor, x: torch.Tensor, alpha: float, beta: float) -> None:
    """C [K, K] fp32 becomes beta * C + alpha * x^T x, x [m, K], m > 0, on and above the diagonal;
    its lower triangle is then stale or off by rounding (a full GEMM need not round C[i, j] as
    C[j, i]) until :func:`mirror_upper`."""
    if x.dtype == torch.bfloat16 and C.device.type == "cpu" and C.is_contiguous():
        native = _kernel("native", _find_native)
        if native is not None:
            native(C, x, alpha, beta)
            return
        mkl = _kernel("mkl", _find_mkl)
        if mkl is not None:
            mkl(C, x, alpha, beta)
            return
    x = x.to(torch.float32)
    C.mul_(beta).addmm_(x.t(), x, alpha=alpha)


def mirror_upper(C: torch.Tensor, block: int = 512) -> None:
    """C's lower triangle becomes the mirror of its upper one, in place (a block of rows at a time)."""
    for i in range(0, C.shape[0], block):
        C[i:i + block, :i] = C[:i, i:i + block].t()
        d = C[i:i + block, i:i + block]
        d.copy_(d.triu() + d.triu(1).t())


def _kernel(name: str, find):
    if name not in _kernels:
        _kernels[name] = _checked(name, find())
    return _kernels[name]


def _find_native():
    from ..native.library import load_unless_off, ops

    library = load_unless_off(ops, "GPTQ's Hessians from MKL or ATen's fp32 GEMM", "Reinstall int4q")
    if library is None or not library.gram_available():
        return None

    def native(C, x, alpha, beta):
        library.gram_bf16(C, x.contiguous(), alpha, beta)
    return native


def _find_mkl():
    try:
        fn = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")).cblas_gemm_bf16bf16f32
    except (OSError, AttributeError):
        return None
    fn.restype = None
    fn.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                        ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]

    def mkl(C, x, alpha, beta):
        x = x.contiguous()
        m, k = x.shape
        fn(_ROW_MAJOR, _TRANS, _NO_TRANS, k, k, m, ctypes.c_float(alpha), ctypes.c_void_p(x.data_ptr()), k,
           ctypes.c_void_p(x.data_ptr()), k, ctypes.c_float(beta), ctypes.c_void_p(C.data_ptr()), k)
    return mkl


def _checked(name: str, kernel):
    """``kernel`` where it computes known Grams (upper triangles compared), else None after one
    warning. The shapes cover partial tiles and panels, an odd row count and several chunks."""
    if kernel is None:
        return None
    g = torch.Generator().manual_seed(0)
    for m, k in ((1, 1), (67, 45), (301, 100)):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        C = torch.randn(k, k, generator=g)
        expected = (0.5 * C.double() + 0.25 * (x.double().t() @ x.double())).triu()
        kernel(C, x, 0.25, 0.5)
        if not torch.allclose(C.double().triu(), expected, rtol=1e-5, atol=1e-5):
            log.warning("the %s bf16 Gram kernel gives wrong results here and is not used; GPTQ's Hessians "
                        "take the next kernel (slower)", name)
            return None
    return kernel
