"""The fast decoder reproduces transformers' forward exactly; unsupported models fall back."""

import logging

import pytest
import torch
from conftest import quantize_to, save_byte_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.io.tokenizer import load_tokenizer
from quantizer.native.cache import cache_dir
from quantizer.native.causal_attention import has_causal_attention
from quantizer.native.causal_attention import reference as causal_reference
from quantizer.runtime import load_model
from quantizer.runtime.activations import EXACT, Activations
from quantizer.runtime.decode import compiled as fastpath
from quantizer.runtime.decode import opening
from quantizer.runtime.decode.decoder import (
    FAST_MODEL_TYPES,
    FastDecoder,
    applies_the_same_rope,
    attend,
    attend_in_fp32,
    attend_widened,
    decode_step,
    mark_exact_norms,
    unsupported_reason,
)
from quantizer.runtime.decode.generation import (
    GenerationStats,
    encode_prompt,
    eos_token_ids,
    fast_greedy,
    generate_text,
    greedy_ids,
    greedy_token,
)
from quantizer.runtime.kernels.attention import reference as attention_reference


def save_tiny_qwen2(path):
    """A seeded random Qwen2 (q/k/v biases, untied head) with the byte tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for layer in model.model.layers:  # random init leaves the biases at zero
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    save_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    return save_tiny_qwen2(tmp_path_factory.mktemp("qwen2") / "bf16")


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory):
    """A seeded random Phi-3 (fused qkv_proj and gate_up_proj) whose rotary embedding turns half
    of each head, with the byte tokenizer."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(2)
    config = Phi3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        partial_rotary_factor=0.5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = tmp_path_factory.mktemp("phi3") / "bf16"
    Phi3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    save_byte_tokenizer(path)
    return path


def reference_logits(model, ids):
    """transformers' last-position logits after each token of ``ids``, with its own KV cache and,
    as ``generate`` does, the head applied to the last position only."""
    from transformers import DynamicCache

    cache, out = DynamicCache(config=model.config), []
    kwargs = dict(cache=cache, use_cache=True, logits_to_keep=1)
    with torch.inference_mode():
        out.append(model(input_ids=ids[:, :-3], **kwargs).logits[:, -1])
        for i in range(3, 0, -1):
            out.append(model(input_ids=ids[:, -i:][:, :1], **kwargs).logits[:, -1])
    return out


def fast_logits(model, ids):
    decoder = FastDecoder(model, ids.shape[1])
    out = [decoder.forward(ids[:, :-3])]
    out += [decoder.forward(ids[:, -i:][:, :1]) for i in range(3, 0, -1)]
    return out


@pytest.mark.parametrize("which", ["llama-int4", "llama-bf16", "qwen2-int4", "phi3-int4", "phi3-bf16"])
def test_fast_decoder_equals_transformers_bit_for_bit(which, tiny_model, tiny_qwen2, tiny_phi3, tmp_path):
    source = {"llama": tiny_model, "qwen2": tiny_qwen2, "phi3": tiny_phi3}[which.split("-")[0]]
    path = quantize_to(source, tmp_path / "q", group_size=64) if which.endswith("int4") else source
    model = load_model(path, activations=Activations("exact", "int8"))  # int8 decode leaves transformers' arithmetic
    ids = torch.randint(0, 512, (1, 11), generator=torch.Generator().manual_seed(3))
    for got, want in zip(fast_logits(model, ids), reference_logits(model, ids)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("model_type", FAST_MODEL_TYPES)
def test_the_fast_decoder_applies_the_same_rope_as_each_fast_model_type(model_type):
    import importlib

    assert applies_the_same_rope(importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}"))


def test_a_partial_rotary_embedding_is_the_fast_path_only_where_the_model_applies_one():
    from transformers.models.llama import modeling_llama
    from transformers.models.phi3 import modeling_phi3

    assert applies_the_same_rope(modeling_phi3, head_dim=16, rotary_dim=8)
    assert not applies_the_same_rope(modeling_llama, head_dim=16, rotary_dim=8)


def test_a_model_whose_rope_differs_is_left_to_its_own_forward(tiny_model, monkeypatch):
    from transformers.models.llama import modeling_llama

    model = load_model(tiny_model)
    assert unsupported_reason(model, 16) is None
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", lambda q, k, cos, sin: (q, k))
    assert "apply_rotary_pos_emb" in unsupported_reason(model, 16)


def test_cache_overflow_is_an_input_error(tiny_model):
    decoder = FastDecoder(load_model(tiny_model), 4)
    with pytest.raises(Exception, match="exceed"):
        decoder.forward(torch.zeros(1, 5, dtype=torch.long))


def test_a_model_with_no_static_cache_falls_back_to_generate_with_one_warning(tmp_path, caplog, monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel

    monkeypatch.setattr(GPT2LMHeadModel, "_can_compile_fullgraph", False)
    monkeypatch.setattr(fastpath, "_warned", set())
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=2, n_positions=128)).save_pretrained(tmp_path)
    tokenizer = save_byte_tokenizer(tmp_path)
    model = load_model(tmp_path)
    assert "gpt2" in unsupported_reason(model, 64)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            text = "".join(generate_text(model, tokenizer, "hello", 5))
    assert text and sum("transformers' generate" in r.message for r in caplog.records) == 1


def test_compile_failure_decodes_eagerly_after_one_warning(tiny_model, monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(fastpath, "compiled_dir", lambda: tmp_path)
    monkeypatch.setattr(fastpath, "_warned", set())  # warned once a process: not by an earlier test

    def broken(decoder):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(fastpath, "_aot_compile", broken)
    with caplog.at_level(logging.WARNING):
        decoder = opening.open_decoder(load_model(tiny_model), 16)
    assert decoder.compiled is None and decoder.position == 0
    assert [r.message for r in caplog.records if "torch.compile failed (RuntimeError: no C++ compiler)" in r.message]
    assert decoder.forward(torch.tensor([[1]])).shape == (1, 512)
    assert not list(tmp_path.rglob("*.aot"))


def test_compiled_greedy_equals_eager_and_a_saved_step_loads_without_compiling(tiny_model, monkeypatch, tmp_path):
    monkeypatch.setattr(fastpath, "compiled_dir", lambda: tmp_path)
    model = load_model(tiny_model)
    ids = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(4))
    compiled = opening.open_decoder(model, 40)
    assert compiled.compiled is not None
    saved = list(tmp_path.rglob("*.aot"))
    assert len(saved) == 1 and saved[0] == fastpath.artifact_path(model)
    assert list((cache_dir() / "inductor").iterdir())  # the step's C++ is kept with int4q's cache, not in /tmp
    eager = opening.open_decoder(model, 40, compile=False)
    assert list(fast_greedy(compiled, ids, 24, set())) == list(fast_greedy(eager, ids, 24, set()))

    fastpath.checked_steps.clear()  # as a new process would
    monkeypatch.setattr(fastpath, "_aot_compile", lambda d: pytest.fail("compiled again"))
    loaded = opening.open_decoder(load_model(tiny_model), 40)
    assert list(fast_greedy(loaded, ids, 24, set())) == list(fast_greedy(eager, ids, 24, set()))


def test_a_damaged_or_wrong_saved_step_costs_a_compile_never_a_failure(tiny_model, monkeypatch, tmp_path):
    monkeypatch.setattr(fastpath, "compiled_dir", lambda: tmp_path)
    model = load_model(tiny_model)
    opening.open_decoder(model, 16)
    artifact = fastpath.artifact_path(model)
    fastpath.checked_steps.clear()
    artifact.write_bytes(b"truncated")
    assert opening.open_decoder(model, 16).compiled is not None
    vocab = model.config.vocab_size

    def wrong(*args):  # loads, but computes something else
        return torch.zeros(1, vocab)

    fastpath.checked_steps.clear()
    monkeypatch.setattr(fastpath, "load_step", lambda path, decoder: wrong)
    decoder = opening.open_decoder(model, 16)
    assert decoder.compiled is not None and decoder.compiled is not wrong
    ids = torch.tensor([[5, 6]])
    eager = opening.open_decoder(model, 16, compile=False)
    assert list(fast_greedy(decoder, ids, 8, set())) == list(fast_greedy(eager, ids, 8, set()))


def test_the_cache_key_covers_the_module_structure(tiny_model, tmp_path):
    quantized = quantize_to(tiny_model, tmp_path / "q")
    fused, unfused = load_model(quantized), load_model(quantized, fuse=False)
    assert fused.config.to_dict() == unfused.config.to_dict()
    assert fastpath.artifact_path(fused) != fastpath.artifact_path(unfused)


def test_fast_greedy_equals_todays_generate_on_the_verify_prompts(smollm2_g64):
    from quantizer.verification.fidelity import GREEDY_PROMPTS

    # Exact decode (int8 decode leaves transformers' arithmetic: its native step is tested against eager).
    exact_decode = Activations("exact", "int8")
    model, tokenizer = load_model(smollm2_g64, activations=exact_decode), load_tokenizer(smollm2_g64)
    unfused = load_model(smollm2_g64, fuse=False, activations=exact_decode)
    decoder = opening.open_decoder(model, 160)
    assert decoder.compiled is not None
    for kind, prompt in GREEDY_PROMPTS:
        ids = encode_prompt(tokenizer, prompt, chat=kind == "chat")
        want = greedy_ids(unfused, ids, 32)[0].tolist()  # the eager transformers path, unfused
        assert list(fast_greedy(decoder, ids, 32, eos_token_ids(model, tokenizer))) == want, prompt


def test_generation_stats_count_tokens(tiny_model):
    tokenizer = save_byte_tokenizer(tiny_model.parent / "tok")
    stats = GenerationStats()
    "".join(generate_text(load_model(tiny_model), tokenizer, "abc", 7, compile=False, stats=stats))
    assert stats.prompt_tokens == 3 and 1 <= stats.new_tokens <= 7 and stats.first_token_at <= stats.last_token_at


def test_two_models_in_one_process_each_get_their_own_graph(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(fastpath, "compiled_dir", lambda: tmp_path)
    ids = torch.randint(0, 512, (1, 5), generator=torch.Generator().manual_seed(5))
    for options in ({"group_size": 64}, {"group_size": 32}, None):  # other scale shapes, then bf16
        path = quantize_to(tiny_model, tmp_path / f"q{len(list(tmp_path.iterdir()))}", **options) if options else tiny_model
        model = load_model(path, activations=Activations("exact", "int8"))  # int8 decode would take the native step
        compiled, eager = opening.open_decoder(model, 16), opening.open_decoder(model, 16, compile=False)
        assert compiled.compiled is not None
        assert list(fast_greedy(compiled, ids, 8, set())) == list(fast_greedy(eager, ids, 8, set()))


@pytest.mark.parametrize("module_path, name", [("llama", "LlamaRMSNorm"), ("mistral", "MistralRMSNorm"),
                                               ("qwen2", "Qwen2RMSNorm"), ("qwen3", "Qwen3RMSNorm"),
                                               ("phi3", "Phi3RMSNorm")])
def test_the_exact_norm_is_each_fast_model_types_rms_norm_bit_for_bit(module_path, name):
    import importlib

    from quantizer.runtime.decode.decoder import llama_rms_norm

    norm_class = getattr(importlib.import_module(f"transformers.models.{module_path}.modeling_{module_path}"), name)
    gen = torch.Generator().manual_seed(1)
    norm = norm_class(576, eps=1e-5).to(torch.bfloat16)
    norm.weight.data = torch.randn(576, generator=gen).to(torch.bfloat16)
    h = (torch.randn(4, 7, 576, generator=gen) * 5).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(llama_rms_norm(norm, h, lambda x: x.pow(2).mean(-1, keepdim=True)), norm(h))


def test_compiled_norms_take_their_variance_from_the_opaque_operator(tiny_model):
    from quantizer.runtime.kernels import gemv

    if not gemv.has_gemv():
        pytest.skip("int4q's operators are not loaded on this CPU: the compiled step uses Inductor's reduction")
    decoder = FastDecoder(load_model(tiny_model), 16)
    assert mark_exact_norms(decoder.layers, decoder.norm) == 2 * len(decoder.layers) + 1
    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(str(graph_module.graph))
        return graph_module.forward

    step = torch.compile(decode_step, backend=record, fullgraph=True)
    with torch.inference_mode():
        decoder.forward(torch.tensor([[3, 4]]))
        step(*decoder.step_arguments(torch.tensor([[5]]), 2, for_tracing=True))
    assert graphs and graphs[0].count("int4q_native.mean_square") == 2 * len(decoder.layers) + 1


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 3), vocab=st.integers(1, 300), levels=st.integers(1, 20), nans=st.integers(0, 3),
       seed=st.integers(0, 2**16))
def test_the_greedy_token_is_argmax_with_ties_and_nans(rows, vocab, levels, nans, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=gen).bfloat16()  # few levels: many ties
    logits.view(-1)[torch.randint(0, rows * vocab, (nans,), generator=gen)] = float("nan")
    assert torch.equal(greedy_token(logits), logits.argmax(-1, keepdim=True))


@settings(max_examples=25, deadline=None)
@given(kv_heads=st.integers(1, 4), group=st.sampled_from([1, 3]), head_dim=st.sampled_from([16, 64]),
       length=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_int8_decodes_single_query_attention_in_fp32_rounded_once(kv_heads, group, head_dim, length, seed):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, kv_heads * group, 1, head_dim, generator=gen) * 2).bfloat16()
    k, v = ((torch.randn(1, kv_heads, length, head_dim, generator=gen) * 2).bfloat16() for _ in range(2))
    want = attention_reference(q, k, v, head_dim ** -0.5)
    for attention in (attend_in_fp32, attend_widened):  # int4q's operator where it loads, and PyTorch's
        got = attention(q, k, v, length - 1, head_dim ** -0.5)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert ((got.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-5 * want.abs().max()).all()
    two_queries = torch.cat([q, q.flip(-1)], dim=2)  # after a cache of length - 2 positions
    if length > 2:
        assert torch.equal(attend_in_fp32(two_queries, k, v, length - 2, 0.5), attend(two_queries, k, v, length - 2, 0.5))


@settings(max_examples=15, deadline=None)
@given(kv_heads=st.integers(1, 3), group=st.sampled_from([1, 3]), head_dim=st.sampled_from([16, 64]),
       length=st.integers(2, 200), seed=st.integers(0, 2**16))
def test_an_int8_prompt_from_position_0_attends_in_fp32_with_each_weight_in_16_bits(kv_heads, group, head_dim, length,
                                                                                   seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = ((torch.randn(1, heads, length, head_dim, generator=gen) * 2).bfloat16()
               for heads in (kv_heads * group, kv_heads, kv_heads))
    got = attend_in_fp32(q, k, v, 0, head_dim**-0.5)
    if not has_causal_attention():  # the library or AVX-512 BF16 is missing here: PyTorch's bf16 attention
        assert torch.equal(got, attend(q, k, v, 0, head_dim**-0.5))
        return
    want = causal_reference(q, k, v, head_dim**-0.5).reshape(1, length, -1)
    slack = v.double().abs().amax() * 2**-14
    assert got.shape == want.shape and ((got.double() - want).abs() <= want.abs() * 2**-8 + slack).all()


def test_the_attention_follows_the_models_decode_activations_and_keys_the_compiled_step(tiny_model, tiny_q,
                                                                                       monkeypatch):
    monkeypatch.setenv("INT4Q_ACTIVATIONS", "decode=int8")  # the process's setting; each model says its own
    exact = FastDecoder(load_model(tiny_q, activations=EXACT), 16)
    int8 = FastDecoder(load_model(tiny_q, activations=Activations("int8", "exact")), 16)
    assert FastDecoder(load_model(tiny_model), 16).attention is attend  # bf16: no int8 linears
    assert exact.attention is attend and int8.attention is attend_in_fp32
    assert fastpath.artifact_path(exact.model, exact.variant) != fastpath.artifact_path(int8.model, int8.variant)
    ids = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(5))
    for decoder in (exact, int8):
        decoder.forward(ids)
    steps = [(exact.forward(t.view(1, 1)).float(), int8.forward(t.view(1, 1)).float()) for t in ids[0, :4]]
    assert all((got - want).abs().max() <= 0.02 * want.abs().max() for want, got in steps)
    assert not all(torch.equal(got, want) for want, got in steps)
