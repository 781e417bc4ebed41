import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from quantizer.cli.main import main

from conftest import interrupt_gptq_at_second_layer


def run(*args, **kwargs):
    return CliRunner().invoke(main, [str(a) for a in args], **kwargs)


def assert_one_line_error(result, pattern, code=1):
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and pattern in lines[0], result.stderr


def test_quantize_two_shard_model_end_to_end(tiny_model, tmp_path):
    out = tmp_path / "q"
    result = run("quantize", "--model", tiny_model, "--out", out, "--group-size", "64", "--no-progress")
    assert result.exit_code == 0, result.output
    assert "quantized 15 tensors at group 64" in result.stdout and "peak RSS" in result.stdout
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["group_size"] == 64 and config["quant_method"] == "cpu_int4"
    assert (out / "quantization_report.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_existing_output_is_refused_without_overwrite(tiny_model, tmp_path):
    (tmp_path / "q").mkdir()
    result = run("quantize", "--model", tiny_model, "--out", tmp_path / "q")
    assert result.exit_code == 2 and "--overwrite" in result.stderr


def test_missing_config_is_one_line(tmp_path):
    (tmp_path / "m").mkdir()
    assert_one_line_error(run("quantize", "--model", tmp_path / "m", "--out", tmp_path / "q"), "no config.json")
    assert not (tmp_path / "q").exists()


def test_group_size_error_writes_nothing(tiny_model, tmp_path):
    result = run("quantize", "--model", tiny_model, "--out", tmp_path / "q", "--group-size", "256", "--strict-group-size")
    assert_one_line_error(result, "group size 256 does not divide")
    assert list(tmp_path.iterdir()) == []


def test_interrupted_run_leaves_no_output(tiny_model, tmp_path, monkeypatch):
    import quantizer.methods.rtn as rtn

    real, calls = rtn.quantize_rtn, []

    def interrupt_on_fifth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(rtn, "quantize_rtn", interrupt_on_fifth)
    result = run("quantize", "--model", tiny_model, "--out", tmp_path / "q", "--no-progress")
    assert result.exit_code == 130 and "interrupted" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_unexpected_failure_is_one_line_without_traceback(tiny_model, tmp_path, monkeypatch):
    import quantizer.methods.rtn as rtn

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded\nsecond line")

    monkeypatch.setattr(rtn, "quantize_rtn", broken)
    result = run("quantize", "--model", tiny_model, "--out", tmp_path / "q", "--no-progress")
    assert_one_line_error(result, "internal error: RuntimeError: kernel exploded")
    assert list(tmp_path.iterdir()) == []


def test_hub_id_when_offline_is_a_clear_error(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    proc = subprocess.run(
        [sys.executable, "-m", "quantizer", "quantize", "--model", "someone/not-here", "--out", str(tmp_path / "q")],
        env=env, capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "someone/not-here: not a local folder and could not be fetched from the Hub" in proc.stderr


def edited_copy(src, dst, edit_config=None, edit_index=None):
    import shutil

    shutil.copytree(src, dst)
    if edit_config:
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(edit_config(config)))
    if edit_index:
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        (dst / "model.safetensors.index.json").write_text(json.dumps(edit_index(index)))
    return dst


@pytest.mark.parametrize("edit,message", [
    (lambda c: {**c, "intermediate_size": 320}, "the model expects [320, 128]"),
    (lambda c: {**c, "num_hidden_layers": 1}, "model.layers.1.input_layernorm.weight: stray tensor"),
    (lambda c: [c], "holds a JSON list, not an object"),
    (lambda c: {**c, "model_type": "no-such-model"}, "cannot build model_type 'no-such-model' (an unknown model type)"),
])
def test_a_config_that_does_not_describe_the_weights_is_one_line(tiny_model, tmp_path, edit, message):
    bad = edited_copy(tiny_model, tmp_path / "bad", edit_config=edit)
    result = run("quantize", "--model", bad, "--out", tmp_path / "q", "--no-progress")
    assert_one_line_error(result, message)
    assert len(result.stderr) < 400 and not (tmp_path / "q").exists()


def test_an_index_naming_a_tensor_no_shard_holds_is_one_line(tiny_model, tmp_path):
    def add_ghost(index):
        index["weight_map"]["model.ghost.weight"] = sorted(index["weight_map"].values())[0]
        return index

    bad = edited_copy(tiny_model, tmp_path / "bad", edit_index=add_ghost)
    result = run("quantize", "--model", bad, "--out", tmp_path / "q", "--no-progress")
    assert_one_line_error(result, "places model.ghost.weight in")


def test_too_little_free_space_is_refused_before_any_work(tiny_model, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    result = run("quantize", "--model", tiny_model, "--out", tmp_path / "q", "--no-progress")
    assert_one_line_error(result, f"{tmp_path} has 0.00 GB free, but writing q needs about")
    assert list(tmp_path.iterdir()) == []


def test_disk_full_mid_write_is_one_line_on_its_own_line(tiny_model, tmp_path, monkeypatch):
    import errno

    import quantizer.io.shards as shards

    def full(f, offset, tensor):
        raise OSError(errno.ENOSPC, "No space left on device", f.name)

    monkeypatch.setattr(shards, "_write_tensor", full)
    result = run("quantize", "--model", tiny_model, "--out", tmp_path / "q")  # with the progress bar
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    error = [line for line in result.stderr.splitlines() if "no space left" in line]
    assert len(error) == 1 and error[0].startswith("Error: no space left on the device while writing ")
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_gptq_run_says_what_it_kept_and_how_to_resume(tiny_model_tok, tmp_path, monkeypatch):
    interrupt_gptq_at_second_layer(monkeypatch)
    result = run("quantize", "--model", tiny_model_tok, "--out", tmp_path / "g", "--method", "gptq",
                 "--nsamples", 2, "--seqlen", 32, "--no-progress")
    assert result.exit_code == 130
    assert "interrupted; the finished layers are kept in" in result.stderr and "--resume" in result.stderr


def test_generate_refuses_an_empty_prompt(tiny_q):
    result = run("generate", tiny_q, "--prompt", "  ")
    assert result.exit_code == 2 and "the prompt is empty" in result.stderr


def test_bench_json_into_a_missing_folder_is_refused_before_measuring(tiny_q, tmp_path):
    result = run("bench", tiny_q, "--json", tmp_path / "nope" / "b.json")
    assert result.exit_code == 2 and "does not exist" in result.stderr


def test_bench_without_prefill(tiny_q, tmp_path):
    result = run("bench", tiny_q, "--prompt-tokens", 0, "--gen-tokens", 3, "--reps", 1, "--no-compile",
                 "--json", tmp_path / "b.json")
    assert result.exit_code == 0, result.output
    arm = json.loads((tmp_path / "b.json").read_text())["arms"]["int4"]
    assert arm["pp_median"] is None and arm["tg_median"] > 0 and arm["decode_path"] == "eager"
