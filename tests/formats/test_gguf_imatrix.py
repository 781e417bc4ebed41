"""--imatrix-out: the run's input statistics as llama-imatrix's GGUF file, under the converter's names,
equal to the model's own activations; resumable; refused in one line where it cannot be written;
read by llama-quantize itself (where llama.cpp's tools are built)."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from conftest import interrupt_gptq_at_second_layer, save_tiny_llama

from quantizer.cli.main import main

gguf = pytest.importorskip("gguf")
LLAMA_QUANTIZE = f"{sys.prefix}/share/int4q/llama.cpp/build/bin/llama-quantize"
CALIBRATION = ("--nsamples", "2", "--seqlen", "64")


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def source(smollm2_bf16, tmp_path_factory):
    """A tiny untied Llama with SmolLM2's vocabulary and tokenizer (one the converter recognises)."""
    folder = save_tiny_llama(tmp_path_factory.mktemp("imatrix") / "bf16", tie=False, vocab_size=49152,
                             hidden_size=64, intermediate_size=128, shard=None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_bf16 / name, folder / name)
    return folder


def quantize_with_imatrix(source, tmp_path, method="weighted", *extra):
    imatrix = tmp_path / f"{method}-imatrix.gguf"
    result = run("quantize", "--model", source, "--out", tmp_path / f"{method}-out", "--method", method,
                 *CALIBRATION, "--imatrix-out", imatrix, "--no-progress", *extra)
    assert result.exit_code == 0, result.output
    return imatrix


def entries(path) -> dict[str, tuple[torch.Tensor, float]]:
    """GGUF weight name -> (mean x² per column, rows)."""
    tensors = {t.name: torch.tensor(t.data.copy()) for t in gguf.GGUFReader(path).tensors}
    rows = {name.removesuffix(".counts"): float(t[0]) for name, t in tensors.items() if name.endswith(".counts")}
    return {name: (tensors[f"{name}.in_sum2"] / count, count) for name, count in rows.items()}


def first_layer_input_mean_square(source, text_windows) -> torch.Tensor:
    """The mean x² of layer 0's q/k/v input over the windows, from the bf16 model's own forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    seen = []
    model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].float()))
    with torch.inference_mode():
        for window in text_windows:
            model(input_ids=window[None])
    x = torch.cat([s.reshape(-1, s.shape[-1]) for s in seen])
    return x.pow(2).mean(0)


def test_the_file_is_llama_imatrixs_format_with_every_linear_and_the_head(source, tmp_path):
    path = quantize_with_imatrix(source, tmp_path)
    fields = gguf.GGUFReader(path).fields
    assert fields["general.type"].contents() == "imatrix"
    assert fields["imatrix.chunk_count"].contents() == 2 and fields["imatrix.chunk_size"].contents() == 64
    assert fields["imatrix.datasets"].contents() == ["pydoc_data.topics (calib half)"]
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    expected = {f"blk.{i}.{k}.weight" for i in range(2) for k in kinds} | {"output.weight"}
    found = entries(path)
    assert set(found) == expected
    assert {rows for _, rows in found.values()} == {2 * 64}
    assert found["blk.0.ffn_down.weight"][0].shape == (128,) and found["output.weight"][0].shape == (64,)


def test_the_first_layers_statistic_is_the_models_own_activations_for_both_methods(source, tmp_path):
    from quantizer.calibrate.windows import calibration_windows
    from quantizer.io.text import builtin_text
    from quantizer.io.tokenizer import load_tokenizer

    windows = calibration_windows(load_tokenizer(source), builtin_text("calib"), 2, 64, 0)
    expected = first_layer_input_mean_square(source, windows)
    for method in ("weighted", "gptq"):
        # the reference ran the bf16 model, so calibration does too (auto is fp32 on a CPU without bf16 dot products)
        imatrix = quantize_with_imatrix(source, tmp_path, method, "--calib-precision", "bf16")
        got, _ = entries(imatrix)["blk.0.attn_q.weight"]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-9)


def test_an_interrupted_run_resumes_to_the_same_imatrix(source, tmp_path, monkeypatch):
    (tmp_path / "whole").mkdir()
    whole = quantize_with_imatrix(source, tmp_path / "whole", "gptq")
    undo = interrupt_gptq_at_second_layer(monkeypatch)
    args = ("quantize", "--model", source, "--out", tmp_path / "m", "--method", "gptq", *CALIBRATION,
            "--imatrix-out", tmp_path / "m.gguf", "--no-progress")
    result = run(*args)
    assert result.exit_code == 130 and not (tmp_path / "m.gguf").exists()
    undo()
    assert run(*args, "--resume").exit_code == 0
    assert (tmp_path / "m.gguf").read_bytes() == whole.read_bytes()


@pytest.mark.parametrize("out, imatrix, extra, message", [
    ("out", "imatrix.gguf", ("--method", "minmax"), "--imatrix-out needs a calibrated method"),
    ("out", "imatrix.dat", ("--method", "weighted"), "--imatrix-out imatrix.dat: llama.cpp's importance matrix is "
                                                      "one file; give it a name ending in .gguf"),
    ("m.gguf", "m.gguf", ("--method", "weighted", "--format", "gguf"), "--imatrix-out and --out name the same file"),
])
def test_a_request_the_imatrix_cannot_follow_is_one_line_and_writes_nothing(source, tmp_path, monkeypatch, out,
                                                                            imatrix, extra, message):
    monkeypatch.chdir(tmp_path)
    result = run("quantize", "--model", source, "--out", out, *extra, *CALIBRATION, "--imatrix-out", imatrix)
    assert result.exit_code != 0 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_a_link_or_a_file_int4q_did_not_write_is_never_replaced(source, tmp_path):
    precious = tmp_path / "precious.gguf"
    precious.write_bytes(b"not int4q's")
    os.symlink(precious, tmp_path / "link.gguf")
    for name, flags, message in (("link.gguf", (), "is a link"), ("precious.gguf", (), "already exists"),
                                 ("precious.gguf", ("--overwrite",), "not a file int4q wrote")):
        result = run("quantize", "--model", source, "--out", tmp_path / "out", "--method", "weighted", *CALIBRATION,
                     "--imatrix-out", tmp_path / name, *flags)
        assert result.exit_code != 0 and message in result.stderr, result.output
    assert precious.read_bytes() == b"not int4q's" and sorted(p.name for p in tmp_path.iterdir()) == [
        "link.gguf", "precious.gguf"]


@pytest.mark.skipif(not shutil.which(LLAMA_QUANTIZE), reason="llama.cpp's tools are not built here: "
                    "bash scripts/setup_gguf.sh --build")
def test_llama_quantize_uses_every_entry(source, tmp_path):
    from quantizer.formats.gguf.converter import converter_root

    imatrix = quantize_with_imatrix(source, tmp_path)
    bf16 = tmp_path / "bf16.gguf"
    subprocess.run([sys.executable, str(converter_root() / "convert_hf_to_gguf.py"), str(source), "--outtype", "bf16",
                    "--outfile", str(bf16)], check=True, capture_output=True, timeout=300)
    done = subprocess.run([LLAMA_QUANTIZE, "--imatrix", str(imatrix), str(bf16), str(tmp_path / "q.gguf"), "Q4_0", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded 15 importance matrix entries" in done.stdout + done.stderr
