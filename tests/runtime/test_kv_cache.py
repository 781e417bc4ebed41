"""The fast decoder over an int8 KV cache (decode/decoder.py with kernels/kv_int8.py, the native plan's
int8 cache): the native step is the eager step bit for bit, it decodes near the bf16 cache, and a
decoder that cannot hold one says why in one line."""

import pytest
import torch
from test_native_step import INT8_DECODE, greedy_logits, greedy_logits_from, quantized  # noqa: F401 (a fixture)

from quantizer.errors import UsageError
from quantizer.runtime import load_model
from quantizer.runtime.activations import EXACT, Activations
from quantizer.runtime.decode import native_step as native
from quantizer.runtime.decode.decoder import FastDecoder, int8_cache_unsupported
from quantizer.runtime.decode.opening import open_decoder
from quantizer.runtime.kernels.kv_int8 import has_int8_cache
from quantizer.runtime.kernels.w4a8 import has_w4a8

pytestmark = pytest.mark.skipif(not (has_w4a8() and has_int8_cache()),
                                reason="this CPU has no int8 decode kernel, or int4q's library is not loaded")


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_the_native_step_over_an_int8_cache_is_the_eager_step_bit_for_bit(kind, quantized):
    decoder = FastDecoder(load_model(quantized(kind), activations=INT8_DECODE), 64, kv_cache="int8")
    step = native.native_step(decoder)
    assert step is not None and decoder.int8_caches and not decoder.keys
    prompt = torch.randint(0, 512, (1, 5), generator=torch.Generator().manual_seed(1))
    decoder.native = None
    eager = greedy_logits(decoder, prompt, 24)
    decoder.native = step
    assert torch.equal(greedy_logits(decoder, prompt, 24), eager)


def test_a_prompt_through_the_plan_over_an_int8_cache_is_as_many_single_token_steps_bit_for_bit(quantized):
    """With int8 prefill the plan takes a prompt in one call, its rows writing one key block together."""
    decoder = FastDecoder(load_model(quantized("llama"), activations=Activations("int8", "int8")), 64,
                          kv_cache="int8")
    step = native.native_step(decoder)
    assert step is not None and step.rows == native.PROMPT_ROWS
    prompt = torch.randint(0, 512, (1, 21), generator=torch.Generator().manual_seed(4))
    decoder.reset()
    whole = greedy_logits(decoder, prompt, 6)
    decoder.reset()
    for i in range(prompt.shape[1] - 1):
        decoder.forward(prompt[:, i : i + 1])
    assert torch.equal(whole, greedy_logits_from(decoder, prompt[:, -1:], 6))


def test_decoding_over_an_int8_cache_stays_near_the_bf16_cache(quantized):
    model = load_model(quantized("llama"), activations=INT8_DECODE)
    prompt = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(2))
    logits = {kv: greedy_logits(open_decoder(model, 80, compile=False, kv_cache=kv), prompt, 8).float()
              for kv in ("bf16", "int8")}
    assert torch.equal(logits["int8"][0].argmax(), logits["bf16"][0].argmax())
    assert (logits["int8"][0] - logits["bf16"][0]).abs().max() < 0.05 * logits["bf16"][0].abs().max()


def test_a_long_prompt_then_steps_attend_over_the_cache_as_a_prompt_in_pieces(quantized):
    """A prompt from position 0 attends over its own bf16 rows; a prompt after it over the stored
    int8 rows in PyTorch; both then step through the cache."""
    decoder = FastDecoder(load_model(quantized("llama"), activations=INT8_DECODE), 64, kv_cache="int8")
    prompt = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(3))
    whole = decoder.forward(prompt)
    decoder.reset()
    decoder.forward(prompt[:, :20])
    pieces = decoder.forward(prompt[:, 20:])
    assert torch.equal(whole.argmax(-1), pieces.argmax(-1))
    assert (whole.float() - pieces.float()).abs().max() < 0.05 * whole.float().abs().max()


def test_an_int8_cache_needs_int8_decode_activations_and_says_so_in_one_line(quantized):
    model = load_model(quantized("llama"), activations=EXACT)
    assert "int8 decode activations" in int8_cache_unsupported(model, "int8")
    assert int8_cache_unsupported(model, "bf16") is None
    with pytest.raises(UsageError, match=r"^--kv-cache int8: an int8 KV cache needs int8 decode activations.*"
                                         r"use --kv-cache bf16$"):
        open_decoder(model, 32, compile=False, kv_cache="int8")


def test_an_int8_cache_holds_one_sequence_and_known_kinds_only(quantized):
    model = load_model(quantized("llama"), activations=INT8_DECODE)
    assert "one sequence" in int8_cache_unsupported(model, "int8", sequences=2)
    assert "must be one of bf16, int8" in int8_cache_unsupported(model, "int4")
