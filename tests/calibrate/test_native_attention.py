"""The calibration forward attends through int4q's causal kernel where a call is plain causal
attention, and through transformers' SDPA for every other call."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from quantizer.calibrate import native_attention
from quantizer.native.causal_attention import has_causal_attention

needs_kernel = pytest.mark.skipif(not has_causal_attention(), reason="int4q's causal attention needs AVX-512 BF16")


def tiny(model_class=LlamaForCausalLM, config_class=LlamaConfig, dtype=torch.bfloat16, **overrides):
    kwargs = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa")
    kwargs.update(overrides)
    torch.manual_seed(0)
    return model_class(config_class(**kwargs)).to(dtype).eval()


def logits(model, ids, **kwargs):
    with torch.inference_mode():
        return model(ids, **kwargs).logits.float()


def counted(fn):
    before = dict(native_attention.calls)
    result = fn()
    return result, {k: native_attention.calls[k] - before[k] for k in before}


@needs_kernel
@pytest.mark.parametrize("model_class,config_class", [(LlamaForCausalLM, LlamaConfig),
                                                      (Qwen2ForCausalLM, Qwen2Config)])
def test_a_plain_causal_window_attends_natively_to_what_sdpa_gives(model_class, config_class):
    model = tiny(model_class, config_class)
    ids = torch.randint(0, 256, (2, 50), generator=torch.Generator().manual_seed(1))
    want = logits(model, ids)
    assert native_attention.use_causal_kernel(model)
    got, calls = counted(lambda: logits(model, ids))
    assert calls == {"native": 2, "sdpa": 0}
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


@needs_kernel
def test_a_padded_batch_goes_to_sdpa_unchanged():
    model = tiny()
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :5] = 0
    want = logits(model, ids, attention_mask=mask)
    native_attention.use_causal_kernel(model)
    got, calls = counted(lambda: logits(model, ids, attention_mask=mask))
    assert calls == {"native": 0, "sdpa": 2} and torch.equal(got, want)


@needs_kernel
def test_a_sliding_window_shorter_than_the_window_goes_to_sdpa():
    model = tiny(Qwen2ForCausalLM, Qwen2Config, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(3))
    want = logits(model, ids)
    native_attention.use_causal_kernel(model)
    got, calls = counted(lambda: logits(model, ids))
    assert calls["native"] == 0 and torch.equal(got, want)


@needs_kernel
@pytest.mark.parametrize("change", [{"softcap": 30.0}, {"s_aux": torch.zeros(4)}, {"dropout": 0.1},
                                    {"sliding_window": 5}, {"dtype": torch.float32}, {"is_causal": False},
                                    {"scaling": -0.5}])
def test_any_call_that_is_not_plain_causal_attention_is_sdpas(change):
    module = torch.nn.Module()
    gen = torch.Generator().manual_seed(4)
    dtype = change.pop("dtype", torch.bfloat16)
    q, k, v = (torch.randn(1, 2, 10, 8, generator=gen).to(dtype) for _ in range(3))
    sdpa = []
    real = native_attention.sdpa_attention_forward
    native_attention.sdpa_attention_forward = lambda *a, **kw: sdpa.append(kw) or (q.transpose(1, 2), None)
    try:
        _, calls = counted(lambda: native_attention.causal_or_sdpa(module, q, k, v, None, **change))
    finally:
        native_attention.sdpa_attention_forward = real
    assert calls == {"native": 0, "sdpa": 1} and len(sdpa) == 1


@needs_kernel
def test_the_native_answer_is_the_contract_of_sdpas():
    module = torch.nn.Module()
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 33, 16, generator=gen).bfloat16()
    k, v = (torch.randn(1, 2, 33, 16, generator=gen).bfloat16() for _ in range(2))
    module.num_key_value_groups = 2
    ours, none = native_attention.causal_or_sdpa(module, q, k, v, None, scaling=0.3, position_ids=None)
    theirs, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.3)
    assert none is None and ours.shape == theirs.shape and (ours.float() - theirs.float()).abs().max() < 0.02


def test_a_model_on_another_attention_is_left_as_it_is():
    model = tiny(attn_implementation="eager")
    assert not native_attention.use_causal_kernel(model)
    assert model.config._attn_implementation == "eager"
