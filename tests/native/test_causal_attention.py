"""A whole sequence's causal attention (causal_attention.c as
torch.ops.int4q_native.causal_attention, quantizer.native.causal_attention): the
calibration forward's attention."""

import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_refused_off_by, at_thread_counts
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.native import causal_attention as causal
from quantizer.native.build import NativeUnavailable


@pytest.fixture(scope="module")
def operator():
    if not causal.has_causal_attention():
        pytest.skip("int4q's causal attention needs its library and AVX-512 BF16: PyTorch's attention runs instead")
    return torch.ops.int4q_native.causal_attention


def problem(batch: int, heads: int, kv_heads: int, positions: int, dim: int, seed: int, magnitude: float = 2.0):
    """q bf16 [B, H, T, D] as the transposed view models pass, k and v bf16 [B, Hkv, T, D]. Seeded."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(batch, positions, heads, dim, generator=gen) * magnitude).to(torch.bfloat16).transpose(1, 2)
    k, v = ((torch.randn(batch, kv_heads, positions, dim, generator=gen) * magnitude).to(torch.bfloat16)
            for _ in range(2))
    return q, k, v


def test_the_reference_is_pytorchs_causal_grouped_attention_in_float64():
    q, k, v = problem(2, 6, 2, 9, 16, seed=0)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.3, is_causal=True,
                                          enable_gqa=True)
    assert torch.allclose(causal.reference(q, k, v, 0.3), want.transpose(1, 2), rtol=1e-12)


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 5]),
       positions=st.integers(1, 300), dim=st.sampled_from([2, 12, 32, 64, 80, 96, 128, 256]),
       seed=st.integers(0, 2**31 - 1), magnitude=st.sampled_from([0.01, 1.0, 6.0]))
def test_causal_attention_is_the_exact_attention_up_to_rounding(operator, batch, kv_heads, group, positions, dim,
                                                                seed, magnitude):
    q, k, v = problem(batch, kv_heads * group, kv_heads, positions, dim, seed, magnitude)
    got = operator(q, k, v, dim**-0.5)
    assert got.shape == (batch, positions, kv_heads * group, dim) and got.dtype == torch.bfloat16
    assert causal.within_rounding(got, q, k, v, dim**-0.5)


def test_it_is_the_exact_attention_rounded_once_nearly_everywhere_and_closer_than_pytorchs(operator):
    q, k, v = problem(1, 9, 3, 512, 64, seed=1)
    exact = causal.reference(q, k, v, 0.125)
    ours = operator(q, k, v, 0.125).double()
    torchs = F.scaled_dot_product_attention(q, k, v, scale=0.125, is_causal=True, enable_gqa=True).transpose(1, 2)
    assert (ours == exact.to(torch.bfloat16).double()).double().mean() > 0.99
    assert (ours - exact).abs().mean() < 0.95 * (torchs.double() - exact).abs().mean()


def test_no_query_sees_a_later_position(operator):
    q, k, v = problem(1, 2, 1, 100, 16, seed=2)
    before = operator(q, k, v, 0.25)
    k[:, :, 60:], v[:, :, 60:] = k[:, :, 60:] * 3, -v[:, :, 60:]
    after = operator(q, k, v, 0.25)
    assert torch.equal(before[:, :60], after[:, :60]) and not torch.equal(before[:, 60:], after[:, 60:])


def test_scores_far_below_the_largest_weigh_nothing(operator):
    q, k, v = problem(1, 1, 1, 40, 8, seed=3)
    k[0, 0, 0] = q[0, 0, 39] * 30  # the last query's first key dominates: its others' exponents are below -87
    got = operator(q, k, v, 1.0)
    assert causal.within_rounding(got, q, k, v, 1.0)
    assert torch.equal(got[0, 39, 0], v[0, 0, 0])


def test_it_does_not_depend_on_the_thread_count(operator):
    q, k, v = problem(2, 8, 2, 333, 64, seed=4)
    outs = at_thread_counts(lambda: operator(q, k, v, 0.125))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_strided_or_oddly_placed_inputs_give_what_contiguous_ones_do(operator):
    q, k, v = problem(1, 4, 2, 70, 32, seed=5)
    wide_k, wide_v = (torch.cat([t, t], dim=-1)[..., :32] for t in (k, v))
    odd_q = torch.cat([q, q], dim=-1)[..., 1:33]  # each query row starts at an odd element
    want = operator(q.contiguous(), k, v, 0.2)
    assert torch.equal(operator(q, wide_k, wide_v, 0.2), want)
    assert torch.equal(operator(odd_q, k, v, 0.2), operator(odd_q.contiguous(), k, v, 0.2))


def test_wrong_inputs_are_refused_with_a_message(operator):
    q, k, v = problem(1, 4, 2, 5, 16, seed=6)
    for args, message in [((q.float(), k, v, 0.5), "must be bf16"),
                          ((q, k[:, :1].expand(1, 3, 5, 16), v[:, :1].expand(1, 3, 5, 16), 0.5), "H % Hkv == 0"),
                          ((q, k, v[:, :, :3], 0.5), "T > 0"),
                          ((q[..., :15], k[..., :15], v[..., :15], 0.5), "D even"),
                          ((q, k, v, -1.0), "positive scale")]:
        with pytest.raises(RuntimeError, match=message):
            operator(*args)


def test_an_operator_off_by_more_than_rounding_is_not_used(operator, monkeypatch):
    assert_refused_off_by(monkeypatch, "causal_attention", causal.self_test, 1.02)


def test_an_operator_failing_its_check_warns_once_and_leaves_pytorchs_attention(operator, monkeypatch, caplog):
    monkeypatch.setattr(causal, "_choice", [])

    def off():
        raise NativeUnavailable("int4q_native::causal_attention is off by more than rounding on this machine")

    monkeypatch.setattr(causal, "self_test", off)
    with caplog.at_level(logging.WARNING):
        assert not any(causal.has_causal_attention() for _ in range(3))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "PyTorch's" in warnings[0] and "\n" not in warnings[0]
