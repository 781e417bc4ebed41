"""A layer's attention is computed once per window: a later call with the very same inputs is
answered with the kept output, anything else is computed, and transformers' functions are its
own again once the memo closes."""

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from quantizer.calibrate.attention_memo import AttentionMemo


@pytest.fixture
def counting(monkeypatch):
    """A registered attention function that counts its calls."""
    calls = []

    def attention(module, query, key, value, attention_mask, scaling=1.0, **kwargs):
        calls.append(1)
        weights = torch.softmax(query @ key.transpose(-1, -2) * scaling, -1)
        return weights @ value, None

    monkeypatch.setitem(AttentionInterface._global_mapping, "int4q_test_counting", attention)
    return attention, calls


def qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, 5, 4, generator=g) for _ in range(3)]


def test_equal_inputs_are_answered_with_the_kept_output_and_anything_else_is_computed(counting):
    original, calls = counting
    module = torch.nn.Module()
    with AttentionMemo(reserve=lambda n: True) as memo:
        attention = ALL_ATTENTION_FUNCTIONS["int4q_test_counting"]
        q, k, v = qkv()
        first, _ = attention(module, q, k, v, None, scaling=0.5)
        again, _ = attention(module, q.clone(), k.clone(), v.clone(), None, scaling=0.5)
        assert torch.equal(again, first) and len(calls) == 1
        again.add_(1.0)  # the caller's copy, not the kept one
        assert torch.equal(attention(module, q, k, v, None, scaling=0.5)[0], first) and len(calls) == 1
        attention(module, q, k, v, None, scaling=0.25)
        changed = q.clone()
        changed[0, 0, 0, 0] += 1e-3
        attention(module, changed, k, v, None, scaling=0.5)
        attention(module, q, k, v, torch.zeros(1, 1, 5, 5), scaling=0.5)
        attention(torch.nn.Module(), q, k, v, None, scaling=0.5)
        memo.window = 1
        attention(module, q, k, v, None, scaling=0.5)
        assert len(calls) == 6
    assert AttentionInterface._global_mapping["int4q_test_counting"] is original
    assert ALL_ATTENTION_FUNCTIONS["sdpa"].__name__ == "sdpa_attention_forward"


def test_what_does_not_fit_the_budget_is_computed_each_time(counting):
    _, calls = counting
    asked = []
    with AttentionMemo(reserve=lambda n: asked.append(n) or False):
        attention = ALL_ATTENTION_FUNCTIONS["int4q_test_counting"]
        q, k, v = qkv()
        for _ in range(3):
            attention(torch.nn.Module(), q, k, v, None)
    assert len(calls) == 3 and asked[0] == 4 * (4 * 2 * 5 * 4)  # q, k, v and the output, fp32


def test_a_forgotten_module_is_computed_again_and_its_bytes_given_back(counting):
    _, calls = counting
    reserved = []
    module = torch.nn.Module()
    with AttentionMemo(reserve=lambda n: reserved.append(n) or True) as memo:
        attention = ALL_ATTENTION_FUNCTIONS["int4q_test_counting"]
        q, k, v = qkv()
        attention(module, q, k, v, None)
        assert memo.forget(torch.nn.Module()) == 0
        assert memo.forget(module) == reserved[0]
        attention(module, q, k, v, None)
    assert len(calls) == 2


def test_a_skipped_modules_attention_is_never_kept(counting):
    _, calls = counting
    skipped, kept = torch.nn.Module(), torch.nn.Module()
    with AttentionMemo(reserve=lambda n: True, skipped={id(skipped)}):
        attention = ALL_ATTENTION_FUNCTIONS["int4q_test_counting"]
        q, k, v = qkv()
        for module in (skipped, skipped, kept, kept):
            attention(module, q, k, v, None)
    assert len(calls) == 3
