"""The quantized linears' prefill GEMM (quantizer.runtime.nn.gemm) and the CPU facts it reads
(quantizer.native.cpu)."""

import torch
import torch.nn.functional as F

from quantizer.native import cpu
from quantizer.native.cache import machine_identity
from quantizer.runtime.nn import gemm


def operands(m=37, k=320, n=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen).to(torch.bfloat16),
            (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16))


def test_bf16_dot_products_are_read_from_the_cpus_flags():
    flags = set(machine_identity().split())
    assert cpu.native_bf16_matmul() is bool(flags & cpu.BF16_MATMUL_FLAGS)
    assert cpu.fast_matmul_precision() == ("bf16" if cpu.native_bf16_matmul() else "fp32")


def test_with_bf16_dot_products_the_prefill_gemm_is_onednns_bf16_one(monkeypatch):
    monkeypatch.setattr(cpu, "native_bf16_matmul", lambda: True)
    x, w = operands()
    assert torch.equal(gemm.prefill_linear(x, w), F.linear(x, w))


def test_without_them_it_multiplies_the_same_values_in_fp32_and_rounds_to_bf16(monkeypatch):
    monkeypatch.setattr(cpu, "native_bf16_matmul", lambda: False)
    x, w = operands(seed=1)
    got = gemm.prefill_linear(x, w)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, F.linear(x.float(), w.float()).to(torch.bfloat16))
    exact = x.double() @ w.double().t()
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()  # one bf16 rounding of an fp32 sum


