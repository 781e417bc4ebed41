"""Where an int4 prefill spends its time against bf16's: every decoder linear of both models, run on
the same random activations, arms interleaved per rep in one process, plus the int4 weights'
dequantization alone. Prints medians and the per-rep ratios.

    python benchmarks/bench_prefill_parts.py --int4 models/qwen1.5b-g128 --bf16 models/qwen-bf16 \\
        --rows 512 --reps 9 --threads 2

"int4 minus dequantization" is the int4 linears' time less the dequantization timed alone: their
GEMMs plus the int4 path's Python per layer, and whatever the dequantization costs more inside the
prefill (colder caches) than alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quantizer.runtime import load_model
from quantizer.runtime.kernels.dequant import dequantize_int4pack, shared_weight_buffer
from quantizer.runtime.nn.int4 import Int4Linear


def decoder_linears(bf16: torch.nn.Module) -> list[str]:
    """Names of the bf16 model's linears inside its decoder layers, in forward order."""
    return [n for n, m in bf16.named_modules() if ".layers." in n and isinstance(m, torch.nn.Linear)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--int4", required=True, help="int4q checkpoint folder")
    ap.add_argument("--bf16", required=True, help="the bf16 checkpoint it was made from")
    ap.add_argument("--rows", type=int, default=512, help="prompt tokens (activation rows)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    int4, bf16 = load_model(args.int4), load_model(args.bf16)
    names = decoder_linears(bf16)
    bf16_layers, int4_layers = dict(bf16.named_modules()), dict(int4.named_modules())
    gen = torch.Generator().manual_seed(0)
    inputs = {k: torch.randn(args.rows, k, generator=gen).to(torch.bfloat16)
              for k in {bf16_layers[n].in_features for n in names}}
    weights = [m for n, m in int4_layers.items() if ".layers." in n and isinstance(m, Int4Linear) and m.direct]

    def run(model_layers):
        with torch.inference_mode(), shared_weight_buffer():
            for name in names:
                module = model_layers[name]
                module(inputs[module.in_features])

    def dequantize_all():
        with shared_weight_buffer():
            for m in weights:
                dequantize_int4pack(m.int4pack, m.sz, m.group_size, transient=True)

    arms = {"bf16 linears": lambda: run(bf16_layers), "int4 linears": lambda: run(int4_layers),
            "int4 dequantization": dequantize_all}
    for fn in arms.values():  # warm-up: oneDNN primitives, buffers
        fn()
    times = {a: [] for a in arms}
    for _ in range(args.reps):
        for arm, fn in arms.items():
            times[arm].append(timed(fn))
    base = times["bf16 linears"]
    print(f"{len(names)} linears, {args.rows} rows, {args.threads} threads, {args.reps} reps "
          "(median ms; ratio = bf16 / arm per rep)")
    for arm, ts in times.items():
        ratio = statistics.median(b / t for b, t in zip(base, ts))
        print(f"{arm:<22} {statistics.median(ts) * 1e3:9.1f} ms   {ratio:6.3f}")
    rest = [i - d for i, d in zip(times["int4 linears"], times["int4 dequantization"])]
    print(f"{'int4 minus dequant.':<22} {statistics.median(rest) * 1e3:9.1f} ms   "
          f"{statistics.median(b / r for b, r in zip(base, rest)):6.3f}")


if __name__ == "__main__":
    main()
