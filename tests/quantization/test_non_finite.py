"""A weight holding NaN or infinities is refused by every method, naming the tensor and the count,
unless the user keeps it in bf16; verify then fails it by name (its structural check fails every
non-finite float tensor, kept ones included), and fails non-finite stored scales."""

import shutil

import pytest
from click.testing import CliRunner
from conftest import save_byte_tokenizer, save_tiny_llama
from safetensors.torch import load_file, save_file

from quantizer.cli import main

BAD = "model.layers.1.mlp.up_proj"


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    """The tiny Llama (one shard, with a tokenizer) with 3 NaN/Inf values in one weight."""
    path = save_tiny_llama(tmp_path_factory.mktemp("nan") / "bf16", shard=None, max_position_embeddings=512)
    save_byte_tokenizer(path)
    tensors = load_file(path / "model.safetensors")
    w = tensors[f"{BAD}.weight"]
    w[0, 0], w[1, 5], w[7, 7] = float("nan"), float("inf"), -float("inf")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def quantize(src, out, *extra):
    return CliRunner().invoke(main, ["quantize", "--model", str(src), "--out", str(out), "--no-progress", *extra])


@pytest.mark.parametrize("method", ["minmax", "weighted", "gptq"])
def test_a_non_finite_weight_is_refused_naming_it_and_the_count(poisoned, tmp_path, method):
    extra = [] if method == "minmax" else ["--nsamples", "2", "--seqlen", "64"]
    result = quantize(poisoned, tmp_path / "q", "--method", method, *extra)
    assert result.exit_code == 1, result.output
    assert f"{BAD}.weight holds 3 NaN or infinite values" in result.output and f"--ignore {BAD}" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "q").exists()


def test_kept_in_bf16_it_quantizes_and_verify_names_the_kept_non_finite_tensor(poisoned, tmp_path):
    result = quantize(poisoned, tmp_path / "q", "--ignore", BAD)
    assert result.exit_code == 0, result.output
    verified = CliRunner().invoke(main, ["verify", str(tmp_path / "q"), "--reference", str(poisoned), "--ctx", "64",
                                         "--max-windows", "1", "--greedy-tokens", "2"])
    assert verified.exit_code == 1 and f"{BAD}.weight: holds 3 NaN or infinite values" in verified.output


def test_verify_round_trip_fails_a_stored_nan_scale(tmp_path):
    src = save_tiny_llama(tmp_path / "bf16", shard=None)
    assert quantize(src, tmp_path / "q").exit_code == 0
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "q", bad)
    tensors = load_file(bad / "model.safetensors")
    tensors[f"{BAD}.weight_scale"][0, 0] = float("nan")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    result = CliRunner().invoke(main, ["verify", str(bad), "--reference", str(src)])
    assert result.exit_code != 0
    assert f"{BAD}.weight_scale: holds 1 NaN or infinite values" in result.output, result.output
