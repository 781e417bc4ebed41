"""The int8 KV cache (csrc/decode_attention_int8.c and kv_int8_ops.cpp as torch.ops.int4q_native.store_kv_int8
and attend_one_int8, quantizer.runtime.kernels.kv_int8): rows stored to int8 within half a step, and one
query's attention over them equal to the exact attention over what is stored, up to rounding."""

import pytest
import torch
from conftest import assert_refused_off_by, at_thread_counts, vector_level
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.runtime.kernels import kv_int8
from quantizer.runtime.kernels.attention import reference, within_rounding
from quantizer.runtime.kernels.kv_int8 import Int8Cache, rounded_query, rows, store_and_attend


@pytest.fixture(scope="module", autouse=True)
def library():
    if not kv_int8.has_int8_cache():
        pytest.skip("int4q's library cannot load here: no int8 KV cache")


def rows_of(kv_heads: int, length: int, dim: int, seed: int, magnitude: float = 2.0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(1, kv_heads, length, dim, generator=gen) * magnitude).to(torch.bfloat16)
                 for _ in range(2))


def filled(k: torch.Tensor, v: torch.Tensor, split: int = 0) -> Int8Cache:
    """A cache holding k and v, stored in two calls (positions before ``split``, then the rest)."""
    cache = Int8Cache.empty(k.shape[1], k.shape[2] + 5, k.shape[3])
    cache.store(k[:, :, :split], v[:, :, :split], 0)
    cache.store(k[:, :, split:], v[:, :, split:], split)
    return cache


def largest_per_block(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block's largest magnitude, blocks of ``block`` along the last dimension."""
    blocks = x.abs().unflatten(-1, (-1, block)).amax(-1, keepdim=True)
    return blocks.expand(*blocks.shape[:-1], block).flatten(-2)


@settings(max_examples=60, deadline=None)
@given(kv_heads=st.integers(1, 3), length=st.integers(1, 70), dim=st.sampled_from([32, 64, 96, 128]),
       split=st.integers(0, 70), seed=st.integers(0, 2**31 - 1), magnitude=st.sampled_from([1e-3, 1.0, 300.0]))
def test_stored_rows_read_back_within_half_a_step_of_their_scale(kv_heads, length, dim, split, seed, magnitude):
    """Values per row, keys per block of KEY_DIMS dimensions."""
    k, v = rows_of(kv_heads, length, dim, seed, magnitude)
    got_k, got_v = rows(filled(k, v, min(split, length)), length)
    for got, want, block in ((got_k, k.float(), kv_int8.KEY_DIMS), (got_v, v.float(), dim)):
        largest = largest_per_block(want, block)
        assert ((got - want).abs() <= largest / 254 + want.abs() * 2**-22).all()  # and the fp32 product's rounding
        assert torch.equal(largest_per_block(got, block), largest)  # each block's largest magnitude is exact


def test_a_key_channel_far_larger_than_the_rest_leaves_the_other_blocks_their_levels():
    k, v = rows_of(1, 4, 64, seed=13)
    k[..., 0] = 1000
    got_k, _ = rows(filled(k, v), 4)
    assert ((got_k - k.float())[..., 32:].abs() <= k.float()[..., 32:].abs().amax(-1, keepdim=True) / 254).all()


def test_a_row_of_zeros_is_stored_as_zeros():
    k, v = rows_of(1, 3, 32, seed=0)
    k[:, :, 1] = 0
    v[:, :, 2] = 0
    got_k, got_v = rows(filled(k, v), 3)
    assert not got_k[:, :, 1].any() and not got_v[:, :, 2].any() and got_k.isfinite().all()


@settings(max_examples=120, deadline=None)
@given(kv_heads=st.integers(1, 3), group=st.integers(1, 9), dim=st.sampled_from([32, 64, 96, 128, 256]),
       length=st.integers(1, 600), seed=st.integers(0, 2**31 - 1), magnitude=st.sampled_from([0.01, 1.0, 8.0]),
       level=st.sampled_from([0, 2]))
def test_attend_one_int8_is_the_exact_attention_over_the_stored_rows_up_to_rounding(kv_heads, group, dim, length,
                                                                                  seed, magnitude, level):
    """On both paths (level 0: plain C; 2: AVX-512 VNNI where the CPU has it), lengths across several
    256-position parts and odd ones, head dimensions of one to eight key blocks (and a 32-dimension
    value tile), groups across several 8-head score tiles and 6-head value tiles; the query rounded to
    int8 as the operator rounds it."""
    k, v = rows_of(kv_heads, length, dim, seed, magnitude)
    q = (torch.randn(1, kv_heads * group, 1, dim, generator=torch.Generator().manual_seed(seed + 1)) * magnitude)
    q = q.to(torch.bfloat16)
    cache = filled(k, v, length // 3)
    with vector_level(level):
        got = cache.attend(q, length, dim**-0.5)
    assert got.shape == (1, 1, kv_heads * group * dim) and got.dtype == torch.bfloat16
    assert within_rounding(got, rounded_query(q), *rows(cache, length), dim**-0.5)


def test_it_attends_only_over_the_positions_asked_for():
    k, v = rows_of(2, 40, 64, seed=4)
    q = torch.randn(1, 4, 1, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    cache = filled(k, v)
    got = cache.attend(q, 17, 0.125)
    assert within_rounding(got, rounded_query(q), *rows(cache, 17), 0.125)


def test_the_int8_attention_stays_near_the_bf16_attention():
    """The cache's and the query's rounding move the result by about a percent of the values' scale."""
    k, v = rows_of(2, 500, 128, seed=6)
    q = torch.randn(1, 12, 1, 128, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    got = filled(k, v).attend(q, 500, 128**-0.5).double()
    exact = reference(q, k, v, 128**-0.5)
    assert (got - exact).abs().max() < 0.02 * v.double().abs().max()


@pytest.mark.parametrize("level", [0, 2])  # the plain path, and the vector one where the CPU has it
def test_it_does_not_depend_on_the_thread_count(level):
    k, v = rows_of(4, 900, 96, seed=8)
    q = torch.randn(1, 16, 1, 96, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    cache = filled(k, v)
    with vector_level(level):
        outs = at_thread_counts(lambda: cache.attend(q, 900, 0.125))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_a_prompt_from_the_start_attends_over_its_own_rows_and_later_ones_over_the_cache():
    k, v = rows_of(2, 12, 32, seed=10)
    q = torch.randn(1, 4, 12, 32, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    cache = Int8Cache.empty(2, 12, 32)
    seen = []

    def prompt_attention(*args):
        seen.append(args)
        return "prompt"

    def attention(q, k, v, start, scale):
        seen.append((k, v, start))
        return torch.zeros(1, q.shape[2], 1)

    assert store_and_attend(cache, q[:, :, :8], k[:, :, :8], v[:, :, :8], 0, 0.5, prompt_attention, attention) \
        == "prompt"
    assert seen[0][1] is not None and torch.equal(seen[0][1], k[:, :, :8])
    store_and_attend(cache, q[:, :, 8:11], k[:, :, 8:11], v[:, :, 8:11], 8, 0.5, prompt_attention, attention)
    cached_k, cached_v = rows(cache, 11)
    assert torch.equal(seen[1][0], cached_k) and torch.equal(seen[1][1], cached_v) and seen[1][2] == 8
    one = store_and_attend(cache, q[:, :, 11:], k[:, :, 11:], v[:, :, 11:], 11, 0.5, prompt_attention, attention)
    assert torch.equal(one, cache.attend(q[:, :, 11:], 12, 0.5))


def test_the_load_time_check_refuses_an_operator_off_by_more_than_rounding(monkeypatch):
    assert_refused_off_by(monkeypatch, "attend_one_int8", kv_int8.self_test, 1.02)


def test_wrong_inputs_are_refused_with_a_message():
    k, v = rows_of(2, 5, 32, seed=12)
    cache = filled(k, v)
    q = torch.randn(1, 4, 1, 32).to(torch.bfloat16)
    ops = torch.ops.int4q_native
    for call, message in [
        (lambda: ops.attend_one_int8(q.float(), *cache.tensors(), 5, 0.5), "q bf16"),
        (lambda: ops.attend_one_int8(q[:, :3], *cache.tensors(), 5, 0.5), "a multiple of 2"),
        (lambda: ops.attend_one_int8(q, *cache.tensors(), 0, 0.5), "over 1..16"),
        (lambda: ops.attend_one_int8(q, *cache.tensors(), 17, 0.5), "over 1..16"),
        (lambda: ops.attend_one_int8(q, cache.keys.view(torch.int8), *cache.tensors()[1:], 5, 0.5), "keys uint8"),
        (lambda: ops.store_kv_int8(k, v, *cache.tensors(), 12), "within the cache's 16"),
        (lambda: ops.store_kv_int8(k.float(), v, *cache.tensors(), 0), "k and v bf16"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            call()
