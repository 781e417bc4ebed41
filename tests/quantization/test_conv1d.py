"""Transposed linears (transformers' Conv1D, GPT-2's projections) are quantized like any other
linear, by every method, and whatever int4q leaves in bf16 is named with its share."""

import pytest
import torch
from click.testing import CliRunner
from conftest import save_tiny_gpt2, save_tiny_llama

from quantizer.cli.main import main
from quantizer.io.checkpoint import CheckpointReader, read_config
from quantizer.io.structure import inspect_structure
from quantizer.quantization.planning import QuantizeOptions, plan_quantization
from quantizer.runtime import load_model
from quantizer.runtime.nn.int4 import Int4Linear

CONV1D = [f"transformer.h.{i}.{m}" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return save_tiny_gpt2(tmp_path_factory.mktemp("gpt2") / "src")


def test_the_structure_names_conv1d_projections_as_transposed_linears(gpt2):
    structure = inspect_structure(read_config(gpt2))
    assert set(CONV1D) <= set(structure.linears) and structure.transposed == frozenset(CONV1D)
    assert structure.linear_shape("transformer.h.0.mlp.c_fc", (128, 512)) == (512, 128)
    assert [kind for kind, *_ in structure.left_out] == ["Embedding"]  # wpe: positions, not a linear


def test_a_llama_leaves_no_matrix_unquantized(tmp_path):
    save_tiny_llama(tmp_path / "src")
    plan = plan_quantization(tmp_path / "src", QuantizeOptions(group_size=32))
    assert plan.structure.left_out == () and not any("kept in bf16, no int4q" in n for n in plan.notes)


@pytest.mark.parametrize("method", ["minmax", "weighted", "gptq"])
def test_every_gpt2_projection_is_4bit_and_verify_passes_its_round_trip(gpt2, tmp_path, method):
    out = tmp_path / "q"
    calib = ["--nsamples", "4", "--seqlen", "64"] if method != "minmax" else []
    result = CliRunner().invoke(main, ["quantize", "--model", str(gpt2), "--out", str(out), "--group-size", "64",
                                       "--method", method, "--no-progress", *calib])
    assert result.exit_code == 0, result.output
    assert "kept in bf16, no int4q quantizer for their type: Embedding (transformer.wpe: " in result.output
    reader, source = CheckpointReader(out), CheckpointReader(gpt2)
    for module in CONV1D:
        k, n = source.infos[f"{module}.weight"].shape  # Conv1D stores [in, out]
        assert reader.infos[f"{module}.weight_packed"].shape == (n, k // 2)
        assert f"{module}.weight" not in reader.infos
    checked = CliRunner().invoke(main, ["verify", str(out), "--model", str(gpt2), "--ctx", "64", "--max-windows", "2",
                                        "--greedy-tokens", "4", "--max-kld", "0.01"])
    assert checked.exit_code == 0, checked.output
    assert f"SNR over {len(CONV1D) + 1 + (method == 'gptq')} quantized tensors" in checked.output


def test_a_quantized_conv1d_runs_as_its_transposed_dequantized_weight(gpt2, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "q"
    assert CliRunner().invoke(main, ["quantize", "--model", str(gpt2), "--out", str(out), "--group-size", "64",
                                     "--no-progress"]).exit_code == 0
    model = load_model(out, fuse=False)
    source = AutoModelForCausalLM.from_pretrained(gpt2, dtype=torch.bfloat16).eval()
    for module in CONV1D[:4]:
        quantized, original = model.get_submodule(module), source.get_submodule(module)
        assert isinstance(quantized, Int4Linear)
        x = torch.randn(3, original.weight.shape[0], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        want = x.float() @ original.weight.float() + original.bias.float()
        got = quantized(x).float()
        assert (got - want).norm() < 0.2 * want.norm(), module
