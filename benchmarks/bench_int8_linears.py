"""The int4 linears of one checkpoint at M rows: exact activations, int8 activations and bf16, in one
process, arms interleaved per rep, medians.

For every distinct (N, K, group) among the model's int4 linears (fused as the runtime fuses them),
each arm multiplies M seeded rows: ``exact`` the path the runtime takes without int8 (the GEMV for
fewer rows than the threshold, dequantization + oneDNN from it on), ``int8`` the int8-activation
operator, ``bf16`` oneDNN with the dequantized weight resident (the bf16 model's linear). The sum
over the decoder layers is their linear time in one forward of M rows: M = 1 is decode, 4 and 16
are batched decode, 512 a prompt (the vocabulary head, exact in both int4 arms, is left out).

    python benchmarks/bench_int8_linears.py models/smollm2-g64 --rows 1 4 16 512 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from quantizer.runtime import load_model
from quantizer.runtime.activations import EXACT, Activations
from quantizer.runtime.nn.int4 import Int4Linear


def shapes(model) -> Counter:
    """(N, K, group) of every int4 linear of the decoder layers (not the vocabulary head, which the
    runtime keeps exact), with how many times it appears."""
    head = model.get_output_embeddings()
    return Counter((m.out_features, m.in_features, m.group_size) for m in model.modules()
                   if isinstance(m, Int4Linear) and m is not head)


def layer_of(model, shape) -> Int4Linear:
    return next(m for m in model.modules() if isinstance(m, Int4Linear)
                and (m.out_features, m.in_features, m.group_size) == shape)


def seconds(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(exact: Int4Linear, int8: Int4Linear, rows: int, reps: int) -> dict[str, float]:
    """Median seconds per call of each arm on ``rows`` seeded rows."""
    x = torch.randn(rows, exact.in_features, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    weight = exact.dequantized_weight()
    arms = {"exact": lambda: exact(x), "int8": lambda: int8(x), "bf16": lambda: F.linear(x, weight)}
    calls = max(1, int(2e7 // (rows * exact.in_features * exact.out_features)))
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(reps):
        for name, fn in arms.items():
            times[name].append(seconds(fn, calls))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="an int4q checkpoint folder")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    exact_model = load_model(args.model, activations=EXACT)
    int8_model = load_model(args.model, activations=Activations("int8", "int8"))
    counts = shapes(exact_model)
    report = {"model": str(args.model), "threads": args.threads, "reps": args.reps, "rows": {}}
    with torch.inference_mode():
        for rows in args.rows:
            total = Counter()
            per_shape = {}
            for shape, count in counts.items():
                t = measure(layer_of(exact_model, shape), layer_of(int8_model, shape), rows, args.reps)
                per_shape["x".join(map(str, shape))] = {k: round(v * 1e6, 1) for k, v in t.items()}
                total.update({k: v * count for k, v in t.items()})
            ms = {k: round(v * 1e3, 3) for k, v in total.items()}
            report["rows"][rows] = {"per_shape_us": per_shape, "model_ms": ms}
            print(f"M={rows:<4} decoder linears: exact {ms['exact']:8.2f} ms  int8 {ms['int8']:8.2f} ms  "
                  f"bf16 {ms['bf16']:8.2f} ms  int8 speed: {total['exact'] / total['int8']:.2f}x exact, "
                  f"{total['bf16'] / total['int8']:.2f}x bf16")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
