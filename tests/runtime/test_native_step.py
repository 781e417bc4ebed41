"""The native decode step (decode/native_step.py, csrc/decode_plan.cpp) is the eager int8 step bit
for bit, on every Llama-shaped variant it covers, and leaves every other model to the compiled step."""

import logging

import pytest
import torch
from conftest import quantize_to, save_byte_tokenizer
from test_decoder import save_tiny_qwen2

from quantizer.runtime import load_model
from quantizer.runtime.activations import EXACT, Activations
from quantizer.runtime.bench import describe_path
from quantizer.runtime.decode import native_step as native
from quantizer.runtime.decode.decoder import FastDecoder
from quantizer.runtime.decode.opening import open_decoder
from quantizer.runtime.kernels.w4a8 import has_w4a8

INT8_DECODE = Activations("int8", "exact")

pytestmark = pytest.mark.skipif(not has_w4a8(), reason="this CPU has no AVX-512 VBMI + VNNI: no int8 decode kernel")


def save_tiny(kind: str, path):
    """A seeded random model of ``kind`` (hidden 128, 2 layers, vocab 512) with the byte tokenizer."""
    import transformers

    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    if kind == "qwen2":
        return save_tiny_qwen2(path)
    config, model = {
        "llama": (transformers.LlamaConfig(**common), transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config(**common, head_dim=32), transformers.Qwen3ForCausalLM),
        "phi3": (transformers.Phi3Config(**common, partial_rotary_factor=0.5, pad_token_id=0),
                 transformers.Phi3ForCausalLM),
        "llama-gelu": (transformers.LlamaConfig(**common, hidden_act="gelu"), transformers.LlamaForCausalLM),
    }[kind]
    torch.manual_seed(3)
    built = model(config).to(torch.bfloat16)
    with torch.no_grad():  # random init leaves norms at one: give them weights that matter
        for name, p in built.named_parameters():
            if "norm" in name:
                p.normal_(1, 0.3)
    built.save_pretrained(path)
    save_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    made = {}

    def get(kind: str):
        if kind not in made:
            root = tmp_path_factory.mktemp(kind)
            made[kind] = quantize_to(save_tiny(kind, root / "bf16"), root / "int4", group_size=64)
        return made[kind]

    return get


def greedy_logits(decoder, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    decoder.reset()
    logits, out = decoder.forward(prompt), []
    for _ in range(steps):
        logits = decoder.forward(logits.argmax(-1, keepdim=True))
        out.append(logits)
    return torch.cat(out)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "phi3"])
def test_the_native_step_is_the_eager_int8_step_bit_for_bit(kind, quantized):
    decoder = FastDecoder(load_model(quantized(kind), activations=INT8_DECODE), 64)
    step = native.native_step(decoder)
    assert step is not None
    prompt = torch.randint(0, 512, (1, 5), generator=torch.Generator().manual_seed(1))
    decoder.native = None
    eager = greedy_logits(decoder, prompt, 24)
    decoder.native = step
    assert torch.equal(greedy_logits(decoder, prompt, 24), eager)


def test_open_decoder_takes_the_native_step_with_or_without_compiling(quantized):
    model = load_model(quantized("llama"), activations=INT8_DECODE)
    for compile in (True, False):
        decoder = open_decoder(model, 32, compile=compile)
        assert decoder.native is not None and decoder.compiled is None and decoder.pending is None
        assert describe_path(decoder) == "native"


@pytest.mark.parametrize("kind, activations, reason", [
    ("llama", EXACT, "attention is not attend_one"),  # exact decode keeps transformers' bf16 attention
    ("llama-gelu", INT8_DECODE, "activation is not SiLU"),
])
def test_a_model_the_plan_does_not_compute_keeps_the_other_paths(kind, activations, reason, quantized, caplog):
    decoder = FastDecoder(load_model(quantized(kind), activations=activations), 32)
    with caplog.at_level(logging.INFO, logger=native.__name__):
        assert native.native_step(decoder) is None
    assert reason in caplog.text and decoder.native is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_eight_bit_linear_in_a_layer_keeps_the_other_paths(quantized, tmp_path, caplog):
    from quantizer.runtime.nn.int8 import Int8Linear

    decoder = FastDecoder(load_model(quantized("llama"), activations=INT8_DECODE), 32)
    down = decoder.layers[1].mlp.down_proj
    codes = torch.randint(-127, 128, (down.out_features, down.in_features), dtype=torch.int8)
    decoder.layers[1].mlp.down_proj = Int8Linear(codes, torch.full((down.out_features,), 1e-3))
    with caplog.at_level(logging.INFO, logger=native.__name__):
        assert native.native_step(decoder) is None
    assert "Int8Linear is not a 4-bit linear" in caplog.text


def test_a_step_that_differs_from_eager_is_refused_with_one_warning(quantized, monkeypatch, caplog):
    decoder = FastDecoder(load_model(quantized("llama"), activations=INT8_DECODE), 32)
    real = native.NativeStep.__call__
    monkeypatch.setattr(native.NativeStep, "__call__", lambda self, token, position: real(self, token, position) * -1)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.native_step(decoder) is None
    assert decoder.native is None
    assert [r.getMessage() for r in caplog.records] == [
        "decoding without the native step (slower): the native step's logits differ from eager by up to "
        + caplog.records[0].getMessage().rsplit(" ", 1)[-1]]


def test_the_plan_refuses_mismatched_tensors_with_a_message(quantized):
    decoder = FastDecoder(load_model(quantized("llama"), activations=INT8_DECODE), 32)
    plan = native.NativeStep.of(decoder).plan
    tensors, eps, groups = native.layer_arguments(decoder.layers[0])
    short = decoder.keys[0][:, :, :8]  # a cache shorter than the rotary tables
    with pytest.raises(RuntimeError, match="keys and values must be bf16"):
        plan.add_layer([*tensors, short, decoder.values[0]], eps, groups)
    with pytest.raises(RuntimeError, match="outside the cache of 32"):
        plan.step(torch.zeros(1, 128, dtype=torch.bfloat16), 32)


INT8 = Activations("int8", "int8")


@pytest.mark.parametrize("kind", ["llama", "qwen3", "phi3"])
def test_a_prompt_in_one_call_is_as_many_single_token_steps_bit_for_bit(kind, quantized):
    decoder = FastDecoder(load_model(quantized(kind), activations=INT8), 64)
    step = native.native_step(decoder)
    assert step is not None and step.rows == native.PROMPT_ROWS and step.spec.kernels() == {"w4a8_mm"}
    prompt = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(2))
    decoder.reset()
    whole = greedy_logits(decoder, prompt, 6)
    decoder.reset()
    for i in range(prompt.shape[1] - 1):
        decoder.forward(prompt[:, i : i + 1])
    one_by_one = greedy_logits_from(decoder, prompt[:, -1:], 6)
    assert torch.equal(whole, one_by_one)


def greedy_logits_from(decoder, last: torch.Tensor, steps: int) -> torch.Tensor:
    """greedy_logits without the reset: the cache already holds the prompt before ``last``."""
    logits, out = decoder.forward(last), []
    for _ in range(steps):
        logits = decoder.forward(logits.argmax(-1, keepdim=True))
        out.append(logits)
    return torch.cat(out)


def test_a_prompt_goes_through_the_plan_only_where_prefill_is_int8_and_it_is_short(quantized, monkeypatch):
    calls = []
    real = native.NativeStep.__call__
    monkeypatch.setattr(native.NativeStep, "__call__",
                        lambda self, ids, position: calls.append(ids.shape[1]) or real(self, ids, position))
    for activations, rows in ((INT8, native.PROMPT_ROWS), (INT8_DECODE, 1)):
        decoder = FastDecoder(load_model(quantized("llama"), activations=activations), 256)
        decoder.native = native.native_step(decoder)
        assert decoder.native.rows == rows
        calls.clear()
        for length in (1, 5, native.PROMPT_ROWS + 1):
            decoder.reset()
            decoder.forward(torch.zeros(1, length, dtype=torch.long))
        assert calls == [n for n in (1, 5, native.PROMPT_ROWS + 1) if n <= rows]

