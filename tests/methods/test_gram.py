"""x^T x of bf16 rows into an fp32 accumulator: exact products, fp32 sums, whichever kernel runs."""

import logging

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from quantizer.methods import gram
from quantizer.methods.gptq import HessianAccumulator

KERNELS = {"native": gram._find_native, "mkl": gram._find_mkl}


def reference(C, x, alpha, beta):
    return beta * C.double() + alpha * (x.double().t() @ x.double())


@pytest.mark.parametrize("name", KERNELS)
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 1300), k=st.integers(1, 230), alpha=st.floats(0.01, 2), beta=st.floats(0, 1),
       seed=st.integers(0, 2**16))
@example(m=1100, k=200, alpha=1.0, beta=0.5, seed=0)  # two chunks of pairs and two blocks of rows (int4q.h)
def test_each_kernel_gives_the_exact_gram_to_fp32_summation(name, m, k, alpha, beta, seed):
    kernel = KERNELS[name]()
    if kernel is None:
        pytest.skip(f"no {name} kernel on this machine")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    C = torch.randn(k, k, generator=g)
    expected = reference(C, x, alpha, beta)
    kernel(C, x, alpha, beta)
    tolerance = 1e-5 * max(1.0, m ** 0.5)
    assert torch.allclose(C.double().triu(), expected.triu(), rtol=1e-5, atol=tolerance)


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 300), k=st.integers(1, 1100), seed=st.integers(0, 2**16))
def test_the_accumulators_hessian_is_symmetric_and_exact_whatever_the_kernel(m, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    acc = HessianAccumulator(k)
    acc.add(x[: m // 2])
    acc.add(x[m // 2:])
    expected = 2 / m * (x.double().t() @ x.double())
    assert torch.equal(acc.H, acc.H.t())
    assert torch.allclose(acc.H.double(), expected, rtol=1e-5, atol=1e-5)


def test_a_kernel_that_computes_wrongly_is_not_used(caplog):
    with caplog.at_level(logging.WARNING):
        assert gram._checked("broken", lambda C, x, alpha, beta: C.zero_()) is None
    assert "broken" in caplog.text and "not used" in caplog.text
    x = torch.ones(4, 3, dtype=torch.bfloat16)
    C = torch.zeros(3, 3)
    gram.add_gram(C, x, 1.0, 0.0)
    assert torch.equal(C.triu(), torch.full((3, 3), 4.0).triu())
