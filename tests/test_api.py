"""The Python API as a user calls it: ``quantizer.quantize``, ``quantizer.verify`` and
``quantizer.load``; the same refusals as the CLI, by the same words."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import quantizer
from quantizer.api import calibration_precision
from quantizer.cli import main
from quantizer.errors import InputError, UsageError
from quantizer.native import cpu


def test_importing_the_package_names_the_api_without_importing_torch():
    code = ("import sys, quantizer; print(callable(quantizer.quantize) or None, "
            "sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split(None, 1) == ["True", "[]\n"]


def test_quantize_verify_and_load_make_check_and_run_a_checkpoint(tiny_model, tmp_path):
    out = tmp_path / "q"
    report = quantizer.quantize(tiny_model, out, group_size=64, overrides=["down_proj=8"])
    assert isinstance(report, quantizer.QuantizeReport) and report.quantization_config["group_size"] == 64
    assert report.summary.tensors_quantized > 0 and (out / "config.json").is_file()
    checked = quantizer.verify(out, reference=tiny_model, max_windows=1, greedy_tokens=0)
    assert isinstance(checked, quantizer.VerifyReport)
    assert checked.outcome in ("PASS", "INCOMPLETE") and checked.summary_lines
    structural = quantizer.verify(out)
    assert structural.passed, structural.summary_lines
    model = quantizer.load(out)
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 512) and torch.isfinite(logits).all()


def test_the_api_writes_the_bytes_the_cli_writes(tiny_model, tmp_path):
    quantizer.quantize(tiny_model, tmp_path / "api", group_size=32, recipe="table8")
    done = CliRunner().invoke(main, ["quantize", "--model", str(tiny_model), "--out", str(tmp_path / "cli"),
                                     "--group-size", "32", "--recipe", "table8", "--no-progress"])
    assert done.exit_code == 0, done.output
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "api" / name).read_bytes() == (tmp_path / "cli" / name).read_bytes()


@pytest.mark.parametrize("options, cli, words", [
    (dict(gguf_type="q4_0"), ["--gguf-type", "q4_0"], "--gguf-type is for --format gguf"),
    (dict(method="weighted", refine=True), ["--method", "weighted", "--refine"], "--refine is for --method gptq"),
    (dict(method="gptq", refine=True, symmetric=False), ["--method", "gptq", "--refine", "--asym"],
     "--refine is for --method gptq"),
])
def test_the_api_and_the_cli_refuse_the_same_requests_with_the_same_line(tiny_model, tmp_path, options, cli, words):
    with pytest.raises(UsageError, match=words):
        quantizer.quantize(tiny_model, tmp_path / "api", **options)
    done = CliRunner().invoke(main, ["quantize", "--model", str(tiny_model), "--out", str(tmp_path / "cli"), *cli])
    assert done.exit_code == 2 and words in done.output
    assert not (tmp_path / "api").exists() and not (tmp_path / "cli").exists()


def test_a_gguf_type_against_its_grid_is_refused_by_both(tiny_model, tmp_path):
    with pytest.raises(InputError, match="drop --asym"):
        quantizer.quantize(tiny_model, tmp_path / "x.gguf", format="gguf", gguf_type="q4_0", symmetric=False)


def test_verify_refuses_a_kld_limit_without_a_reference(tiny_q):
    with pytest.raises(UsageError, match="needs a reference"):
        quantizer.verify(tiny_q, max_kld=0.1)


@pytest.mark.parametrize("device, native, want", [("cuda", False, "bf16"), ("cpu", True, "bf16"),
                                                  ("cpu", False, "fp32")])
def test_calibration_precision_auto_is_the_fast_one_for_the_device(monkeypatch, device, native, want):
    monkeypatch.setattr(cpu, "native_bf16_matmul", lambda: native)
    assert calibration_precision("auto", device) == want
    assert calibration_precision("fp32", device) == "fp32" and calibration_precision("bf16", device) == "bf16"


def test_keep_embedding_is_embedding_bits_16(tiny_model, tmp_path):
    runner = CliRunner()
    for name, flag in (("keep", ["--keep-embedding"]), ("bits", ["--embedding-bits", "16"])):
        done = runner.invoke(main, ["quantize", "--model", str(tiny_model), "--out", str(tmp_path / name),
                                    "--no-progress", *flag])
        assert done.exit_code == 0, done.output
    assert (tmp_path / "keep" / "model.safetensors").read_bytes() == (tmp_path / "bits" / "model.safetensors").read_bytes()
    both = runner.invoke(main, ["quantize", "--model", str(tiny_model), "--out", str(tmp_path / "both"),
                                "--keep-embedding", "--embedding-bits", "8"])
    assert both.exit_code == 2 and "--keep-embedding is --embedding-bits 16" in both.output


def test_quantize_help_lists_its_options_in_sections_with_examples():
    text = CliRunner().invoke(main, ["quantize", "--help"]).output
    sections = ["Input and output:", "Precision and recipes:", "Method and calibration:", "GPTQ:", "Examples:"]
    positions = [text.index(s) for s in sections]
    assert positions == sorted(positions)
    assert text.index("--gguf-type") < text.index("Precision and recipes:") < text.index("--recipe")
    assert text.index("GPTQ:") < text.index("--refine") and "--keep-embedding" not in text


@pytest.mark.parametrize("options, words", [
    (dict(group_size="large"), "is neither 'auto' nor a whole number"),
    (dict(overrides=["down_proj"]), "expected PATTERN=BITS"),
    (dict(max_shard_size="lots"), "cannot read size 'lots'"),
    (dict(method="nope"), "method 'nope' is not one of"),
])
def test_bad_api_options_are_one_line_int4q_errors_and_write_nothing(tiny_model, tmp_path, options, words):
    from quantizer.errors import Int4qError

    with pytest.raises(Int4qError, match=words) as caught:
        quantizer.quantize(tiny_model, tmp_path / "q", **options)
    assert "\n" not in str(caught.value) and not (tmp_path / "q").exists()
