import torch
from gptq_reference import reference_inverse_cholesky
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.methods import hessian_factor
from quantizer.methods.hessian_factor import factorize


def hessian(k, seed, rows=None, dead=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows or k + 8, k, generator=g) @ (torch.randn(k, k, generator=g) * 0.2 + torch.eye(k))
    x[:, :dead] = 0
    x = x.double()
    return (2 / x.shape[0] * x.t() @ x).float()


@settings(max_examples=25, deadline=None)
@given(k=st.integers(1, 300), seed=st.integers(0, 2**16), damp=st.sampled_from([0.01, 0.1]),
       act_order=st.booleans(), dead=st.integers(0, 3))
def test_the_factor_is_the_damped_hessians_lower_cholesky_factor_in_visiting_order(k, seed, damp, act_order, dead):
    H = hessian(k, seed, dead=dead)
    f = factorize(H, damp, act_order)
    R = f.feedback.t().double() * f.diagonal.double().unsqueeze(1)
    expected = H.double().clone()
    expected.diagonal()[f.dead] = 1.0
    expected.diagonal().add_(f.ridge)
    expected = expected[f.perm][:, f.perm]
    assert torch.equal(f.feedback, f.feedback.triu())
    assert torch.allclose(f.feedback.diagonal(), torch.ones(k))
    assert torch.allclose(R.t() @ R, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    if act_order:
        diag = torch.diag(H).masked_fill(f.dead, 1.0)
        assert torch.all(diag[f.perm][:-1] >= diag[f.perm][1:])


@settings(max_examples=25, deadline=None)
@given(k=st.integers(2, 400), seed=st.integers(0, 2**16), damp=st.sampled_from([0.01, 0.1]),
       cut=st.floats(0, 1), width=st.integers(1, 130))
def test_a_blocks_inverse_factor_is_that_block_of_the_papers_inverse_hessian_factor(k, seed, damp, cut, width):
    H = hessian(k, seed)
    i1 = int(cut * (k - 1))
    i2 = min(k, i1 + width)
    C, U1 = factorize(H, damp, act_order=False).block(i1, i2)
    reference = reference_inverse_cholesky(H.double(), damp)[i1:i2, i1:i2].float()
    assert torch.equal(C, C.tril()) and torch.equal(U1, U1.triu()) and U1.is_contiguous()
    assert torch.allclose(U1, reference, rtol=1e-3, atol=1e-4 * reference.abs().max().item())


def test_an_indefinite_hessian_is_retried_with_ten_times_the_damping():
    H = torch.diag(torch.tensor([1.0, 1.0, -0.05]))
    f = factorize(H, 0.01, act_order=False)
    assert f.info.retries == 1 and f.info.damp == 0.1


@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 40), block=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_a_flip_in_place_is_the_flip(k, block, seed):
    M = torch.randn(k, k, generator=torch.Generator().manual_seed(seed))
    expected = M.flip(0, 1)
    assert torch.equal(hessian_factor.flip_in_place(M, block), expected)


@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 40), block=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_a_transpose_in_place_is_the_transpose(k, block, seed):
    M = torch.randn(k, k, generator=torch.Generator().manual_seed(seed))
    expected = M.t().clone()
    assert torch.equal(hessian_factor.transpose_in_place(M, block), expected)
