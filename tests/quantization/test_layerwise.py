"""The layer-wise calibration driver, run with GPTQ: it matches a whole-model GPTQ, groups linears
into true-sequential steps, and resumes to identical bytes."""

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import interrupt_gptq_at_second_layer, whole_model_hessians

import quantizer.calibrate.capture as capture
from quantizer.calibrate.state import STATE_DIR
from quantizer.calibrate.windows import CalibrationSettings, calibration_windows
from quantizer.cli.main import main
from quantizer.errors import InputError
from quantizer.io.checkpoint import CheckpointReader
from quantizer.io.text import builtin_text
from quantizer.methods.gptq_method import GptqSettings
from quantizer.quantization.calibrated import run_calibrated
from quantizer.quantization.planning import QuantizeOptions, plan_quantization

OPTIONS = CalibrationSettings(nsamples=4, seqlen=64, seed=0)


def streamed(src, out, tokenizer, resume=False, options=OPTIONS, group=64, settings=None):
    out.mkdir(exist_ok=True)
    plan = plan_quantization(src, QuantizeOptions(group_size=group, untie_head=True, method="gptq"))
    return run_calibrated(plan, out, tokenizer, builtin_text("calib"), "calib", options, settings, resume=resume)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_streamed_gptq_sees_the_same_inputs_as_whole_model_gptq(tiny_model_tok, byte_tokenizer, tmp_path,
                                                                   monkeypatch, precision):
    streamed_h = {}
    real_accumulate, real_head = capture.accumulate, capture.head_statistic

    def record(layer, step, hidden, kwargs, method, *rest):
        acc = real_accumulate(layer, step, hidden, kwargs, method, *rest)
        streamed_h[f"model.layers.{len([k for k in streamed_h if k.endswith(step[0])])}.{step[0]}"] = acc.H
        return acc

    held = []

    def record_head(model, *args):
        acc = real_head(model, *args)
        streamed_h["lm_head"] = acc.H
        held.extend(name for name, p in model.named_parameters() if not p.is_meta)
        return acc

    monkeypatch.setattr(capture, "accumulate", record)
    monkeypatch.setattr(capture, "head_statistic", record_head)
    options = CalibrationSettings(OPTIONS.nsamples, OPTIONS.seqlen, 0, precision)
    report = streamed(tiny_model_tok, tmp_path / "q", byte_tokenizer, options=options)
    windows = calibration_windows(byte_tokenizer, builtin_text("calib"), OPTIONS.nsamples, OPTIONS.seqlen, 0)
    reference = whole_model_hessians(tiny_model_tok, windows, CheckpointReader(tmp_path / "q"), options.dtype)
    assert set(reference) == set(streamed_h) and len(reference) == 2 * 4 + 1
    assert held == ["model.norm.weight"]  # read before the layers; the head's pass let go of the table it read
    for key, H in reference.items():
        assert torch.allclose(streamed_h[key], H, rtol=1e-4, atol=1e-5 * H.abs().max().item()), key
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    qc = config["quantization_config"]
    assert qc["method"] == "gptq" and qc["calibration"]["nsamples"] == 4
    assert qc["calibration"]["precision"] == precision
    for module, entry in report.tensors.items():
        if entry["method"] == "gptq":
            assert entry["gptq_loss"] < entry["rtn_loss"], module
    assert report.tensors["model.embed_tokens"]["method"] == "minmax"


def interrupted_run(src, out, tokenizer, monkeypatch):
    """A run interrupted (KeyboardInterrupt) as the second decoder layer is loaded."""
    undo = interrupt_gptq_at_second_layer(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        streamed(src, out, tokenizer)
    undo()


def test_resume_gives_the_same_bytes_as_an_uninterrupted_run(tiny_model_tok, byte_tokenizer, tmp_path, monkeypatch):
    streamed(tiny_model_tok, tmp_path / "whole", byte_tokenizer)
    interrupted_run(tiny_model_tok, tmp_path / "resumed", byte_tokenizer, monkeypatch)
    assert json.loads((tmp_path / "resumed" / STATE_DIR / "state.json").read_text())["layers_done"] == 1
    streamed(tiny_model_tok, tmp_path / "resumed", byte_tokenizer, resume=True)
    assert_same_outputs(tmp_path / "whole", tmp_path / "resumed")


def assert_same_outputs(a_dir, b_dir):
    names = sorted(p.name for p in a_dir.iterdir())
    assert names == sorted(p.name for p in b_dir.iterdir())
    for name in names:
        a, b = (a_dir / name).read_bytes(), (b_dir / name).read_bytes()
        if name == "quantization_report.json":  # wall time and peak memory differ; every number else must not
            a, b = json.loads(a), json.loads(b)
            for r in (a, b):
                for key in ("seconds", "peak_rss_mb", "calibration_peak_rss_mb_per_rank"):
                    r["summary"].pop(key)
        assert a == b, name


def test_a_kill_between_hidden_states_and_state_resumes_from_the_right_layer(tiny_model_tok, byte_tokenizer,
                                                                            tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    streamed(tiny_model_tok, tmp_path / "whole", byte_tokenizer)
    interrupted_run(tiny_model_tok, tmp_path / "resumed", byte_tokenizer, monkeypatch)
    state = tmp_path / "resumed" / STATE_DIR
    # What a kill right after layer 2's activations were renamed into place leaves: they exist,
    # but state.json still says one layer is done.
    ahead = load_file(str(state / "hidden-00001.safetensors"))["hidden"] * 2
    save_file({"hidden": ahead}, str(state / "hidden-00002.safetensors"))
    (state / "layer-00001.safetensors.tmp").write_bytes(b"half-written")
    streamed(tiny_model_tok, tmp_path / "resumed", byte_tokenizer, resume=True)
    assert_same_outputs(tmp_path / "whole", tmp_path / "resumed")


@pytest.mark.parametrize("damage", ["missing hidden states", "corrupt state"])
def test_an_inconsistent_state_is_refused_in_one_line(tiny_model_tok, byte_tokenizer, tmp_path, monkeypatch, damage):
    interrupted_run(tiny_model_tok, tmp_path / "q", byte_tokenizer, monkeypatch)
    state = tmp_path / "q" / STATE_DIR
    if damage == "missing hidden states":
        (state / "hidden-00001.safetensors").unlink()
    else:
        (state / "state.json").write_text('{"layers_done": ')
    with pytest.raises(InputError, match="incomplete|was changed after int4q wrote it") as caught:
        streamed(tiny_model_tok, tmp_path / "q", byte_tokenizer, resume=True)
    assert "without --resume" in str(caught.value) and "\n" not in str(caught.value)


def test_resume_with_different_settings_is_refused(tiny_model_tok, byte_tokenizer, tmp_path, monkeypatch):
    interrupted_run(tiny_model_tok, tmp_path / "q", byte_tokenizer, monkeypatch)
    other = GptqSettings(damp=0.05)
    with pytest.raises(InputError, match="different inputs or settings"):
        streamed(tiny_model_tok, tmp_path / "q", byte_tokenizer, resume=True, settings=other)


def test_cli_gptq_runs_and_verifies(tiny_model_tok, tmp_path):
    out = tmp_path / "g"
    runner = CliRunner()
    result = runner.invoke(main, ["quantize", "--model", str(tiny_model_tok), "--out", str(out), "--method", "gptq",
                                  "--group-size", "32", "--sym", "--nsamples", "4", "--seqlen", "64", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "quantized 16 tensors" in result.stdout  # 14 linears, the table, the untied head
    verified = runner.invoke(main, ["verify", str(out), "--model", str(tiny_model_tok), "--greedy-tokens", "0",
                                    "--ctx", "64", "--max-windows", "2"])
    assert verified.exit_code == 0, verified.output
    assert "[ok] end to end" in verified.stdout


def test_cli_gptq_with_empty_calibration_file_is_one_line(tiny_model_tok, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    result = CliRunner().invoke(main, ["quantize", "--model", str(tiny_model_tok), "--out", str(tmp_path / "g"),
                                       "--method", "gptq", "--calib", str(tmp_path / "empty.txt")])
    assert result.exit_code == 1 and "empty.txt: no text" in result.stderr
    assert not (tmp_path / "g").exists()


def test_cli_gptq_format_export(tiny_model_tok, tmp_path):
    from quantizer.formats.gptq_v1 import dequantize_gptq, unpack_int32

    out = tmp_path / "g"
    result = CliRunner().invoke(main, ["quantize", "--model", str(tiny_model_tok), "--out", str(out), "--method",
                                       "gptq", "--format", "gptq", "--group-size", "64", "--nsamples", "4",
                                       "--seqlen", "64", "--no-progress"])
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    # what transformers/optimum and GPTQModel read: every loader accepts it as it is
    assert qc["quant_method"] == "gptq" and qc["desc_act"] is False and qc["checkpoint_format"] == "gptq"
    assert qc["sym"] is True and qc["lm_head"] is False and 0 < qc["damp_percent"] < 1 and qc["bits"] == 4
    assert config["tie_word_embeddings"] is True  # the bf16 head stays tied to the bf16 table
    reader, source = CheckpointReader(out), CheckpointReader(tiny_model_tok)
    assert "lm_head.qweight" not in reader.infos and "lm_head.weight" not in reader.infos
    assert reader.infos["model.embed_tokens.weight"].dtype == torch.bfloat16
    zeros = unpack_int32(reader.get("model.layers.0.mlp.down_proj.qzeros"))
    assert bool((zeros == 7).all())  # symmetric: zero point 8, stored as 7 in v1
    m = "model.layers.0.mlp.down_proj"
    w = dequantize_gptq(*(reader.get(f"{m}.{s}") for s in ("qweight", "qzeros", "scales", "g_idx")))
    assert w.shape == (128, 256)
    snr = 10 * torch.log10(source.get(f"{m}.weight").float().pow(2).sum() / (w - source.get(f"{m}.weight").float()).pow(2).sum())
    assert snr > 10
    assert "cpu_int4 checkpoints, not quant_method 'gptq'" in CliRunner().invoke(main, ["bench", str(out)]).stderr



def test_cli_gptq_export_for_vllm_quantizes_the_head_on_an_asymmetric_grid(tiny_model_tok, tmp_path):
    out = tmp_path / "g"
    result = CliRunner().invoke(main, ["quantize", "--model", str(tiny_model_tok), "--out", str(out), "--method",
                                       "gptq", "--format", "gptq", "--group-size", "64", "--nsamples", "4",
                                       "--seqlen", "64", "--asym", "--head-bits", "4", "--no-progress"])
    assert result.exit_code == 0, result.output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["sym"] is False and qc["lm_head"] is True and qc["damp_percent"] == 0.01
    assert CheckpointReader(out).infos["lm_head.qweight"].shape == (128 // 8, 512)

def test_weighted_rounding_keeps_the_head_tied_and_verifies(tiny_model_tok, tmp_path):
    out = tmp_path / "w"
    result = CliRunner().invoke(main, ["quantize", "--model", str(tiny_model_tok), "--out", str(out), "--method",
                                       "weighted", "--recipe", "mixed", "--nsamples", "4", "--seqlen", "64",
                                       "--no-progress"])
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["quantization_config"]["method"] == "weighted"
    report = json.loads((out / "quantization_report.json").read_text())
    assert report["tensors"]["model.embed_tokens"]["method"] == "minmax"  # the 8-bit table: per channel
    assert report["tensors"]["model.layers.0.mlp.up_proj"]["method"] == "weighted"
    verified = CliRunner().invoke(main, ["verify", str(out), "--reference", str(tiny_model_tok), "--greedy-tokens",
                                         "4", "--ctx", "64", "--max-windows", "2"])
    assert verified.exit_code == 0, verified.output
    generated = CliRunner().invoke(main, ["generate", str(out), "--prompt", "def f(x):", "--max-new-tokens", "4",
                                          "--no-compile"])
    assert generated.exit_code == 0, generated.output


def test_weighted_grids_change_gptq_only_where_asked(tiny_model_tok, byte_tokenizer, tmp_path):
    plain = streamed(tiny_model_tok, tmp_path / "plain", byte_tokenizer,
                     settings=GptqSettings(weighted_grids=False))
    weighted = streamed(tiny_model_tok, tmp_path / "wg", byte_tokenizer)
    m = "model.layers.0.mlp.down_proj"
    assert weighted.quantization_config["calibration"]["weighted_grids"] is True
    assert plain.quantization_config["calibration"]["weighted_grids"] is False
    a, b = CheckpointReader(tmp_path / "plain"), CheckpointReader(tmp_path / "wg")
    assert not torch.equal(a.get(f"{m}.weight_scale"), b.get(f"{m}.weight_scale"))
    assert weighted.tensors[m]["gptq_loss"] < 1.5 * plain.tensors[m]["gptq_loss"]
