"""quantization_config: the seed runtime's keys stay as they are, per-module schemes are added
only when used, and what this int4q cannot read is refused by name."""

import pytest

from quantizer.errors import UnsupportedError
from quantizer.schema.config import QuantizationConfig
from quantizer.schema.scheme import ModuleScheme

SEED_KEYS = {"group_size", "ignore", "quantize_embedding", "prefill_dequant", "direct_dequant", "dequant_threshold",
             "use_custom_op", "quant_method"}


def test_a_plain_config_has_the_seed_keys_and_no_modules_table():
    d = QuantizationConfig(group_size=64).to_dict()
    assert SEED_KEYS <= set(d) and "modules" not in d
    assert d["quant_method"] == "cpu_int4" and d["bits"] == 4


def test_round_trip_with_overrides():
    q = QuantizationConfig(group_size=64, ignore=("down_proj",), modules={"lm_head": {"bits": 4, "group_size": 32}})
    assert QuantizationConfig.from_dict(q.to_dict()) == q


def test_scheme_for_a_module_override_an_ignored_module_and_the_rest():
    q = QuantizationConfig(group_size=64, symmetric=True, ignore=("down_proj",),
                           modules={"model.layers.0.mlp.up_proj": {"group_size": 32}})
    assert q.scheme_for("model.layers.0.mlp.up_proj") == ModuleScheme(4, 32, True)
    assert q.scheme_for("model.layers.0.mlp.down_proj").kept
    assert q.scheme_for("model.layers.1.mlp.up_proj") == ModuleScheme(4, 64, True)


@pytest.mark.parametrize("changes,message", [
    ({"bits": 8}, "bits is 8; cpu_int4 checkpoints are 4-bit"),
    ({"group_size": 100}, "group_size 100 is not one of"),
    ({"quant_method": "awq"}, "quant_method is 'awq'"),
    ({"modules": {"x": {"bits": 7}}}, "bits 7 is not one of"),
    ({"modules": ["x"]}, "must map module names to schemes"),
    ({"symmetric": "yes"}, "symmetric must be true or false"),
    ({"surprise": 1}, "keys this int4q does not know: surprise"),
])
def test_what_cannot_be_read_is_refused_by_name(changes, message):
    d = {**QuantizationConfig(group_size=64).to_dict(), **changes}
    with pytest.raises(UnsupportedError, match=message):
        QuantizationConfig.from_dict(d)
