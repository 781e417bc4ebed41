import json

import pytest
import torch
from safetensors.torch import load_file

from quantizer.checkpoint import CheckpointReader
from quantizer.errors import InputError
from quantizer.packing import dequantize_codes, unpack_nibbles
from quantizer.pipeline import QuantizeOptions, plan_quantization, run_quantization

from conftest import save_tiny_llama

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_plan_finds_every_linear_from_the_model_structure(tiny_model):
    plan = plan_quantization(tiny_model, QuantizeOptions())
    expected = {f"model.layers.{i}.{p}.{n}" for i in range(2) for p, names in
                (("self_attn", LINEARS[:4]), ("mlp", LINEARS[4:])) for n in names}
    assert set(plan.targets) == expected | {"model.embed_tokens"}
    assert plan.qconfig.group_size == 128  # auto: largest of 128/64/32 dividing 128 and 256
    assert plan.tied_output


def test_untie_head_quantizes_the_head_from_the_table(tiny_model):
    plan = plan_quantization(tiny_model, QuantizeOptions(untie_head=True))
    assert plan.targets["lm_head"] == "model.embed_tokens.weight"
    assert not plan.tied_output and plan.output_config()["tie_word_embeddings"] is False


def test_keep_embedding_leaves_table_and_tied_head_in_bf16(tiny_model):
    plan = plan_quantization(tiny_model, QuantizeOptions(keep_embedding=True))
    assert "model.embed_tokens" not in plan.targets and "lm_head" not in plan.targets
    assert plan.qconfig.quantize_embedding is False


def test_untied_source_head_is_quantized(tmp_path):
    d = save_tiny_llama(tmp_path / "m", tie=False, shard=None)
    plan = plan_quantization(d, QuantizeOptions())
    assert plan.targets["lm_head"] == "lm_head.weight" and not plan.tied_output


def test_ignore_leaves_modules_unquantized(tiny_model):
    plan = plan_quantization(tiny_model, QuantizeOptions(ignore=("down_proj", "model.layers.0.self_attn.q_proj")))
    assert not any(m.endswith("down_proj") for m in plan.targets)
    assert "model.layers.0.self_attn.q_proj" not in plan.targets
    assert "model.layers.1.self_attn.q_proj" in plan.targets


def test_group_size_that_does_not_divide_fails_naming_tensors_and_working_sizes(tmp_path):
    d = save_tiny_llama(tmp_path / "m", shard=None, hidden_size=192, intermediate_size=384, num_attention_heads=4)
    with pytest.raises(InputError, match=r"group size 128 does not divide .*K=192.*sizes that work: 32, 64"):
        plan_quantization(d, QuantizeOptions(group_size=128))
    assert plan_quantization(d, QuantizeOptions()).qconfig.group_size == 64


def test_output_dim_not_multiple_of_16_fails_before_writing(tmp_path):
    d = save_tiny_llama(tmp_path / "m", shard=None, intermediate_size=264)
    with pytest.raises(InputError, match=r"multiples of 16: .*gate_proj.weight \(N=264\)"):
        plan_quantization(d, QuantizeOptions(group_size=32))


def test_integer_weight_is_refused(tmp_path):
    d = save_tiny_llama(tmp_path / "m", shard=None)
    t = load_file(d / "model.safetensors")
    t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"].to(torch.int8)
    from safetensors.torch import save_file

    save_file(t, d / "model.safetensors")
    with pytest.raises(InputError, match=r"up_proj.weight has dtype torch.int8"):
        plan_quantization(d, QuantizeOptions())


def test_already_quantized_input_is_refused(tmp_path, tiny_model):
    out = tmp_path / "q"
    out.mkdir()
    run_quantization(plan_quantization(tiny_model, QuantizeOptions()), out)
    with pytest.raises(InputError, match="already quantized"):
        plan_quantization(out, QuantizeOptions())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_run_writes_the_format_and_copies_the_rest_bit_exactly(tmp_path, dtype):
    src = save_tiny_llama(tmp_path / "src", dtype=dtype, shard="300KB")
    out = tmp_path / "out"
    out.mkdir()
    report = run_quantization(plan_quantization(src, QuantizeOptions(group_size=64, max_shard_bytes=200_000)), out)
    source, result = CheckpointReader(src), CheckpointReader(out)
    assert len(result.files) > 1 and (out / "model.safetensors.index.json").is_file()
    for name in source.infos:
        module = name.removesuffix(".weight")
        if module in report["tensors"]:
            packed = result.get(f"{module}.weight_packed")
            scale, zero = result.get(f"{module}.weight_scale"), result.get(f"{module}.weight_zero")
            n, k = source.infos[name].shape
            assert packed.dtype == torch.uint8 and packed.shape == (n, k // 2)
            assert scale.dtype == zero.dtype == torch.bfloat16 and scale.shape == (n, k // 64)
            w = dequantize_codes(unpack_nibbles(packed), scale, zero, torch.float32)
            bound = scale.float().repeat_interleave(64, 1) * 0.51 + 2**-8 * w.abs()
            assert torch.all((w - source.get(name).float()).abs() <= bound), name
        else:
            t = result.get(name)
            assert t.dtype == dtype and torch.equal(t, source.get(name)), name
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "cpu_int4"
    assert config["quantization_config"]["group_size"] == 64
    assert report["summary"]["bits_per_weight"] == 4.5
    saved = json.loads((out / "quantization_report.json").read_text())
    assert saved["tensors"]["model.layers.0.mlp.down_proj"]["snr_db"] > 15
