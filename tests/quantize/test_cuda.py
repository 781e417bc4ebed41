"""GPTQ with --device cuda, where a CUDA device is present (skipped elsewhere): the same
checkpoint as on the CPU up to the order of the sums."""

import pytest
import torch

from quantizer.calibrate.ranks import Ranks
from quantizer.calibrate.windows import CalibrationSettings
from quantizer.io.checkpoint import CheckpointReader
from quantizer.io.text import builtin_text
from quantizer.quantize.calibrated import run_calibrated
from quantizer.quantize.planning import QuantizeOptions, plan_quantization

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def gptq_on(device, src, out, tokenizer):
    out.mkdir()
    plan = plan_quantization(src, QuantizeOptions(group_size=64, untie_head=True, method="gptq"))
    report = run_calibrated(plan, out, tokenizer, builtin_text("calib"), "calib", CalibrationSettings(4, 64, 0),
                            ranks=Ranks(device=device))
    return report, CheckpointReader(out)


def test_gptq_on_cuda_writes_the_cpu_runs_checkpoint_to_rounding(tiny_model_tok, byte_tokenizer, tmp_path):
    cuda_report, cuda = gptq_on("cuda", tiny_model_tok, tmp_path / "cuda", byte_tokenizer)
    cpu_report, cpu = gptq_on("cpu", tiny_model_tok, tmp_path / "cpu", byte_tokenizer)
    assert cuda.infos.keys() == cpu.infos.keys()
    for module, entry in cuda_report.tensors.items():
        if entry["method"] == "gptq":
            cpu_loss = cpu_report.tensors[module]["gptq_loss"]
            assert entry["gptq_loss"] < entry["rtn_loss"]
            assert entry["gptq_loss"] == pytest.approx(cpu_loss, rel=0.05), module
    packed = [n for n in cpu.infos if n.endswith("weight_packed")]
    same = sum((cuda.get(n) == cpu.get(n)).float().mean().item() for n in packed) / len(packed)
    assert same > 0.9
