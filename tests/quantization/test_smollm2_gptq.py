"""GPTQ on the real SmolLM2-135M: a short calibration already beats round-to-nearest end to end."""

import json

from click.testing import CliRunner

from quantizer.cli.main import main


def kld_of(qdir, source, tmp_path, name):
    report = tmp_path / f"{name}.json"
    result = CliRunner().invoke(main, ["verify", str(qdir), "--model", str(source), "--ctx", "256", "--max-windows",
                                       "4", "--greedy-tokens", "0", "--json", str(report)])
    assert result.exit_code == 0, result.output
    return json.loads(report.read_text())["fidelity"]


def test_smollm2_gptq_g64_beats_rtn_g64(smollm2_bf16, smollm2_g64, tmp_path):
    out = tmp_path / "gptq"
    result = CliRunner().invoke(main, ["quantize", "--model", str(smollm2_bf16), "--out", str(out), "--method", "gptq",
                                       "--group-size", "64", "--nsamples", "8", "--seqlen", "128", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "quantized 212 tensors" in result.stdout  # 210 linears, the table, the untied head
    gptq, rtn = kld_of(out, smollm2_bf16, tmp_path, "gptq"), kld_of(smollm2_g64, smollm2_bf16, tmp_path, "rtn")
    assert gptq["kld_mean"] < 0.8 * rtn["kld_mean"]
    assert gptq["top1_agreement"] > rtn["top1_agreement"]
