"""Planning: which tensors are quantized, copied or dropped, decided and checked before any write."""

import pytest
import torch
from conftest import save_tiny_llama
from safetensors.torch import load_file

from quantizer.errors import InputError
from quantizer.quantization.planning import QuantizeOptions, plan_quantization
from quantizer.quantization.recipes import Override
from quantizer.quantization.streamed import run_quantization

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


def test_a_group_that_does_not_divide_falls_back_per_tensor_or_fails_when_strict(tmp_path):
    d = save_tiny_llama(tmp_path / "m", shard=None, hidden_size=192, intermediate_size=384, num_attention_heads=4)
    with pytest.raises(InputError, match=r"group size 128 does not divide .*K=192.*sizes that work: 32, 64"):
        plan_quantization(d, QuantizeOptions(group_size=128, strict_group_size=True))
    assert plan_quantization(d, QuantizeOptions()).qconfig.group_size == 64
    fallen = plan_quantization(d, QuantizeOptions(group_size=128))
    assert fallen.qconfig.group_size == 128
    assert fallen.qconfig.scheme_for("model.layers.0.self_attn.q_proj").group_size == 64
    assert fallen.qconfig.scheme_for("model.layers.0.mlp.down_proj").group_size == 128  # K=384
    assert fallen.fallbacks["model.layers.0.self_attn.q_proj"] == \
        "model.layers.0.self_attn.q_proj: group 64 (K=192 is not a multiple of 128)"


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


def test_a_quantized_checkpoint_plans_as_the_float_model_it_stands_for_with_its_grids(tmp_path, tiny_model):
    out = tmp_path / "q"
    out.mkdir()
    run_quantization(plan_quantization(tiny_model, QuantizeOptions(group_size=32)), out)
    plan = plan_quantization(out, QuantizeOptions())
    module = "model.layers.0.mlp.down_proj"
    assert plan.source_quantized and "quantization_config" not in plan.source_config
    assert plan.targets[module] == f"{module}.weight" and plan.source_grid(module) is not None
    assert plan.scheme_of(module).group_size == 32 and plan.notes[0].startswith("the source is int4q cpu_int4")
    assert not plan_quantization(tiny_model, QuantizeOptions()).source_quantized


def test_what_the_format_and_method_require_is_applied_with_a_note(tiny_model, tmp_path):
    plain = plan_quantization(tiny_model, QuantizeOptions())
    assert plain.notes == () and plain.tied_output
    gptq = plan_quantization(tiny_model, QuantizeOptions(method="gptq", checkpoint_format="gptq", symmetric=None))
    assert "model.embed_tokens" not in gptq.targets and "lm_head" not in gptq.targets and gptq.tied_output
    assert gptq.options.symmetric and gptq.output_config()["quantization_config"]["lm_head"] is False
    assert [n.split(",")[0].split(":")[0] for n in gptq.notes] == [
        "the gptq export uses a symmetric grid", "the gptq format has no quantized vocabulary table",
        "the gptq export keeps lm_head in bf16"]
    for_vllm = plan_quantization(tiny_model, QuantizeOptions(method="gptq", checkpoint_format="gptq", head_bits=4))
    assert "lm_head" in for_vllm.targets and not for_vllm.tied_output and not for_vllm.options.symmetric
    assert for_vllm.output_config()["quantization_config"]["lm_head"] is True
    assert [n.split(":")[0] for n in for_vllm.notes] == ["the gptq format has no quantized vocabulary table",
                                                        "gptq quantizes the head on its own inputs"]
    asked = plan_quantization(tiny_model, QuantizeOptions(method="gptq", untie_head=True, keep_embedding=True,
                                                          checkpoint_format="gptq"))
    assert asked.notes == ()
    untied = save_tiny_llama(tmp_path / "untied", tie=False)
    assert plan_quantization(untied, QuantizeOptions(method="gptq")).notes == ()


def test_the_plan_specs_are_what_the_format_writes(tiny_model):
    plan = plan_quantization(tiny_model, QuantizeOptions(group_size=32, untie_head=True))
    specs = {s.name: s for s in plan.output_specs()}
    assert specs["lm_head.weight_scale"].shape == (512, 4) and "lm_head.weight" not in specs
    assert plan.modules_from("model.embed_tokens.weight") == ["model.embed_tokens", "lm_head"]
    assert plan.disk_bytes_needed() == sum(s.nbytes for s in specs.values())


def test_an_all_4_bit_plan_writes_exactly_todays_config(tiny_model):
    qc = plan_quantization(tiny_model, QuantizeOptions(group_size=64)).qconfig.to_dict()
    assert sorted(qc) == sorted(["group_size", "ignore", "quantize_embedding", "prefill_dequant", "direct_dequant",
                                 "dequant_threshold", "use_custom_op", "method", "symmetric", "clip_search",
                                 "calibration", "bits", "quant_method", "format_version"])


def test_table_and_head_bits_decide_tying(tiny_model, tmp_path):
    from quantizer.quantization.recipes import Override

    tied8 = plan_quantization(tiny_model, QuantizeOptions(embedding_bits=8))
    assert tied8.tied_output and tied8.qconfig.scheme_for("model.embed_tokens").bits == 8 and tied8.notes == ()
    split = plan_quantization(tiny_model, QuantizeOptions(head_bits=8))
    assert not split.tied_output and split.qconfig.scheme_for("lm_head").bits == 8
    assert split.qconfig.scheme_for("model.embed_tokens").bits == 4 and "lm_head has 8 bits" in split.notes[0]
    with pytest.raises(InputError, match="stay in bf16 only with the table"):
        plan_quantization(tiny_model, QuantizeOptions(head_bits=16))
    kept = plan_quantization(tiny_model, QuantizeOptions(embedding_bits=16, head_bits=16))
    assert kept.tied_output and "model.embed_tokens" not in kept.targets and not kept.qconfig.quantize_embedding
    untied = save_tiny_llama(tmp_path / "untied", tie=False)
    plan = plan_quantization(untied, QuantizeOptions(head_bits=16, overrides=(Override("down_proj", 8),
                                                                              Override("up_proj", 16))))
    assert "lm_head" not in plan.targets and "lm_head" in plan.qconfig.ignore
    assert plan.qconfig.scheme_for("model.layers.0.mlp.down_proj").bits == 8
    assert plan.qconfig.scheme_for("model.layers.0.mlp.up_proj").kept
    assert "model.layers.0.mlp.up_proj" not in plan.targets
    with pytest.raises(InputError, match="stores 4-bit modules only"):
        plan_quantization(untied, QuantizeOptions(checkpoint_format="gptq", head_bits=8))


def test_an_override_that_names_no_module_is_an_error_with_the_nearest_names(tiny_model):
    with pytest.raises(InputError, match=r"--override down_prj=8: no module of this model is named down_prj .*"
                                         r"nearest: down_proj"):
        plan_quantization(tiny_model, QuantizeOptions(overrides=(Override.parse("down_prj=8"),)))
    plan = plan_quantization(tiny_model, QuantizeOptions(overrides=(Override.parse("mlp.down_proj=8"),)))
    assert plan.scheme_of("model.layers.0.mlp.down_proj").bits == 8


@pytest.mark.parametrize("checkpoint_format", ["gptq", "awq"])
def test_an_export_with_one_group_size_refuses_a_per_module_fallback(tmp_path, checkpoint_format):
    model = save_tiny_llama(tmp_path / "m", hidden_size=96, intermediate_size=256)  # 96: groups of 32 only
    with pytest.raises(InputError, match=r"holds one group size for the whole model, but .*\(K=96\) would be group "
                                         r"32, not 64; use --group-size 32"):
        plan_quantization(model, QuantizeOptions(group_size=64, checkpoint_format=checkpoint_format, symmetric=None))
    with pytest.raises(InputError, match="would be group 32, not 128"):
        plan_quantization(model, QuantizeOptions(group_size=128, checkpoint_format=checkpoint_format,
                                                 overrides=(Override("down_proj", 4, 32),)))
    plan = plan_quantization(model, QuantizeOptions(checkpoint_format=checkpoint_format))
    assert plan.qconfig.group_size == 32 and not plan.fallbacks
