"""One query's fp32 attention over the bf16 cache (decode_attention.c as
torch.ops.int4q_native.attend_one, quantizer.runtime.kernels.attention): the int8 decode step's attention."""

import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_refused_off_by, at_thread_counts, vector_level
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.native.build import NativeUnavailable
from quantizer.runtime.decode.decoder import attend_in_fp32
from quantizer.runtime.kernels import attention


@pytest.fixture(scope="module")
def operator():
    if not attention.has_attend_one():
        pytest.skip("int4q's library cannot load here: the int8 step attends through PyTorch's fp32 attention")
    return torch.ops.int4q_native.attend_one


def problem(heads: int, kv_heads: int, dim: int, length: int, seed: int, magnitude: float = 2.0, spare: int = 5):
    """q bf16 [1, H, 1, D] and k, v as views of the first ``length`` positions of longer caches. Seeded."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, heads, 1, dim, generator=gen) * magnitude).to(torch.bfloat16)
    k, v = ((torch.randn(1, kv_heads, length + spare, dim, generator=gen) * magnitude).to(torch.bfloat16)[:, :, :length]
            for _ in range(2))
    return q, k, v


def test_the_reference_is_pytorchs_grouped_attention_in_float64():
    q, k, v = problem(6, 2, 16, 9, seed=0)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.3, enable_gqa=True)
    assert torch.allclose(attention.reference(q, k, v, 0.3), want.transpose(1, 2).reshape(1, 1, -1), rtol=1e-12)


@settings(max_examples=120, deadline=None)
@given(kv_heads=st.integers(1, 4), group=st.integers(1, 8), dim=st.sampled_from([8, 12, 64, 80, 96, 128, 256]),
       length=st.integers(1, 600), seed=st.integers(0, 2**31 - 1), magnitude=st.sampled_from([0.01, 1.0, 8.0]),
       level=st.sampled_from([0, 1, 2]))
def test_attend_one_is_the_exact_attention_up_to_rounding(operator, kv_heads, group, dim, length, seed, magnitude,
                                                          level):
    """On every vector path (level: plain C, AVX2, AVX-512 BF16 where the CPU has them); lengths
    across several 256-position parts, groups across several 6-head value tiles."""
    q, k, v = problem(kv_heads * group, kv_heads, dim, length, seed, magnitude)
    with vector_level(level):
        got = operator(q, k, v, dim**-0.5)
    assert got.shape == (1, 1, kv_heads * group * dim) and got.dtype == torch.bfloat16
    assert attention.within_rounding(got, q, k, v, dim**-0.5)


@pytest.mark.parametrize("dim", [8, 64])
def test_scores_far_below_the_largest_weigh_nothing(operator, dim):
    q, k, v = problem(2, 1, dim, 300, seed=1)
    k[:, :, 0] = q[:, 0, 0] * 30  # one key dominates: the others' exponents are below -87
    got = operator(q, k, v, 1.0)
    assert attention.within_rounding(got, q, k, v, 1.0)
    assert torch.equal(got[0, 0, :dim], v[0, 0, 0])


@pytest.mark.parametrize("dim", [64, 80])  # the AVX-512 BF16 path where the CPU has it, and AVX2's
def test_it_does_not_depend_on_the_thread_count(operator, dim):
    q, k, v = problem(16, 4, dim, 900, seed=2)  # long enough for several parts
    outs = at_thread_counts(lambda: operator(q, k, v, 0.125))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_wrong_inputs_are_refused_with_a_message(operator):
    q, k, v = problem(4, 2, 16, 5, seed=3)
    for args, message in [((q.float(), k, v, 0.5), "must be bf16"),
                          ((q, k[:, :1], v, 0.5), "H % Hkv == 0"),
                          ((q, k, v[:, :, :3], 0.5), "D contiguous"),
                          ((q, k[:, :, :0], v[:, :, :0], 0.5), "L > 0"),
                          ((q, k.transpose(2, 3), v, 0.5), "D contiguous")]:
        with pytest.raises(RuntimeError, match=message):
            operator(*args)


def test_int8_decodes_one_query_through_the_operator(operator):
    q, k, v = problem(6, 2, 64, 30, seed=4)
    assert torch.equal(attend_in_fp32(q, k, v, 29, 0.125), operator(q, k, v, 0.125))
    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(str(graph_module.graph))
        return graph_module.forward

    step = torch.compile(lambda a, b, c: attend_in_fp32(a, b, c, 29, 0.125), backend=record, fullgraph=True)
    assert torch.equal(step(q, k, v), operator(q, k, v, 0.125))
    assert len(graphs) == 1 and "int4q_native.attend_one" in graphs[0]


def test_an_operator_off_by_more_than_rounding_is_not_used(operator, monkeypatch):
    assert_refused_off_by(monkeypatch, "attend_one", attention.self_test, 1.02)


def test_an_operator_failing_its_check_warns_once_and_leaves_pytorchs_attention(operator, monkeypatch, caplog):
    monkeypatch.setattr(attention, "_choice", [])

    def off():
        raise NativeUnavailable("int4q_native::attend_one is off by more than rounding on this machine")

    monkeypatch.setattr(attention, "self_test", off)
    with caplog.at_level(logging.WARNING):
        assert not any(attention.has_attend_one() for _ in range(3))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "PyTorch's fp32 attention" in warnings[0] and "\n" not in warnings[0]
