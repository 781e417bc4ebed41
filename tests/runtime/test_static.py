"""Model types int4q's own decoder does not cover decode through their own forward over a static
KV cache: exactly what transformers computes with that cache, and compiled like the fast path."""

import pytest
import torch
from conftest import quantize_to, save_tiny_gpt2

from quantizer.runtime import load_model
from quantizer.runtime.decode import compiled as fastpath
from quantizer.runtime.decode.generation import fast_greedy
from quantizer.runtime.decode.static import StaticDecoder, cache_positions

PROMPT = torch.tensor([[1, 40, 7, 300, 12]])


@pytest.fixture(scope="module")
def gpt2_int4(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt2")
    return load_model(quantize_to(save_tiny_gpt2(root / "src"), root / "q", group_size=32))


def test_the_static_cache_holds_a_power_of_two_positions():
    assert [cache_positions(n) for n in (1, 256, 257, 1000)] == [256, 256, 512, 1024]


def test_a_gpt2_decodes_as_transformers_generate_with_a_static_cache(gpt2_int4):
    decoder = fastpath.open_decoder(gpt2_int4, 64, compile=False)
    assert isinstance(decoder, StaticDecoder)
    with torch.inference_mode():
        want = gpt2_int4.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=16, do_sample=False,
                                  cache_implementation="static", eos_token_id=None)[0, PROMPT.shape[1]:].tolist()
    assert list(fast_greedy(decoder, PROMPT, 16, set())) == want


def test_the_compiled_static_step_decodes_the_eager_tokens(gpt2_int4, tmp_path, monkeypatch):
    monkeypatch.setattr(fastpath, "compiled_dir", lambda: tmp_path)
    monkeypatch.setattr(fastpath, "_steps", {})
    compiled = fastpath.open_decoder(gpt2_int4, 64)
    assert compiled.compiled is not None and list(tmp_path.glob("*.aot"))
    eager = fastpath.open_decoder(gpt2_int4, 64, compile=False)
    assert list(fast_greedy(compiled, PROMPT, 24, set())) == list(fast_greedy(eager, PROMPT, 24, set()))
    monkeypatch.setattr(fastpath, "_steps", {})  # a fresh process: the saved step, not a compile
    monkeypatch.setattr(fastpath, "_aot_compile", lambda d: pytest.fail("compiled again"))
    assert fastpath.open_decoder(gpt2_int4, 64).compiled is not None


def test_a_sliding_window_model_compiles_while_its_window_holds_the_sequence(tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("gemma3_text", vocab_size=512, hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  sliding_window=512, layer_types=["sliding_attention", "full_attention"])
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    model = load_model(quantize_to(tmp_path / "src", tmp_path / "q", group_size=32))
    monkeypatch.setattr(fastpath, "compiled_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(fastpath, "_steps", {})
    compiled = fastpath.open_decoder(model, 64)
    assert isinstance(compiled, StaticDecoder) and compiled.compiled is not None
    eager = fastpath.open_decoder(model, 64, compile=False)
    assert list(fast_greedy(compiled, PROMPT, 24, set())) == list(fast_greedy(eager, PROMPT, 24, set()))
