"""The model's own module tree decides which tensors are linears, the table and the head."""

import pytest
from conftest import save_byte_tokenizer, save_tiny_llama

from quantizer.errors import UnsupportedError
from quantizer.io.checkpoint import read_config
from quantizer.io.structure import (
    architecture_mismatches,
    build_empty_model,
    decoder_layers,
    inspect_structure,
)

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_the_structure_of_a_tied_llama(tiny_model):
    s = inspect_structure(read_config(tiny_model))
    assert (s.embedding, s.head, s.tied) == ("model.embed_tokens", "lm_head", True)
    assert len(s.decoder_linears) == 2 * len(LINEARS) and "lm_head" not in s.decoder_linears
    assert s.quantized_modules((), True, True) == [*s.decoder_linears, "model.embed_tokens"]
    assert s.quantized_modules(("down_proj",), False, False) == [
        *[m for m in s.decoder_linears if not m.endswith("down_proj")], "lm_head"]
    assert "lm_head" not in s.quantized_modules(("lm_head",), True, False)


def test_the_model_is_built_without_weights(tiny_model):
    model = build_empty_model(read_config(tiny_model))
    assert all(p.is_meta for p in model.parameters())
    name, layers = decoder_layers(model)
    assert name == "model.layers" and len(layers) == 2


def test_mismatches_name_missing_misshaped_and_stray_tensors(tmp_path):
    path = save_tiny_llama(tmp_path / "m", tie=False, shard=None)
    model = build_empty_model(read_config(path))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert architecture_mismatches(model, shapes) == []
    del shapes["lm_head.weight"]
    shapes["model.norm.weight"] = (7,)
    shapes["model.extra"] = (1,)
    assert architecture_mismatches(model, shapes) == [
        "model.norm.weight: shape [7], the model expects [128]", "lm_head.weight: missing",
        "model.extra: stray tensor the model has no place for"]
    assert architecture_mismatches(model, {k: v for k, v in shapes.items() if k != "model.extra"},
                                   tied_head="lm_head") == ["model.norm.weight: shape [7], the model expects [128]"]


def test_an_unknown_model_type_is_one_clear_error():
    with pytest.raises(UnsupportedError, match="cannot build model_type 'no-such-arch'"):
        inspect_structure({"model_type": "no-such-arch"})


def test_scaled_embeddings_and_untied_heads_are_found_from_the_module_tree():
    from transformers import Gemma2Config

    cfg = Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)
    s = inspect_structure(cfg.to_dict())
    assert (s.embedding, s.head, s.tied) == ("model.embed_tokens", "lm_head", False)
    assert "lm_head" in s.linears and "lm_head" in s.quantized_modules((), True, False)


BAD_SIZES = {"vocab_size": 0, "hidden_size": -64, "num_attention_heads": 0, "intermediate_size": "big"}


@pytest.mark.parametrize("key", sorted(BAD_SIZES))
def test_a_size_that_is_not_a_positive_integer_is_named_before_anything_is_built(tmp_path, key):
    import json

    from click.testing import CliRunner

    from quantizer.cli import main

    src = save_tiny_llama(tmp_path / "bf16")
    config = json.loads((src / "config.json").read_text())
    config[key] = BAD_SIZES[key]
    (src / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(main, ["quantize", "--model", str(src), "--out", str(tmp_path / "q")])
    assert result.exit_code == 1 and f"config.json: {key} is {BAD_SIZES[key]!r}; it must be a positive integer" \
        in result.output, result.output
    assert "internal error" not in result.output


def test_a_billion_layers_is_refused_against_the_shards_before_building(tmp_path):
    import json
    import time

    from click.testing import CliRunner

    from quantizer.cli import main

    src = save_tiny_llama(tmp_path / "bf16")
    save_byte_tokenizer(src)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = 1_000_000_000
    (src / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    for command in (["quantize", "--model", str(src), "--out", str(tmp_path / "q")], ["generate", str(src), "--prompt", "x"]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 1 and "config.json says 1000000000 layers, but the checkpoint holds only" \
            in result.output, result.output
    assert time.perf_counter() - start < 30  # nothing of that size was built


@pytest.mark.parametrize("key, value", [("hidden_size", 2**40), ("intermediate_size", 2**31), ("vocab_size", 2**34)])
def test_a_width_no_tensor_could_hold_is_refused_before_any_model_is_built(tmp_path, key, value):
    import json

    from click.testing import CliRunner
    from conftest import quantize_to

    from quantizer.cli import main

    src = save_tiny_llama(tmp_path / "bf16")
    save_byte_tokenizer(src)
    quantized = quantize_to(src, tmp_path / "int4", group_size=64)
    save_byte_tokenizer(quantized)
    for folder in (src, quantized):
        config = json.loads((folder / "config.json").read_text())
        config[key] = value
        (folder / "config.json").write_text(json.dumps(config))
    for command in (["quantize", "--model", str(src), "--out", str(tmp_path / "q")], ["verify", str(quantized)],
                    ["generate", str(quantized), "--prompt", "x", "--no-compile"]):
        done = CliRunner().invoke(main, command)
        assert done.exit_code != 0 and "internal error" not in done.output, (command, done.output)
        assert f"config.json says {key} {value}" in done.output or "is not a valid" in done.output, done.output
    assert not (tmp_path / "q").exists()


def test_a_config_transformers_rejects_is_one_line_not_an_internal_error(tmp_path):
    import json

    from quantizer.errors import InputError
    from quantizer.io.structure import build_config

    config = json.loads((save_tiny_llama(tmp_path / "bf16") / "config.json").read_text())
    config["hidden_size"] = 130  # not a multiple of its 4 heads
    with pytest.raises(InputError, match="is not a valid 'llama' config .*not a multiple"):
        build_config(config)
