"""Model types int4q's own decoder does not cover decode through their own forward over a static
KV cache: exactly what transformers' default generate computes (attention over the written
positions only) where the model's attention allows it, else what it computes with that static
cache; compiled like the fast path."""

import pytest
import torch
from conftest import quantize_to, save_tiny_gpt2

from quantizer.runtime import load_model
from quantizer.runtime.decode import compiled as fastpath
from quantizer.runtime.decode import opening
from quantizer.runtime.decode.exact_length import NAME, attends_over_exact_length
from quantizer.runtime.decode.generation import fast_greedy
from quantizer.runtime.decode.static import (
    StaticDecoder,
    cache_argument,
    cache_positions,
)

PROMPT = torch.tensor([[1, 40, 7, 300, 12]])


@pytest.fixture(scope="module")
def gpt2_int4(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt2")
    return load_model(quantize_to(save_tiny_gpt2(root / "src"), root / "q", group_size=32))


def test_the_static_cache_holds_a_power_of_two_positions():
    assert [cache_positions(n) for n in (1, 256, 257, 1000)] == [256, 256, 512, 1024]


def greedy_generate(model, cache_implementation=None, tokens=16) -> list[int]:
    with torch.inference_mode():
        done = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=tokens, do_sample=False,
                              cache_implementation=cache_implementation, eos_token_id=None)
    return done[0, PROMPT.shape[1]:].tolist()


def test_a_gpt2_computes_the_logits_of_transformers_default_dynamic_cache_bit_for_bit(gpt2_int4):
    from transformers import DynamicCache

    ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(3))
    steps = [ids[:, :-3]] + [ids[:, i : i + 1] for i in range(8, 11)]
    decoder = opening.open_decoder(gpt2_int4, 64, compile=False)
    assert isinstance(decoder, StaticDecoder) and decoder.exact_length
    kwargs = {cache_argument(gpt2_int4): DynamicCache(config=gpt2_int4.config), "use_cache": True, "logits_to_keep": 1}
    with torch.inference_mode():
        for step in steps:
            assert torch.equal(decoder.forward(step), gpt2_int4(input_ids=step, **kwargs).logits[:, -1])
    assert list(fast_greedy(decoder, PROMPT, 16, set())) == greedy_generate(gpt2_int4)


def test_the_exact_length_attention_leaves_the_models_own_forward_unchanged(tmp_path):
    model = load_model(save_tiny_gpt2(tmp_path / "src"))
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    tokens = greedy_generate(model, "static")
    assert StaticDecoder(model, 64).exact_length and model.config._attn_implementation == NAME
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, before)
    assert greedy_generate(model, "static") == tokens


def test_a_model_whose_attention_is_not_given_the_length_keeps_its_masked_attention(tmp_path):
    model = load_model(save_tiny_gpt2(tmp_path / "src"))
    assert not attends_over_exact_length(model, lambda: model(input_ids=PROMPT))
    assert model.config._attn_implementation == "sdpa"


def test_a_model_outside_transformers_attention_interface_decodes_as_generate_with_a_static_cache(tmp_path):
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(0)
    config = FalconConfig(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                          new_decoder_architecture=True, alibi=False, parallel_attn=True, bias=False)
    FalconForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    model = load_model(quantize_to(tmp_path / "src", tmp_path / "q", group_size=32))
    decoder = opening.open_decoder(model, 64, compile=False)
    assert isinstance(decoder, StaticDecoder) and not decoder.exact_length
    assert list(fast_greedy(decoder, PROMPT, 16, set())) == greedy_generate(model, "static")


def test_the_compiled_static_step_decodes_the_eager_tokens(gpt2_int4, tmp_path, monkeypatch):
    monkeypatch.setattr(fastpath, "compiled_dir", lambda: tmp_path)
    monkeypatch.setattr(fastpath, "checked_steps", {})
    compiled = opening.open_decoder(gpt2_int4, 64)
    assert compiled.compiled is not None and list(tmp_path.glob("*.aot"))
    eager = opening.open_decoder(gpt2_int4, 64, compile=False)
    assert list(fast_greedy(compiled, PROMPT, 24, set())) == list(fast_greedy(eager, PROMPT, 24, set()))
    monkeypatch.setattr(fastpath, "checked_steps", {})  # a fresh process: the saved step, not a compile
    monkeypatch.setattr(fastpath, "_aot_compile", lambda d: pytest.fail("compiled again"))
    assert opening.open_decoder(gpt2_int4, 64).compiled is not None


@pytest.mark.parametrize("window", [512, 8], ids=["window-holds-the-sequence", "sequence-outgrows-the-window"])
def test_a_sliding_window_model_decodes_compiled_as_generate(window, tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("gemma3_text", vocab_size=512, hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  sliding_window=window, layer_types=["sliding_attention", "full_attention"])
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    model = load_model(quantize_to(tmp_path / "src", tmp_path / "q", group_size=32))
    monkeypatch.setattr(fastpath, "compiled_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(fastpath, "checked_steps", {})
    compiled = opening.open_decoder(model, 64)
    assert isinstance(compiled, StaticDecoder) and compiled.compiled is not None
    eager = opening.open_decoder(model, 64, compile=False)
    tokens = list(fast_greedy(compiled, PROMPT, 24, set()))  # 29 positions: past a window of 8
    assert tokens == list(fast_greedy(eager, PROMPT, 24, set()))
    assert tokens == greedy_generate(model, tokens=24)
