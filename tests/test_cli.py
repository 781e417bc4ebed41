import json
import os
import subprocess
import sys

from click.testing import CliRunner

from quantizer.cli import main


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
    result = run("quantize", "--model", tiny_model, "--out", tmp_path / "q", "--group-size", "256")
    assert_one_line_error(result, "group size 256 does not divide")
    assert list(tmp_path.iterdir()) == []


def test_interrupted_run_leaves_no_output(tiny_model, tmp_path, monkeypatch):
    import quantizer.pipeline as pipeline

    real, calls = pipeline.quantize_rtn, []

    def interrupt_on_fifth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "quantize_rtn", interrupt_on_fifth)
    result = run("quantize", "--model", tiny_model, "--out", tmp_path / "q", "--no-progress")
    assert result.exit_code == 130 and "interrupted" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_unexpected_failure_is_one_line_without_traceback(tiny_model, tmp_path, monkeypatch):
    import quantizer.pipeline as pipeline

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded\nsecond line")

    monkeypatch.setattr(pipeline, "quantize_rtn", broken)
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
