"""Planning: which tensors are quantized, copied or dropped, decided and checked before any write."""

import pytest
import torch
from safetensors.torch import load_file

from quantizer.errors import InputError
from quantizer.planning import QuantizeOptions, plan_quantization
from quantizer.rtn import run_quantization

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


def test_what_the_format_and_method_require_is_applied_with_a_note(tiny_model, tmp_path):
    plain = plan_quantization(tiny_model, QuantizeOptions())
    assert plain.notes == () and plain.tied_output
    gptq = plan_quantization(tiny_model, QuantizeOptions(method="gptq", checkpoint_format="gptq"))
    assert "model.embed_tokens" not in gptq.targets and "lm_head" in gptq.targets and not gptq.tied_output
    assert [n.split(":")[0] for n in gptq.notes] == ["the gptq format has no quantized vocabulary table",
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
