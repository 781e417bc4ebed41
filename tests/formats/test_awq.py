"""The AWQ export: its tensors dequantize, as an AWQ loader computes them, to exactly int4q's grid."""

import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from quantizer.cli.main import main
from quantizer.formats.awq import awq_tensors, dequantize_awq, pack_awq, unpack_awq
from quantizer.methods.grid import INTEGER_ZERO, quantize_groupwise


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 5), n8=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_awq_packing_round_trips_in_its_interleaved_order(rows, n8, seed):
    values = torch.randint(0, 16, (rows, 8 * n8), generator=torch.Generator().manual_seed(seed))
    packed = pack_awq(values)
    assert packed.dtype == torch.int32 and packed.shape == (rows, n8)
    assert torch.equal(unpack_awq(packed), values)
    assert (packed[0, 0].item() & 0xF) == values[0, 0] and ((packed[0, 0].item() >> 4) & 0xF) == values[0, 2]


@settings(max_examples=25, deadline=None)
@given(n8=st.integers(1, 4), groups=st.integers(1, 3), group=st.sampled_from([32, 64, 128]), seed=st.integers(0, 2**16))
def test_awq_tensors_dequantize_to_exactly_int4qs_grid(n8, groups, group, seed):
    w = torch.randn(8 * n8, groups * group, generator=torch.Generator().manual_seed(seed))
    gq = quantize_groupwise(w, group, storage=INTEGER_ZERO)
    t = awq_tensors("m", gq)
    assert t["m.qweight"].shape == (groups * group, n8) and t["m.scales"].shape == (groups, 8 * n8)
    assert torch.equal(dequantize_awq(t["m.qweight"], t["m.qzeros"], t["m.scales"]), gq.dequantize())


def test_an_awq_export_holds_asymmetric_grids_and_an_awq_config(tiny_model, tmp_path):
    out = tmp_path / "awq"
    result = CliRunner().invoke(main, ["quantize", "--model", str(tiny_model), "--out", str(out), "--format", "awq",
                                       "--group-size", "64", "--no-progress"])
    assert result.exit_code == 0, result.output
    import json

    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm",
                  "lm_head": False, "modules_to_not_convert": []}
    tensors = {}
    for shard in out.glob("*.safetensors"):
        tensors.update(load_file(shard))
    zeros = unpack_awq(tensors["model.layers.0.mlp.down_proj.qzeros"])
    assert len(set(zeros.flatten().tolist())) > 2  # real zero points, not a symmetric grid's constant
