"""transformers' own loading of cpu_int4 folders: after ``import quantizer``, from_pretrained gives
the runtime's modules and logits, pipelines and sampling work, and save_pretrained writes a
folder that loads to the same logits."""

import pytest
import torch
from conftest import quantize_to

import quantizer.integrations.transformers  # noqa: F401  (registers cpu_int4 with transformers)
from quantizer.io.checkpoint import CheckpointReader
from quantizer.runtime import load_model
from quantizer.runtime.nn.int4 import Int4Linear
from quantizer.verification.structure import check_structure

IDS = torch.tensor([[1, 5, 9, 200, 33, 7, 480, 2]])


def from_pretrained(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


def logits(model, ids=IDS):
    with torch.inference_mode():
        return model(ids).logits.float()


@pytest.mark.parametrize("options", [
    dict(group_size=64),                                    # tied head sharing the int4 table
    dict(group_size=32, untie_head=True, symmetric=True),   # a separately quantized head
    dict(group_size=64, recipe="table8"),                   # an 8-bit table shared by the head
    dict(group_size=64, keep_embedding=True),               # bf16 table, tied bf16 head
], ids=["tied", "untied-sym", "table8", "keep-embedding"])
def test_from_pretrained_gives_the_runtime_modules_and_logits(tiny_model, tmp_path, options):
    folder = quantize_to(tiny_model, tmp_path / "q", **options)
    model = from_pretrained(folder)
    assert any(isinstance(m, Int4Linear) for m in model.modules())
    assert not any(type(m) is torch.nn.Linear and m.weight.shape[0] != 512 for m in model.modules())
    assert torch.equal(logits(model), logits(load_model(folder)))


def test_from_pretrained_of_a_gemma_style_scaled_embedding(tmp_path):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64)
    Gemma2ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    folder = quantize_to(tmp_path / "bf16", tmp_path / "q", group_size=64)
    assert torch.equal(logits(from_pretrained(folder)), logits(load_model(folder)))


def test_pipeline_generates_with_sampling_and_generate_arguments(tiny_model_tok, tmp_path):
    from transformers import pipeline

    folder = quantize_to(tiny_model_tok, tmp_path / "q", group_size=64)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_model_tok / name).read_bytes())
    generate = pipeline("text-generation", model=str(folder))
    greedy = generate("def main():", max_new_tokens=12, do_sample=False)[0]["generated_text"]
    torch.manual_seed(0)
    sampled = generate("def main():", max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20)
    assert greedy.startswith("def main():") and len(greedy) > len("def main():")
    assert sampled[0]["generated_text"].startswith("def main():")


def test_save_pretrained_writes_a_folder_that_verifies_and_loads_the_same(tiny_model, tmp_path):
    folder = quantize_to(tiny_model, tmp_path / "q", group_size=64)
    model = from_pretrained(folder)
    model.save_pretrained(tmp_path / "saved")
    original, saved = CheckpointReader(folder), CheckpointReader(tmp_path / "saved")
    assert set(original.infos) == set(saved.infos)
    assert all(torch.equal(original.get(n), saved.get(n)) for n in original.infos)
    assert check_structure(tmp_path / "saved")[0].ok
    assert torch.equal(logits(from_pretrained(tmp_path / "saved")), logits(model))


def test_a_bad_quantization_config_fails_in_from_pretrained_with_int4qs_message(tiny_q, tmp_path):
    import json
    import shutil

    shutil.copytree(tiny_q, tmp_path / "bad")
    config = json.loads((tmp_path / "bad" / "config.json").read_text())
    config["quantization_config"]["group_size"] = 48
    (tmp_path / "bad" / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="group_size"):
        from_pretrained(tmp_path / "bad")


def test_a_group_size_the_tensors_do_not_have_is_one_line_naming_the_tensor(tiny_q, tmp_path):
    import json
    import shutil

    from quantizer.errors import InputError

    shutil.copytree(tiny_q, tmp_path / "bad")
    config = json.loads((tmp_path / "bad" / "config.json").read_text())
    config["quantization_config"]["group_size"] = 32  # supported, but not what the tensors hold
    (tmp_path / "bad" / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=r"weight_scale: shape \[\d+, \d+\] does not match group_size 32"):
        from_pretrained(tmp_path / "bad")
