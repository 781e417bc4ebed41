"""Calibrated methods on every family people run on CPUs: weighted rounding and GPTQ end to end on
small random stand-ins of Llama, Qwen2, Qwen3, Gemma 3 (a tied, scaled table; sliding windows),
Phi-3 (fused projections) and GPT-2 (Conv1D): a cpu_int4 checkpoint that verifies against its
source for every family, and a GGUF file that llama.cpp loads and continues a prompt with for
every family whose converter takes SmolLM2's tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from conftest import LLAMA_COMPLETION, TOKENIZER_FILES, assert_llama_cpp_generates

from quantizer.cli.main import main

pytest.importorskip("gguf")

SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "llama": ("LlamaConfig", dict(SMALL, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", dict(SMALL, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(SMALL, head_dim=16, tie_word_embeddings=False)),
    "gemma3": ("Gemma3TextConfig", dict(SMALL, head_dim=16, sliding_window=16, tie_word_embeddings=True,
                                         layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("Phi3Config", dict(SMALL, tie_word_embeddings=False, pad_token_id=0)),
    "gpt2": ("GPT2Config", dict(vocab_size=49152, n_embd=64, n_layer=2, n_head=4, n_positions=256)),
}


AS_RELEASED = {
    "phi3": {"tokenizer_config.json": {"tokenizer_class": "GPT2Tokenizer"}},  # as Phi-4 ships its BPE tokenizer
    "gpt2": {"config.json": {"n_ctx": 256}},
}


def save_stand_in(family: str, folder, smollm2_bf16):
    """A seeded random model of ``family`` in bf16, with SmolLM2's tokenizer (one llama.cpp's
    converter recognises for every family here)."""
    import transformers

    config_class, sizes = FAMILIES[family]
    config = getattr(transformers, config_class)(**sizes)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)  # Gemma's zero-initialised norms and all: every tensor carries signal
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2_bf16 / name, folder / name)
    for name, extra in AS_RELEASED.get(family, {}).items():  # keys the family's real releases carry
        path = folder / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **extra}))
    return folder


NO_GGUF = {
    "qwen2": "transformers gives a qwen2 folder its Qwen2 tokenizer class, whose pre-tokenizer llama.cpp's converter "
             "only knows with Qwen's own vocabulary, which no package here ships at test size",
    "qwen3": "as qwen2",
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def stand_in(request, smollm2_bf16, tmp_path_factory):
    return request.param, save_stand_in(request.param, tmp_path_factory.mktemp(request.param) / "bf16", smollm2_bf16)


def quantize(source, out, *options):
    done = CliRunner().invoke(main, ["quantize", "--model", str(source), "--out", str(out), "--no-progress",
                                     "--nsamples", "2", "--seqlen", "32", *options])
    assert done.exit_code == 0, done.output
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method", ["weighted", "gptq"])
def test_calibrated_methods_write_a_gguf_llama_cpp_runs(stand_in, method, tmp_path):
    family, source = stand_in
    if family in NO_GGUF:
        pytest.skip(NO_GGUF[family])
    out = quantize(source, tmp_path / f"{family}.gguf", "--format", "gguf", "--gguf-type", "q4_0", "--method", method)
    verified = CliRunner().invoke(main, ["verify", str(out)])
    assert verified.exit_code == 0, verified.output
    if shutil.which(LLAMA_COMPLETION):
        assert_llama_cpp_generates(out)


@pytest.mark.slow
def test_calibrated_methods_write_cpu_int4_for_every_family(stand_in, tmp_path):
    family, source = stand_in
    out = quantize(source, tmp_path / family, "--method", "gptq", "--group-size", "32")
    verified = CliRunner().invoke(main, ["verify", str(out), "--reference", str(source), "--ctx", "32",
                                         "--max-windows", "1", "--greedy-tokens", "0"])
    assert verified.exit_code == 0, verified.output
