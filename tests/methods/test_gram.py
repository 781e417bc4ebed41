"""x^T x of bf16 rows into an fp32 accumulator: exact products, fp32 sums, whichever kernel runs."""

import logging

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.methods import gram


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 300), k=st.integers(1, 200), alpha=st.floats(0.01, 2), beta=st.floats(0, 1),
       seed=st.integers(0, 2**16))
def test_gram_of_bf16_rows_is_the_fp32_gram_of_their_values(m, k, alpha, beta, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    C = torch.randn(k, k, generator=g)
    expected = beta * C.double() + alpha * (x.double().t() @ x.double())
    gram.add_gram(C, x, alpha, beta)
    assert torch.allclose(C.double(), expected, rtol=1e-5, atol=1e-5 * max(1.0, m ** 0.5))


def test_a_kernel_that_computes_wrongly_is_not_used(monkeypatch, caplog):
    monkeypatch.setattr(gram, "_kernel", [])
    monkeypatch.setattr(gram, "_call", lambda fn, C, x, alpha, beta: C.zero_())
    with caplog.at_level(logging.WARNING):
        assert gram._mkl_gemm() is None or gram._find() is None
    assert gram._find() is None or "fp32" in caplog.text
    x = torch.ones(4, 3, dtype=torch.bfloat16)
    C = torch.zeros(3, 3)
    gram.add_gram(C, x, 1.0, 0.0)
    assert torch.equal(C, torch.full((3, 3), 4.0))
