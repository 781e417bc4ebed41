"""--gguf-type beyond Q4_0/Q4_1: the 5- and 6-bit types and llama-quantize's K_M mixtures. Every
tensor gets the type llama-quantize gives it (the tool itself is the oracle where it is built),
the blocks hold int4q's grids (verify's round trip), and llama.cpp runs the file."""

import shutil
import subprocess
import sys

import pytest
from conftest import assert_llama_cpp_generates, save_tiny_llama
from test_gguf import (
    assert_verify_passes,
    needs_llama_cpp,
    quantize,
    run,
    tensor_types,
    with_tokenizer,
)

gguf = pytest.importorskip("gguf")
LLAMA_QUANTIZE = f"{sys.prefix}/share/int4q/llama.cpp/build/bin/llama-quantize"
MORE_BITS_LAYERS = {0, 3, 6, 7}  # llama.cpp's use_more_bits for 8 layers


@pytest.fixture(scope="module")
def eight_layers(smollm2_bf16, tmp_path_factory):
    """A tiny tied 8-layer Llama: hidden size 256 (one super-block), MLP width 288 (not one)."""
    folder = save_tiny_llama(tmp_path_factory.mktemp("gguf-mix") / "bf16", vocab_size=49152, hidden_size=256,
                             intermediate_size=288, num_hidden_layers=8, num_attention_heads=4,
                             num_key_value_heads=2, shard=None)
    return with_tokenizer(folder, smollm2_bf16)


def llama_quantize_types(source, tmp_path, ftype: str, imatrix=None) -> dict[str, str]:
    """The tensor types llama-quantize writes for ``source`` at ``ftype`` (via the converter's bf16
    file), given the importance matrix file ``imatrix`` or none."""
    from quantizer.formats.gguf.converter import converter_root

    bf16, out = tmp_path / "bf16.gguf", tmp_path / f"llama-{ftype}.gguf"
    subprocess.run([sys.executable, converter_root() / "convert_hf_to_gguf.py", source, "--outtype", "bf16",
                    "--outfile", bf16], check=True, capture_output=True)
    given = ["--imatrix", imatrix] if imatrix else []
    subprocess.run([LLAMA_QUANTIZE, *given, bf16, out, ftype], check=True, capture_output=True)
    return tensor_types(out)


def test_q4_k_m_gives_each_tensor_llama_quantizes_type_and_passes_verify(eight_layers, tmp_path):
    result = run("quantize", "--model", eight_layers, "--out", tmp_path / "m.gguf", "--format", "gguf",
                 "--gguf-type", "q4_k_m", "--no-progress")
    assert result.exit_code == 0, result.output
    types = tensor_types(tmp_path / "m.gguf")
    for i in range(8):
        more = i in MORE_BITS_LAYERS
        assert types[f"blk.{i}.attn_v.weight"] == ("Q6_K" if more else "Q4_K")
        assert types[f"blk.{i}.ffn_down.weight"] == ("Q8_0" if more else "Q5_0")  # K=288: the fallbacks
        assert types[f"blk.{i}.attn_q.weight"] == types[f"blk.{i}.ffn_up.weight"] == "Q4_K"
    assert "Q8_0 for Q6_K (model.layers.0.mlp.down_proj and 3 more)" in result.stderr
    assert_llama_quantizes_mixture(tmp_path / "m.gguf", eight_layers, tmp_path, "Q4_K_M")


def assert_llama_quantizes_mixture(path, source, tmp_path, ftype: str) -> None:
    """A mixture's file of a tied model: the table at the head's Q6_K, llama.cpp's file type, every
    tensor's type llama-quantize's (where it is built), and verify passes it."""
    types = tensor_types(path)
    assert types["token_embd.weight"] == "Q6_K" and "output.weight" not in types  # tied: the head's type
    assert gguf.GGUFReader(path).fields["general.file_type"].contents() == getattr(gguf.LlamaFileType,
                                                                                    f"MOSTLY_{ftype}")
    if shutil.which(LLAMA_QUANTIZE):
        assert types == llama_quantize_types(source, tmp_path, ftype)
    assert_verify_passes(path, source)


def test_a_calibrated_q4_0_file_gives_the_first_eighth_of_ffn_down_q4_1_as_llama_quantize_with_an_imatrix(
        eight_layers, tmp_path):
    out = quantize(eight_layers, tmp_path / "w.gguf", "--gguf-type", "q4_0", "--method", "weighted", "--nsamples", "2",
                   "--seqlen", "64", "--imatrix-out", tmp_path / "imatrix.gguf")
    types = tensor_types(out)
    assert types["blk.0.ffn_down.weight"] == "Q4_1"  # 8 layers: the first one
    assert {types[f"blk.{i}.ffn_down.weight"] for i in range(1, 8)} == {"Q4_0"}
    assert types["blk.0.attn_q.weight"] == types["blk.0.ffn_up.weight"] == "Q4_0"
    assert set(tensor_types(quantize(eight_layers, tmp_path / "m.gguf", "--gguf-type", "q4_0")).values()) <= \
        {"Q4_0", "Q8_0", "F32"}  # uncalibrated: llama-quantize without an imatrix
    if shutil.which(LLAMA_QUANTIZE):  # the layers' tensors (its tables' types follow its own defaults)
        theirs = llama_quantize_types(eight_layers, tmp_path, "Q4_0", tmp_path / "imatrix.gguf")
        assert {n: t for n, t in types.items() if n.startswith("blk.")} == \
            {n: t for n, t in theirs.items() if n.startswith("blk.")}
    assert_verify_passes(out, eight_layers)


def round_trip(path, source, min_snr_db: float):
    """verify's round trip of a file: every quantized tensor against the converted source."""
    from quantizer.formats.gguf.assemble import converted_source
    from quantizer.io.checkpoint import read_config
    from quantizer.verification.gguf import check_round_trip, read_gguf

    reader, qconfig = read_gguf(path)
    expected, _ = converted_source(source, read_config(source))
    check, stats = check_round_trip(reader, expected, qconfig, None)
    assert check.ok, check.problems
    assert len(stats) == 57 and min(s.snr_db for s in stats) > min_snr_db
    return reader


def test_gptq_solves_6_bit_modules_and_keeps_a_k_m_head_tied_to_its_table(eight_layers, tmp_path):
    result = run("quantize", "--model", eight_layers, "--out", tmp_path / "g.gguf", "--format", "gguf",
                 "--gguf-type", "q4_k_m", "--method", "gptq", "--nsamples", "2", "--seqlen", "64", "--no-progress")
    assert result.exit_code == 0, result.output
    assert "keeps lm_head tied to the table at 6 bits, as llama-quantize does" in result.stderr
    types = tensor_types(tmp_path / "g.gguf")
    assert types["token_embd.weight"] == types["blk.0.attn_v.weight"] == "Q6_K" and "output.weight" not in types
    round_trip(tmp_path / "g.gguf", eight_layers, 15)


@pytest.mark.parametrize("gguf_type, layer_type, down_type, file_type", [
    ("q5_k", "Q5_K", "Q5_1", "MOSTLY_Q5_K_S"),  # Q5_0 and Q5_1 are Q4_K's and Q5_K's fallbacks
    ("q6_k", "Q6_K", "Q8_0", "MOSTLY_Q6_K"),
])
def test_5_and_6_bit_types_hold_int4qs_grids(eight_layers, tmp_path, gguf_type, layer_type, down_type, file_type):
    out = quantize(eight_layers, tmp_path / "m.gguf", "--gguf-type", gguf_type)
    types = tensor_types(out)
    assert types["blk.0.attn_q.weight"] == types["token_embd.weight"] == layer_type
    assert types["blk.0.ffn_down.weight"] == down_type
    reader = round_trip(out, eight_layers, 25)
    assert reader.fields["general.file_type"].contents() == getattr(gguf.LlamaFileType, file_type)


def test_a_6_bit_override_and_a_mixture_with_a_recipe(eight_layers, tmp_path):
    out = quantize(eight_layers, tmp_path / "o.gguf", "--gguf-type", "q4_k", "--override", "o_proj=6")
    assert tensor_types(out)["blk.1.attn_output.weight"] == "Q6_K"
    result = run("quantize", "--model", eight_layers, "--out", tmp_path / "m.gguf", "--format", "gguf",
                 "--gguf-type", "q4_k_m", "--recipe", "table8")
    assert result.exit_code != 0 and "--gguf-type q4_k_m and --recipe table8 both choose" in result.stderr
    result = run("quantize", "--model", eight_layers, "--out", tmp_path / "c", "--override", "o_proj=6")
    assert result.exit_code != 0 and "stores 4/8-bit modules only" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.gguf"]


@needs_llama_cpp
def test_llama_cpp_runs_a_q4_k_m_file(eight_layers, tmp_path):
    out = quantize(eight_layers, tmp_path / "m.gguf", "--gguf-type", "q4_k_m", "--method", "weighted",
                   "--nsamples", "2", "--seqlen", "64")
    assert_llama_cpp_generates(out)
