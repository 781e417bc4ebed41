"""Round-to-nearest streamed over a checkpoint, in either format."""

import json

import pytest
import torch
from conftest import save_tiny_llama

from quantizer.formats.gptq_v1 import dequantize_gptq
from quantizer.formats.packing import unpack_nibbles
from quantizer.io.checkpoint import CheckpointReader
from quantizer.methods.grid import INTEGER_ZERO, dequantize_codes, quantize_groupwise
from quantizer.quantization.planning import QuantizeOptions, plan_quantization
from quantizer.quantization.streamed import run_quantization


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
        if module in report.tensors:
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
    assert report.summary.bits_per_weight == 4.5
    saved = json.loads((out / "quantization_report.json").read_text())
    assert saved["tensors"]["model.layers.0.mlp.down_proj"]["snr_db"] > 15


def test_round_to_nearest_writes_the_gptq_layout_on_integer_zero_points(tiny_model, tmp_path):
    out = tmp_path / "g"
    out.mkdir()
    plan = plan_quantization(tiny_model, QuantizeOptions(group_size=64, checkpoint_format="gptq"))
    assert any("stays in bf16" in note for note in plan.notes)
    report = run_quantization(plan, out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["group_size"] == 64
    reader, source = CheckpointReader(out), CheckpointReader(tiny_model)
    assert reader.infos["model.embed_tokens.weight"].dtype == torch.bfloat16
    m = "model.layers.1.self_attn.o_proj"
    got = dequantize_gptq(*(reader.get(f"{m}.{s}") for s in ("qweight", "qzeros", "scales", "g_idx")))
    want = quantize_groupwise(source.get(f"{m}.weight"), 64, storage=INTEGER_ZERO).dequantize()
    assert torch.equal(got, want)
    assert report.tensors[m]["bytes"] == sum(reader.infos[f"{m}.{s}"].nbytes
                                               for s in ("qweight", "qzeros", "scales", "g_idx"))
