"""Per-module precision: overrides, named recipes, the group fallback and the automatic group."""

import pytest

from quantizer.errors import InputError
from quantizer.quantization.recipes import (
    Override,
    assign_schemes,
    auto_group,
    fallback_group,
    more_bits_layer,
    recipe_bits,
)
from quantizer.schema.scheme import ModuleScheme


@pytest.mark.parametrize("text,expected", [
    ("down_proj=8", Override("down_proj", 8)),
    ("lm_head=4:32", Override("lm_head", 4, 32)),
    ("mlp.up_proj=16", Override("mlp.up_proj", 16)),
])
def test_overrides_parse(text, expected):
    assert Override.parse(text) == expected


@pytest.mark.parametrize("text", ["down_proj", "down_proj=3", "x=8:64", "x=4:48", "=4"])
def test_bad_overrides_are_named(text):
    with pytest.raises(InputError, match="--override"):
        Override.parse(text)


def test_the_mixed_recipe_picks_llama_cpps_layers():
    # llama.cpp use_more_bits for 30 layers: i < 3, i >= 26, or (i - 3) % 3 == 2
    assert [i for i in range(30) if more_bits_layer(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    assert recipe_bits("mixed", "model.layers.5.mlp.down_proj", False, 30) == 8
    assert recipe_bits("mixed", "model.layers.6.mlp.down_proj", False, 30) == 4
    assert recipe_bits("mixed", "model.layers.5.mlp.up_proj", False, 30) == 4
    assert recipe_bits("table8", "model.layers.5.mlp.down_proj", False, 30) == 4
    assert recipe_bits("table8", "lm_head", True, 30) == 8 and recipe_bits("all4", "lm_head", True, 30) == 4
    with pytest.raises(InputError, match="--recipe 'q8' is not one of all4, table8, mixed"):
        recipe_bits("q8", "x", False, 1)


def test_fallback_goes_to_the_largest_group_that_divides():
    assert fallback_group(576, 128) == 64 and fallback_group(576, 256) == 64 and fallback_group(1536, 256) == 256
    assert fallback_group(96, 64) == 32 and fallback_group(100, 64) is None
    assert auto_group([576, 1536]) == 64 and auto_group([1536, 100]) == 128


def test_assign_schemes_records_every_fallback_and_applies_overrides_last():
    k = {"a.q_proj": 576, "a.down_proj": 1536, "odd": 100, "b.q_proj": 576}
    bits = {m: 4 for m in k}
    group, schemes, fallbacks = assign_schemes(k, bits, 128, False, (Override("b.q_proj", 8),), strict=False)
    assert group == 128
    assert schemes["a.q_proj"] == ModuleScheme(4, 64, False) and schemes["a.down_proj"] == ModuleScheme(4, 128, False)
    assert schemes["odd"] == ModuleScheme(8, None, True) and schemes["b.q_proj"] == ModuleScheme(8, None, True)
    assert set(fallbacks) == {"a.q_proj", "odd"} and "not a multiple of 32" in fallbacks["odd"]
    with pytest.raises(InputError, match=r"does not divide a.q_proj \(K=576\), b.q_proj \(K=576\), odd \(K=100\)"):
        assign_schemes(k, bits, 128, False, (), strict=True)
