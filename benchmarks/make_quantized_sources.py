"""Make the third-party 4-bit checkpoints int4q's bridge reads, with the tools users make them with,
on the CPU: GPTQModel (GPTQ symmetric and asymmetric, with and without act-order; its AWQ) and
llm-compressor (compressed-tensors W4A16, symmetric and asymmetric). They are never int4q
dependencies: run this with an environment that has them (``bash scripts/setup_producers.sh``)::

    .venv-producers/bin/python benchmarks/make_quantized_sources.py --model models/smollm2-135m-bf16 \
        --out .cache/quantized-sources

Each source lands in ``<out>/<name>``; a producer that is missing or fails is one line, and the
others still run. Calibration text: CPython's ``pydoc_data.topics``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import traceback
from pathlib import Path

GROUP = 64  # SmolLM2's 576 columns hold no group of 128
GPTQ_VARIANTS = {  # name -> QuantizeConfig arguments
    "gptqmodel-sym-g64": dict(bits=4, group_size=GROUP, sym=True, desc_act=False),
    "gptqmodel-asym-g64": dict(bits=4, group_size=GROUP, sym=False, desc_act=False),
    "gptqmodel-sym-g64-actorder": dict(bits=4, group_size=GROUP, sym=True, desc_act=True),
    "gptqmodel-sym-g32": dict(bits=4, group_size=32, sym=True, desc_act=False),
}
CT_SCHEMES = {"llmcompressor-w4a16": True, "llmcompressor-w4a16-asym": False}  # name -> symmetric


def calibration_texts(n: int, chars: int = 2000) -> list[str]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return [text[i * chars:(i + 1) * chars] for i in range(n)]


def make_gptqmodel(model: Path, out: Path, name: str, args: dict, awq: bool = False) -> None:
    import gptqmodel
    from gptqmodel import GPTQModel, QuantizeConfig

    # its thread pool gives the CPU (cores + 1) // 2 workers, then asks 2 for its model loader: on
    # a 2-core machine that is refused before any work
    gptqmodel._default_cpu_workers = lambda: max(2, ((os.cpu_count() or 1) + 1) // 2)

    if awq:
        from gptqmodel.quantization import FORMAT, METHOD

        config = QuantizeConfig(bits=4, group_size=GROUP, quant_method=METHOD.AWQ, format=FORMAT.GEMM)
    else:
        config = QuantizeConfig(**args)
    quantized = GPTQModel.load(str(model), config, device="cpu")
    quantized.quantize(calibration_texts(64), batch_size=4)
    quantized.save(str(out / name))


def make_llmcompressor(model: Path, out: Path, name: str, symmetric: bool) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(model, torch_dtype="auto")
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": GROUP}
    recipe = QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                                  ignore=["lm_head"])
    oneshot(model=loaded, recipe=recipe)
    loaded.save_pretrained(out / name, save_compressed=True)
    AutoTokenizer.from_pretrained(model).save_pretrained(out / name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a bf16 checkpoint folder")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", help="make only these names")
    args = parser.parse_args()
    jobs = {**{n: (make_gptqmodel, (a,)) for n, a in GPTQ_VARIANTS.items()},
            "gptqmodel-awq-gemm": (make_gptqmodel, ({}, True)),
            **{n: (make_llmcompressor, (s,)) for n, s in CT_SCHEMES.items()}}
    failed = 0
    for name, (make, extra) in jobs.items():
        if args.only and name not in args.only:
            continue
        if (args.out / name / "config.json").is_file():
            print(f"{name}: already made")
            continue
        try:
            make(args.model, args.out, name, *extra)
            print(f"{name}: made")
        except Exception as e:  # one producer's failure leaves the others to run
            shutil.rmtree(args.out / name, ignore_errors=True)
            traceback.print_exc(file=sys.stderr)
            print(f"{name}: failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
