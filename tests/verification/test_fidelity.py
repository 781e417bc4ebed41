"""Fidelity numbers: zero divergence for a model against itself, and numbers that move when the
model is perturbed."""

import pytest
import torch

from quantizer.errors import InputError
from quantizer.io.text import builtin_text
from quantizer.verification.fidelity import teacher_forced, token_windows


@pytest.fixture(scope="module")
def pair(tiny_model_tok):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_tok, dtype=torch.float32).eval()
    perturbed = AutoModelForCausalLM.from_pretrained(tiny_model_tok, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return reference, perturbed, AutoTokenizer.from_pretrained(tiny_model_tok)


def test_windows_are_consecutive_and_counted(pair):
    tokenizer = pair[2]
    windows = token_windows(tokenizer, builtin_text("eval"), 64, 3)
    assert [w.shape for w in windows] == [(1, 64)] * 3
    ids = tokenizer(builtin_text("eval"), add_special_tokens=False)["input_ids"][:192]
    assert torch.cat(windows, 1)[0].tolist() == ids
    with pytest.raises(InputError, match="fewer than one window of 64"):
        token_windows(tokenizer, "tiny", 64, 3)


def test_a_model_against_itself_has_no_divergence_and_a_perturbed_one_has_some(pair):
    reference, perturbed, tokenizer = pair
    windows = token_windows(tokenizer, builtin_text("eval"), 64, 2)
    same = teacher_forced(reference, reference, windows)
    assert same.tokens_scored == 64 and same.kld_mean == pytest.approx(0, abs=1e-6)
    assert same.top1_agreement == 1.0 and same.ppl_ratio == pytest.approx(1.0)
    moved = teacher_forced(reference, perturbed, windows)
    assert moved.kld_mean > 1e-4 and moved.kld_max >= moved.kld_p999 >= 0
    assert moved.ppl_ratio != pytest.approx(1.0)
