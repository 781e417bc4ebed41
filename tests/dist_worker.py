"""One rank of a distributed GPTQ run, as a process of its own (started by test_distributed with
torchrun's environment variables): the layer-wise driver on a model folder with a tokenizer, and
every Hessian the ranks agreed on, in step order, saved beside the output.

usage: python dist_worker.py SRC OUT HESSIANS"""

import sys
from pathlib import Path

import torch

import quantizer.calibrate.ranks as distributed
from quantizer.calibrate.windows import CalibrationSettings
from quantizer.io.text import builtin_text
from quantizer.io.tokenizer import load_tokenizer
from quantizer.methods.gptq import HessianAccumulator
from quantizer.quantization.calibrated import run_calibrated
from quantizer.quantization.planning import QuantizeOptions, plan_quantization

OPTIONS = CalibrationSettings(nsamples=6, seqlen=64, seed=0)


def main(src: Path, out: Path, hessians: Path) -> None:
    ranks = distributed.join("cpu")
    merged = []
    real_merge = HessianAccumulator.merge

    def recording_merge(self, sum_across):
        real_merge(self, sum_across)
        merged.append(self.H.clone())

    HessianAccumulator.merge = recording_merge
    plan = plan_quantization(src, QuantizeOptions(group_size=64, untie_head=True, method="gptq"))
    out.mkdir(parents=True, exist_ok=True)
    main_rank = ranks.is_main
    run_calibrated(plan, out, load_tokenizer(src) if main_rank else None, builtin_text("calib") if main_rank else None,
                   "calib", OPTIONS, ranks=ranks)
    torch.save(merged, hessians)
    distributed.leave(ranks)


if __name__ == "__main__":
    main(*(Path(a) for a in sys.argv[1:4]))
