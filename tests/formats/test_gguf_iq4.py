"""--gguf-type iq4_nl and iq4_xs: every tensor gets the type llama-quantize gives it (with and
without an importance matrix, as int4q's calibrated and uncalibrated runs), every method writes a
file verify passes (llama.cpp runs the calibrated ones, where its tools are built), and requests
the types cannot hold are one line."""

import shutil

import pytest
from conftest import LLAMA_COMPLETION, assert_llama_cpp_generates, save_tiny_llama
from test_gguf import assert_verify_passes, quantize, run, tensor_types, with_tokenizer
from test_gguf_types import LLAMA_QUANTIZE, assert_llama_quantizes_mixture, llama_quantize_types

gguf = pytest.importorskip("gguf")


def save_grouped_queries(folder, smollm2_bf16):
    """A tiny tied 8-layer Llama with 4 query heads per key/value head: hidden size 256 (one
    super-block), MLP width 288 (not one)."""
    save_tiny_llama(folder, vocab_size=49152, hidden_size=256, intermediate_size=288, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=2, shard=None)
    return with_tokenizer(folder, smollm2_bf16)


@pytest.fixture(scope="module")
def grouped_queries(smollm2_bf16, tmp_path_factory):
    return save_grouped_queries(tmp_path_factory.mktemp("gguf-iq4") / "bf16", smollm2_bf16)


def test_iq4_xs_gives_each_tensor_llama_quantizes_type_and_passes_verify(grouped_queries, tmp_path):
    result = run("quantize", "--model", grouped_queries, "--out", tmp_path / "m.gguf", "--format", "gguf",
                 "--gguf-type", "iq4_xs", "--no-progress")
    assert result.exit_code == 0, result.output
    types = tensor_types(tmp_path / "m.gguf")
    for i in range(8):
        assert types[f"blk.{i}.attn_q.weight"] == types[f"blk.{i}.ffn_up.weight"] == "IQ4_XS"
        assert types[f"blk.{i}.attn_v.weight"] == "Q5_K"  # 4 query heads per key/value head
        assert types[f"blk.{i}.ffn_down.weight"] == ("Q5_1" if i == 0 else "IQ4_NL")  # K=288: the fallbacks
    assert "IQ4_NL for IQ4_XS (model.layers.1.mlp.down_proj and 6 more)" in result.stderr
    assert_llama_quantizes_mixture(tmp_path / "m.gguf", grouped_queries, tmp_path, "IQ4_XS")


@pytest.mark.parametrize("method, gguf_type", [("weighted", "iq4_nl"), ("gptq", "iq4_xs")])
def test_calibrated_iq4_files_have_llama_quantizes_types_with_an_imatrix_and_pass_verify(
        grouped_queries, tmp_path, method, gguf_type):
    out = quantize(grouped_queries, tmp_path / "w.gguf", "--gguf-type", gguf_type, "--method", method,
                   "--nsamples", "2", "--seqlen", "64", "--imatrix-out", tmp_path / "imatrix.gguf")
    types = tensor_types(out)
    assert {types[f"blk.{i}.ffn_down.weight"] for i in range(8)} == {"IQ4_NL"}  # none raised with an imatrix
    if shutil.which(LLAMA_QUANTIZE):
        theirs = llama_quantize_types(grouped_queries, tmp_path, gguf_type.upper(), tmp_path / "imatrix.gguf")
        assert {n: t for n, t in types.items() if n.startswith("blk.")} == \
            {n: t for n, t in theirs.items() if n.startswith("blk.")}
    assert_verify_passes(out, grouped_queries)
    if shutil.which(LLAMA_COMPLETION):
        assert_llama_cpp_generates(out)


@pytest.mark.parametrize("extra, message", [
    (("--gguf-type", "iq4_xs", "--group-size", "64"), "--group-size 64: GGUF stores one scale per 32 weights"),
    (("--gguf-type", "iq4_nl", "--asym"), "--gguf-type iq4_nl is a symmetric grid; drop --asym"),
])
def test_a_request_an_iq4_file_cannot_hold_is_one_line_and_writes_nothing(grouped_queries, tmp_path, extra,
                                                                          message):
    result = run("quantize", "--model", grouped_queries, "--out", tmp_path / "m.gguf", "--format", "gguf", *extra)
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert list(tmp_path.iterdir()) == []
