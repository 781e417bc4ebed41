"""One decode step's attention over every layer's KV cache: the bf16 cache's operator
(``attend_one``) against the int8 cache's (``attend_one_int8``), side by side.

    python benchmarks/bench_kv_attention.py --config models/<any>/config.json --depth 2048 4096 16384 \\
        [--reps 9] [--threads 2]

For each depth, one query per layer attends over that layer's cache of random rows (every layer's,
as a decode step does, so the caches are read from memory, not from the CPU's caches); the two arms
alternate ``--reps`` times. Prints the medians: ms a step, ns per position and cached head, and the
bytes read per second (keys and values with their scales).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from quantizer.runtime.kernels.attention import has_attend_one
from quantizer.runtime.kernels.kv_int8 import KEY_DIMS, Int8Cache, has_int8_cache


def shapes(config_path: Path) -> tuple[int, int, int, int]:
    """(layers, heads, kv_heads, head_dim) of a transformers config.json."""
    config = json.loads(config_path.read_text())
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    dim = config.get("head_dim") or config["hidden_size"] // heads
    return config["num_hidden_layers"], heads, config.get("num_key_value_heads") or heads, dim


def timed(step, reps: int, other) -> tuple[float, float]:
    """Medians (s) of ``step`` and ``other``, alternated ``reps`` times after one warm-up each."""
    step(), other()
    a, b = [], []
    for _ in range(reps):
        for run, times in ((step, a), (other, b)):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--depth", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not (has_attend_one() and has_int8_cache()):
        raise SystemExit("int4q's library is not loaded here")
    layers, heads, kv_heads, dim = shapes(args.config)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, 1, dim, generator=gen).to(torch.bfloat16)
    print(f"{layers} layers, {heads} heads over {kv_heads} cached heads of {dim}, {args.threads} threads")
    for depth in args.depth:
        bf16, int8 = [], []
        for _ in range(layers):
            k, v = (torch.randn(1, kv_heads, depth, dim, generator=gen).to(torch.bfloat16) for _ in range(2))
            cache = Int8Cache.empty(kv_heads, depth, dim)
            cache.store(k, v, 0)
            bf16.append((k, v))
            int8.append(cache)
        scale = dim**-0.5
        t_bf16, t_int8 = timed(lambda: [torch.ops.int4q_native.attend_one(q, k, v, scale) for k, v in bf16], args.reps,
                               lambda: [c.attend(q, depth, scale) for c in int8])
        rows = layers * kv_heads * depth
        row_bytes = {"bf16": 4 * dim, "int8": 2 * dim + 4 * (dim // KEY_DIMS) + 4}
        for name, t in (("bf16", t_bf16), ("int8", t_int8)):
            print(f"depth {depth:>6} {name}: {t * 1e3:7.2f} ms a step, {t / rows * 1e9:5.1f} ns a position-head, "
                  f"{rows * row_bytes[name] / t / 1e9:5.1f} GB/s")
        print(f"depth {depth:>6} int8 / bf16 speed: {t_bf16 / t_int8:.2f}x")


if __name__ == "__main__":
    main()
