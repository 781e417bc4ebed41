"""--format gguf end to end: one .gguf whose tensors and metadata are llama.cpp's converter's for the
source, with int4q's blocks in place of the weights it quantized; verify proves it; bad requests are
one line and write nothing; llama.cpp itself loads and runs the file (where its tools are built)."""

import shutil
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner
from conftest import (
    LLAMA_COMPLETION,
    TOKENIZER_FILES,
    assert_llama_cpp_generates,
    interrupt_gptq_at_second_layer,
    save_tiny_gpt2,
    save_tiny_llama,
)

from quantizer.cli.main import main

gguf = pytest.importorskip("gguf")
needs_llama_cpp = pytest.mark.skipif(not shutil.which(LLAMA_COMPLETION), reason="llama.cpp's tools are not "
                                     "built here: bash scripts/setup_gguf.sh --build")


def run(*args, **kwargs):
    return CliRunner().invoke(main, [str(a) for a in args], **kwargs)


def with_tokenizer(folder, smollm2_bf16):
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2_bf16 / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def source(smollm2_bf16, tmp_path_factory):
    """A tiny tied Llama with SmolLM2's vocabulary and tokenizer (one the converter recognises)."""
    folder = save_tiny_llama(tmp_path_factory.mktemp("gguf") / "bf16", vocab_size=49152, hidden_size=64,
                             intermediate_size=128, shard=None)
    return with_tokenizer(folder, smollm2_bf16)


def tensor_types(path):
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def quantize(source, out, *extra):
    result = run("quantize", "--model", source, "--out", out, "--format", "gguf", "--no-progress", *extra)
    assert result.exit_code == 0, result.output
    return out


def assert_verify_passes(path, source):
    result = run("verify", path, "--model", source, "--ctx", "64", "--max-windows", "2", "--greedy-tokens", "4")
    assert result.exit_code == 0 and result.stdout.strip().endswith("PASS"), result.output
    return result.stdout


def test_q4_0_holds_the_converters_tensors_and_metadata_and_passes_verify(source, tmp_path):
    from quantizer.formats.gguf.assemble import converted_source
    from quantizer.io.checkpoint import read_config

    out = quantize(source, tmp_path / "m.gguf", "--gguf-type", "q4_0")
    expected, kv = converted_source(source, read_config(source))
    types = tensor_types(out)
    assert list(types) == list(expected)
    assert {types[n] for n in types if n.endswith(("_proj.weight", "attn_q.weight", "ffn_down.weight"))} <= {"Q4_0"}
    assert types["token_embd.weight"] == "Q4_0" and types["blk.0.attn_norm.weight"] == "F32"
    fields = gguf.GGUFReader(out).fields
    assert fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_0
    assert fields["tokenizer.ggml.model"].contents() == kv["tokenizer.ggml.model"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no blocks folder, no partial file
    assert "[ok] structure" in assert_verify_passes(out, source)


def test_weighted_table8_writes_q4_1_layers_and_a_q8_0_table(source, tmp_path):
    out = quantize(source, tmp_path / "w.gguf", "--method", "weighted", "--recipe", "table8", "--nsamples", "2",
                   "--seqlen", "64")
    types = tensor_types(out)
    assert types["token_embd.weight"] == "Q8_0" and types["blk.1.ffn_down.weight"] == "Q4_1"
    assert_verify_passes(out, source)


def test_gptq_unties_the_head_into_its_own_output_tensor(source, tmp_path):
    out = quantize(source, tmp_path / "g.gguf", "--method", "gptq", "--nsamples", "2", "--seqlen", "64")
    types = tensor_types(out)
    assert types["output.weight"] == "Q4_1" and "output.weight" not in tensor_types(
        quantize(source, tmp_path / "rtn.gguf"))
    assert_verify_passes(out, source)


def test_a_refined_gptq_q4_0_file_has_the_same_types_and_passes_verify(source, tmp_path):
    gptq = ("--gguf-type", "q4_0", "--method", "gptq", "--nsamples", "2", "--seqlen", "64")
    plain = quantize(source, tmp_path / "g.gguf", *gptq)
    refined = quantize(source, tmp_path / "r.gguf", *gptq, "--refine")
    assert tensor_types(refined) == tensor_types(plain) and refined.stat().st_size == plain.stat().st_size
    assert_verify_passes(refined, source)


def test_verify_fails_a_file_whose_blocks_are_not_the_nearest_codes(source, tmp_path):
    out = quantize(source, tmp_path / "m.gguf", "--gguf-type", "q4_0")
    reader = gguf.GGUFReader(out)
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    start = int(t.data_offset)
    data = bytearray(out.read_bytes())
    data[start + 2] ^= 0x33  # two codes of the first block, past its fp16 scale
    out.write_bytes(bytes(data))
    result = run("verify", out, "--model", source, "--greedy-tokens", "0")
    assert result.exit_code == 1 and "blk.0.ffn_up.weight: an element is" in result.stdout


@pytest.mark.parametrize("extra, message", [
    (("--group-size", "64"), "--group-size 64: GGUF stores one scale per 32 weights"),
    (("--gguf-type", "q4_0", "--asym"), "--gguf-type q4_0 is a symmetric grid; drop --asym"),
    (("--override", "down_proj=4:64"), "down_proj=4:64: GGUF stores one scale per 32 weights"),
])
def test_a_request_the_file_cannot_hold_is_one_line_and_writes_nothing(source, tmp_path, extra, message):
    result = run("quantize", "--model", source, "--out", tmp_path / "m.gguf", "--format", "gguf", "--no-progress",
                 *extra)
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_architecture_the_converter_does_not_know_is_refused_before_any_work(smollm2_bf16, tmp_path):
    from transformers import OPTConfig, OPTForCausalLM

    folder = tmp_path / "opt"
    OPTForCausalLM(OPTConfig(vocab_size=49152, hidden_size=64, ffn_dim=128, num_hidden_layers=1,
                             num_attention_heads=4, word_embed_proj_dim=64)).save_pretrained(folder)
    with_tokenizer(folder, smollm2_bf16)
    result = run("quantize", "--model", folder, "--out", tmp_path / "m.gguf", "--format", "gguf")
    assert result.exit_code != 0 and "llama.cpp's converter does not know OPTForCausalLM" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["opt"]


def test_an_output_name_without_gguf_and_a_missing_converter_are_one_line(source, tmp_path, monkeypatch):
    from quantizer.formats.gguf import converter

    result = run("quantize", "--model", source, "--out", tmp_path / "m", "--format", "gguf")
    assert result.exit_code != 0 and "give it a name ending in .gguf" in result.stderr
    converter.load.cache_clear()
    monkeypatch.setenv("INT4Q_LLAMA_CPP", str(tmp_path / "nowhere"))
    try:
        result = run("quantize", "--model", source, "--out", tmp_path / "m.gguf", "--format", "gguf")
    finally:
        converter.load.cache_clear()
    assert result.exit_code != 0 and "need llama.cpp's converter" in result.stderr and "int4q setup-gguf" in result.stderr
    assert list(tmp_path.iterdir()) == []


@needs_llama_cpp
def test_llama_cpp_loads_and_runs_the_file(source, tmp_path):
    out = quantize(source, tmp_path / "m.gguf", "--method", "gptq", "--nsamples", "2", "--seqlen", "64")
    assert_llama_cpp_generates(out)


def test_a_gpt2_files_conv1d_projections_are_int4qs_blocks_and_pass_verify(smollm2_bf16, tmp_path):
    import json

    folder = save_tiny_gpt2(tmp_path / "gpt2", tokenizer=False, vocab_size=49152, n_embd=64, n_positions=1024)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_ctx": 1024}))  # as GPT-2's own config has it
    out = quantize(with_tokenizer(folder, smollm2_bf16), tmp_path / "m.gguf", "--method", "weighted",
                   "--nsamples", "2", "--seqlen", "64")
    types = tensor_types(out)
    assert {types[f"blk.{i}.{t}.weight"] for i in range(2) for t in ("attn_qkv", "attn_output", "ffn_up", "ffn_down")} \
        == {"Q4_1"}
    assert_verify_passes(out, folder)


def test_a_config_key_the_converter_needs_is_one_line_before_any_work(smollm2_bf16, tmp_path):
    folder = with_tokenizer(save_tiny_gpt2(tmp_path / "gpt2", tokenizer=False, vocab_size=49152, n_embd=64),
                            smollm2_bf16)
    result = run("quantize", "--model", folder, "--out", tmp_path / "m.gguf", "--format", "gguf", "--no-progress")
    assert result.exit_code != 0 and "needs 'n_ctx' in" in result.output and "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2"]


def test_the_bundled_models_file_has_the_tensors_and_keys_of_convert_hf_to_gguf(smollm2_bf16, tmp_path):
    """Against the converter's own script run as a user runs it, not int4q's use of its classes."""
    from quantizer.formats.gguf.converter import converter_root

    ours = quantize(smollm2_bf16, tmp_path / "smol.gguf", "--gguf-type", "q4_0")
    theirs = tmp_path / "bf16.gguf"
    subprocess.run([sys.executable, converter_root() / "convert_hf_to_gguf.py", smollm2_bf16, "--outtype", "bf16",
                    "--outfile", theirs], check=True, capture_output=True)
    a, b = gguf.GGUFReader(ours), gguf.GGUFReader(theirs)
    assert [(t.name, list(t.shape)) for t in a.tensors] == [(t.name, list(t.shape)) for t in b.tensors]
    own = {"general.file_type", "general.quantized_by", "int4q.quantization_config"}
    assert set(a.fields) - own == set(b.fields) - {"general.file_type"}
    for key in set(b.fields) - own - {"GGUF.kv_count", "GGUF.tensor_count"}:
        assert a.fields[key].contents() == b.fields[key].contents(), key
    kept = {t.name: t for t in b.tensors if t.tensor_type.name == "F32"}
    assert all(bytes(t.data) == bytes(kept[t.name].data) for t in a.tensors if t.name in kept)


def test_where_the_converter_writes_no_head_of_its_own_gptq_keeps_the_head_tied(source, monkeypatch):
    from quantizer.formats.gguf import converter
    from quantizer.quantization.planning import QuantizeOptions, plan_quantization

    monkeypatch.setattr(converter, "preflight", lambda model_dir, config: False)  # as for Gemma
    plan = plan_quantization(source, QuantizeOptions(method="gptq", checkpoint_format="gguf"))
    assert plan.tied_output and "lm_head" not in plan.targets
    assert any("read the head from the table" in note for note in plan.notes)
    with pytest.raises(Exception, match="cannot be untied"):
        plan_quantization(source, QuantizeOptions(checkpoint_format="gguf", untie_head=True))


def test_an_interrupted_gptq_run_resumes_to_the_same_file(source, tmp_path, monkeypatch):
    gptq = ("--method", "gptq", "--nsamples", "2", "--seqlen", "64")
    whole = quantize(source, tmp_path / "whole.gguf", *gptq)
    undo = interrupt_gptq_at_second_layer(monkeypatch)
    result = run("quantize", "--model", source, "--out", tmp_path / "m.gguf", "--format", "gguf", "--no-progress", *gptq)
    assert result.exit_code == 130 and "--resume" in result.stderr and not (tmp_path / "m.gguf").exists()
    undo()
    resumed = quantize(source, tmp_path / "m.gguf", *gptq, "--resume")
    assert resumed.read_bytes() == whole.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "whole.gguf"]


@pytest.fixture(scope="module")
def wide_source(smollm2_bf16, tmp_path_factory):
    """A tiny Llama whose hidden size (256) is one Q4_K super-block and whose MLP width (288) is not."""
    folder = save_tiny_llama(tmp_path_factory.mktemp("gguf-k") / "bf16", vocab_size=49152, hidden_size=256,
                             intermediate_size=288, num_hidden_layers=1, shard=None)
    return with_tokenizer(folder, smollm2_bf16)


@pytest.mark.parametrize("method", ["minmax", "weighted", "gptq"])
def test_q4_k_holds_every_row_of_whole_super_blocks_and_q5_0_the_rest_as_llama_quantize(wide_source, tmp_path,
                                                                                         method):
    result = run("quantize", "--model", wide_source, "--out", tmp_path / "k.gguf", "--format", "gguf",
                 "--gguf-type", "q4_k", "--method", method, "--nsamples", "2", "--seqlen", "64", "--no-progress")
    assert result.exit_code == 0, result.output
    types = tensor_types(tmp_path / "k.gguf")
    assert types["blk.0.attn_q.weight"] == types["blk.0.ffn_up.weight"] == types["token_embd.weight"] == "Q4_K"
    assert types["blk.0.ffn_down.weight"] == "Q5_0"
    assert gguf.GGUFReader(tmp_path / "k.gguf").fields["general.file_type"].contents() == \
        gguf.LlamaFileType.MOSTLY_Q4_K_S
    assert "K=288 is not a multiple of the 256-weight super-blocks: Q5_0 for Q4_K" in result.stderr
    assert_verify_passes(tmp_path / "k.gguf", wide_source)


def test_q4_k_is_an_asymmetric_grid(wide_source, tmp_path):
    result = run("quantize", "--model", wide_source, "--out", tmp_path / "k.gguf", "--format", "gguf",
                 "--gguf-type", "q4_k", "--sym")
    assert result.exit_code != 0 and "--gguf-type q4_k is an asymmetric grid; drop --sym" in result.stderr
    assert list(tmp_path.iterdir()) == []


@needs_llama_cpp
def test_llama_cpp_runs_a_q4_k_file(wide_source, tmp_path):
    out = quantize(wide_source, tmp_path / "k.gguf", "--gguf-type", "q4_k", "--method", "weighted",
                   "--nsamples", "2", "--seqlen", "64")
    assert_llama_cpp_generates(out)


@pytest.mark.parametrize("failure", ["short write", "SIGTERM"])
def test_a_failure_while_the_file_is_assembled_leaves_nothing_behind(source, tmp_path, monkeypatch, failure):
    """A disk that fills up as the GGUF is written (numpy's short write) is one line naming the
    file; a stop signal then is 128 + the signal; either way no blocks folder or partial file stays."""
    import quantizer.formats.gguf.write as write
    from quantizer.cli.main import Stopped

    def fail(*args, **kwargs):
        if failure == "SIGTERM":
            raise Stopped(signal.SIGTERM)
        raise OSError("15925248 requested and 13065824 written")

    monkeypatch.setattr(write, "write_from_blocks", fail)
    result = run("quantize", "--model", source, "--out", tmp_path / "m.gguf", "--format", "gguf", "--method",
                 "weighted", "--nsamples", 2, "--seqlen", 32, "--no-progress")
    if failure == "SIGTERM":
        assert result.exit_code == 128 + signal.SIGTERM and "stopped by SIGTERM" in result.stderr
    else:
        assert result.exit_code == 1 and f"no space left on the device while writing {tmp_path / 'm.gguf'}" \
            in result.stderr
    assert "internal error" not in result.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage", ["not JSON", "not UTF-8"])
def test_verify_names_a_changed_int4q_config_in_one_line(source, tmp_path, damage):
    out = quantize(source, tmp_path / "m.gguf", "--gguf-type", "q4_0")
    data = bytearray(out.read_bytes())
    key = b"int4q.quantization_config"
    start = data.index(key) + len(key) + 4 + 8  # the value's type and length
    data[start] = ord("[") if damage == "not JSON" else 0xFF
    out.write_bytes(bytes(data))
    result = run("verify", out)
    assert result.exit_code == 1 and "int4q.quantization_config is not" in result.stdout
    assert "internal error" not in result.output


def test_the_files_writing_is_reported_in_bytes_up_to_all_its_tensors(source, tmp_path):
    from quantizer.api import quantize
    from quantizer.quantization.run import Progress

    steps = []

    class Recorded(Progress):
        def wrote(self, what, done, total):
            steps.append((what, done, total, "B"))

    quantize(source, tmp_path / "m.gguf", format="gguf", progress=Recorded())
    total = steps[0][2]
    assert [s[1] for s in steps] == sorted(s[1] for s in steps) and steps[0][1] == 0 and steps[-1][1] == total
    assert {(what, t, unit) for what, _, t, unit in steps} == {("write m.gguf", total, "B")}
    assert total == sum(int(t.n_bytes) for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors)
