"""verify must pass a good checkpoint and fail each kind of corruption, naming the tensor or key."""

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from conftest import save_byte_tokenizer
from safetensors.torch import load_file, save_file

from quantizer.cli.main import main

TARGET = "model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def good(tiny_q, tmp_path_factory):
    """The tiny quantized model with a tokenizer, so that every check can run."""
    folder = shutil.copytree(tiny_q, tmp_path_factory.mktemp("good") / "q")
    save_byte_tokenizer(folder)
    return folder


def verify(qdir, source=None, *extra):
    args = ["verify", str(qdir)] + (["--model", str(source)] if source else []) + list(extra)
    return CliRunner().invoke(main, args)


def corrupt(good, tmp_path, edit):
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    tensors = load_file(bad / "model.safetensors")
    edit(tensors, bad)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    return bad


def test_good_tiny_checkpoint_passes(good, tiny_model):
    result = verify(good, tiny_model)
    assert result.exit_code == 0, result.output
    assert "[ok] structure" in result.stdout and "[ok] round trip" in result.stdout
    assert "[ok] kernel layout" in result.stdout and result.stdout.strip().endswith("PASS")


def test_a_check_that_cannot_run_is_not_a_pass(tiny_q, tiny_model, tmp_path):
    """No tokenizer: the end-to-end check cannot load the models, so verify cannot say PASS."""
    result = verify(tiny_q, tiny_model)
    assert result.exit_code == 3, result.output
    assert "[COULD NOT RUN] end to end: cannot load the models" in result.stdout
    assert result.stdout.strip().endswith("INCOMPLETE")


def test_a_config_that_does_not_match_the_tensors_fails(good, tiny_model, tmp_path):
    bad = shutil.copytree(good, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["intermediate_size"] = 320
    (bad / "config.json").write_text(json.dumps(config))
    result = verify(bad, tiny_model)
    assert result.exit_code == 1 and "the model expects [320, 128]" in result.stdout


def test_a_gptq_export_is_named_as_such(good, tmp_path):
    bad = shutil.copytree(good, tmp_path / "g")
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 64}
    (bad / "config.json").write_text(json.dumps(config))
    result = verify(bad)
    assert result.exit_code == 1 and "this is a 'gptq' checkpoint (int4q's GPTQ export" in result.stdout


def test_a_different_source_is_named_as_the_likely_cause(good, tmp_path):
    from conftest import save_tiny_llama

    other = save_tiny_llama(tmp_path / "other", dtype=torch.float16, shard=None, initializer_range=0.05)
    result = verify(good, other)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[1] == "[FAILED] round trip"  # and its first problem names the likely cause
    assert "is --reference the checkpoint this was quantized from?" in lines[2] and "float16" in lines[2]


def flip_packed_byte(t, _):
    t[f"{TARGET}.weight_packed"][3, 7] ^= 0xFF


def drop_tensor(t, _):
    del t[f"{TARGET}.weight_zero"]


def swap_nibbles(t, _):
    p = t[f"{TARGET}.weight_packed"]
    t[f"{TARGET}.weight_packed"] = ((p & 0x0F) << 4) | (p >> 4)


def zero_scales(t, _):
    t[f"{TARGET}.weight_scale"] = torch.zeros_like(t[f"{TARGET}.weight_scale"])


def one_ulp(t, _):
    w = t["model.layers.0.input_layernorm.weight"]
    w.view(torch.int16)[5] += 1


def wrong_group_size(t, bad):
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["group_size"] = 32
    (bad / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("edit,needs_source,message", [
    (flip_packed_byte, True, f"{TARGET}: an element is"),
    (drop_tensor, False, f"{TARGET}.weight_zero: missing"),
    (wrong_group_size, False, "model.embed_tokens.weight_scale: shape [512, 2] does not match group_size 32"),
    (swap_nibbles, True, f"{TARGET}: an element is"),
    (zero_scales, True, f"{TARGET}: a group's grid misses"),
    (one_ulp, True, "model.layers.0.input_layernorm.weight: differs from the source"),
])
def test_each_corruption_fails_naming_the_tensor(good, tiny_model, tmp_path, edit, needs_source, message):
    bad = corrupt(good, tmp_path, edit)
    result = verify(bad, tiny_model if needs_source else None)
    assert result.exit_code == 1, result.output
    assert message in result.stdout and result.stdout.strip().endswith("FAIL")


def test_truncated_shard_fails_naming_the_file(good, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:-1000])
    result = verify(bad)
    assert result.exit_code == 1 and "model.safetensors: truncated" in result.stdout


def test_max_kld_without_source_is_bad_usage(good):
    assert verify(good, None, "--max-kld", "0.1").exit_code == 2


def test_smollm2_g64_passes_end_to_end_and_the_kld_gate_bites(smollm2_g64, smollm2_bf16, tmp_path):
    report, plot = tmp_path / "report.json", tmp_path / "snr.png"
    args = ["--ctx", "128", "--max-windows", "2", "--greedy-tokens", "8", "--json", str(report), "--plot", str(plot)]
    result = verify(smollm2_g64, smollm2_bf16, *args)
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    fid = data["fidelity"]
    assert 0 < fid["kld_mean"] < 1 and 0.5 < fid["top1_agreement"] <= 1 and fid["ppl_ratio"] > 0.9
    assert fid["greedy_total"] == 8 and "pydoc_data.topics (eval half)" in fid["text"]
    assert len(data["tensors"]) == 211 and plot.stat().st_size > 10_000
    gated = verify(smollm2_g64, smollm2_bf16, "--ctx", "128", "--max-windows", "2", "--greedy-tokens", "0",
                   "--max-kld", "0.001")
    assert gated.exit_code == 1 and "exceeds --max-kld 0.001" in gated.stdout


TABLE = "model.embed_tokens"


@pytest.fixture(scope="module")
def good_mixed(tiny_model, tmp_path_factory):
    """The tiny model with the mixed recipe: an 8-bit tied table, 8-bit v_proj/down_proj in some layers."""
    from conftest import quantize_to

    folder = quantize_to(tiny_model, tmp_path_factory.mktemp("mixed") / "q", group_size=64, recipe="mixed")
    save_byte_tokenizer(folder)
    return folder


def flip_int8_byte(t, _):
    t[f"{TABLE}.weight_packed"][5, 9] ^= 0x55


def halve_int8_scale(t, _):
    t[f"{TABLE}.weight_scale"][7] /= 2


def claim_4_bits(t, bad):
    config = json.loads((bad / "config.json").read_text())
    del config["quantization_config"]["modules"][TABLE]
    (bad / "config.json").write_text(json.dumps(config))


def test_a_mixed_checkpoint_passes(good_mixed, tiny_model):
    qc = json.loads((good_mixed / "config.json").read_text())["quantization_config"]
    assert qc["modules"][TABLE] == {"bits": 8, "symmetric": True}
    assert qc["modules"]["model.layers.1.mlp.down_proj"] == {"bits": 8, "symmetric": True}
    assert "model.layers.0.mlp.down_proj" not in qc["modules"]  # llama.cpp's layer choice: the last eighth
    result = verify(good_mixed, tiny_model, "--ctx", "64", "--max-windows", "2", "--greedy-tokens", "4")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("edit,message", [
    (flip_int8_byte, f"{TABLE}: an element is"),
    (halve_int8_scale, f"{TABLE}: an element is"),
    (claim_4_bits, f"{TABLE}.weight_zero: missing"),
])
def test_each_8_bit_corruption_fails_naming_the_tensor(good_mixed, tiny_model, tmp_path, edit, message):
    bad = corrupt(good_mixed, tmp_path, edit)
    result = verify(bad, tiny_model)
    assert result.exit_code == 1, result.output
    assert message in result.stdout and result.stdout.strip().endswith("FAIL")


def test_json_into_a_missing_folder_is_refused_before_verify_runs(tmp_path):
    result = CliRunner().invoke(main, ["verify", str(tmp_path), "--json", str(tmp_path / "no" / "r.json")])
    assert result.exit_code == 2 and "is not a folder" in result.output and "--json" in result.output


def test_json_through_a_link_is_refused(tmp_path):
    (tmp_path / "r.json").symlink_to(tmp_path / "elsewhere.json")
    result = CliRunner().invoke(main, ["verify", str(tmp_path), "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 2 and "is a link" in result.output and not (tmp_path / "elsewhere.json").exists()


@pytest.mark.parametrize("suffix, value", [("weight_scale", float("nan")), ("weight_zero", float("inf"))])
def test_a_non_finite_scale_or_zero_fails_the_structure_check_and_generate_stops_in_one_line(good, tmp_path, suffix,
                                                                                            value):
    def edit(tensors, folder):
        tensors[f"{TARGET}.{suffix}"][0, 0] = value

    bad = corrupt(good, tmp_path, edit)
    result = verify(bad)
    assert result.exit_code == 1 and f"{TARGET}.{suffix}: holds 1 NaN or infinite values" in result.output
    generated = CliRunner().invoke(main, ["generate", str(bad), "--prompt", "abc", "--max-new-tokens", "4",
                                          "--no-compile"])
    assert generated.exit_code == 1 and "NaN or infinite logits" in generated.output, generated.output
    assert "Traceback" not in generated.output


def test_a_config_without_a_quant_method_is_named_as_such(good, tmp_path):
    bad = shutil.copytree(good, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"] = {"bits": 4}
    (bad / "config.json").write_text(json.dumps(config))
    result = verify(bad)
    assert result.exit_code == 1 and "quantization_config names no quant_method" in result.output
    assert "None" not in result.output
