"""Batched decoding (decode/batched.py, DecodePlan.rows): each sequence of a batch gets, bit for bit,
the logits it gets decoded alone, whatever its prompt's length; bad arguments are refused."""

import pytest
import torch
from test_native_step import INT8_DECODE, quantized  # noqa: F401  (a fixture)

from quantizer.errors import InputError
from quantizer.runtime import load_model
from quantizer.runtime.activations import EXACT, Activations
from quantizer.runtime.decode.batched import BatchedDecoder
from quantizer.runtime.decode.decoder import FastDecoder
from quantizer.runtime.decode.native_step import native_step
from quantizer.runtime.kernels.w4a8 import has_w4a8

INT8 = Activations("int8", "int8")
MAX_LEN = 200

pytestmark = pytest.mark.skipif(not has_w4a8(), reason="this CPU has no AVX-512 VBMI + VNNI: no native step")


def alone(model, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Logits [steps + 1, V] of ``prompt`` and ``steps`` greedy tokens through a native single-sequence decoder."""
    decoder = FastDecoder(model, MAX_LEN)
    assert native_step(decoder) is not None
    logits = [decoder.forward(prompt.view(1, -1))]
    for _ in range(steps):
        logits.append(decoder.forward(logits[-1].argmax(-1, keepdim=True)))
    return torch.cat(logits)


@pytest.mark.parametrize("kind, activations", [("llama", INT8), ("qwen2", INT8), ("qwen3", INT8_DECODE)])
def test_each_sequence_decodes_as_it_would_alone_bit_for_bit(kind, activations, quantized):
    model = load_model(quantized(kind), activations=activations)
    gen = torch.Generator().manual_seed(5)
    lengths = (1, 7, 150, 30)  # 150: longer than the plan takes in one call, so the eager prefill
    prompts = [torch.randint(0, 512, (n,), generator=gen) for n in lengths]
    batch = BatchedDecoder(model, len(prompts), MAX_LEN)
    logits = [batch.prefill(prompts)]
    for _ in range(6):
        logits.append(batch.step(logits[-1].argmax(-1)))
    together = torch.stack(logits, 1)
    for sequence, prompt in enumerate(prompts):
        assert torch.equal(together[sequence], alone(model, prompt, 6)), sequence


def test_a_second_prefill_starts_every_sequence_over(quantized):
    model = load_model(quantized("llama"), activations=INT8)
    prompts = [torch.arange(3), torch.arange(5, 9)]
    batch = BatchedDecoder(model, 2, MAX_LEN)
    first = batch.prefill(prompts)
    batch.step(first.argmax(-1))
    assert torch.equal(batch.prefill(prompts), first)


def test_bad_arguments_are_refused_with_a_message(quantized):
    model = load_model(quantized("llama"), activations=INT8)
    with pytest.raises(InputError, match="at least one sequence"):
        BatchedDecoder(model, 0, MAX_LEN)
    batch = BatchedDecoder(model, 2, 16)
    for prompts, message in [([torch.arange(3)], "1 prompts for a batch of 2"),
                             ([torch.arange(3), torch.arange(0)], "1 to 16 tokens"),
                             ([torch.arange(3), torch.arange(17)], "1 to 16 tokens")]:
        with pytest.raises(InputError, match=message):
            batch.prefill(prompts)
    batch.prefill([torch.arange(16), torch.arange(3)])
    with pytest.raises(InputError, match="one token for each of 2"):
        batch.step(torch.zeros(3, dtype=torch.long))
    with pytest.raises(InputError, match="exceed this batch's cache of 16"):
        batch.step(torch.zeros(2, dtype=torch.long))


def test_a_model_without_the_native_step_is_refused(quantized):
    with pytest.raises(InputError, match="needs int4q's native decode step"):
        BatchedDecoder(load_model(quantized("llama"), activations=EXACT), 2, MAX_LEN)


def test_the_plan_refuses_rows_outside_its_caches_or_writing_one_slot_twice(quantized):
    batch = BatchedDecoder(load_model(quantized("llama"), activations=INT8), 2, 16)
    h = torch.zeros(2, 128, dtype=torch.bfloat16)
    for sequences, positions, message in [([0, 2], [0, 0], "outside the caches of 2 x 16"),
                                          ([0, 1], [0, 16], "outside the caches of 2 x 16"),
                                          ([1, 1], [4, 4], "the same sequence and position")]:
        with pytest.raises(RuntimeError, match=message):
            batch.plan.rows(h, torch.tensor(sequences), torch.tensor(positions))
    with pytest.raises(RuntimeError, match="int64"):
        batch.plan.rows(h, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 0]))
