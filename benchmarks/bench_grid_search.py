"""The grid searches' time per weight, with candidate grids scored by int4q's native kernel and by
its torch form, interleaved in one process on the same threads.

    .venv/bin/python benchmarks/bench_grid_search.py [--rows 1536 --cols 8960] [--threads 2] [--reps 5]

For one seeded [rows, cols] weight (Qwen2.5-1.5B's gate projection by default) it times, per
search: round-to-nearest with the clip search (bf16 grids, group 64), the activation-weighted
search (group 64), and GGUF's Q4_K super-blocks (group 32) plain and weighted, each with both
scorers in turn within every repetition, and prints the medians, their ratio, and whether the
two scorers chose the same grids (they sum in the same order, so they should, to the bit).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantizer.formats.gguf.blocks import Q4_K_STORAGE  # noqa: E402
from quantizer.methods import candidates  # noqa: E402
from quantizer.methods.grid import quantize_groupwise  # noqa: E402


def searches(w: torch.Tensor, column_weights: torch.Tensor) -> dict:
    """name -> a call quantizing w with that search."""
    return {
        "clip search g64": lambda: quantize_groupwise(w, 64, clip_search=True),
        "weighted g64": lambda: quantize_groupwise(w, 64, column_weights=column_weights),
        "Q4_K minmax": lambda: quantize_groupwise(w, 32, storage=Q4_K_STORAGE),
        "Q4_K weighted": lambda: quantize_groupwise(w, 32, storage=Q4_K_STORAGE, column_weights=column_weights),
    }


def timed(call) -> tuple[float, object]:
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1536)
    ap.add_argument("--cols", type=int, default=8960)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(args.rows, args.cols, generator=gen) * 0.02).to(torch.bfloat16)
    column_weights = torch.rand(args.cols, generator=gen) ** 4 * 10
    checked = candidates.KERNEL
    native = checked()
    if native is candidates.torch_scores:
        sys.exit("int4q's native library is not available here: nothing to compare")
    scorers = {"native": native, "torch": candidates.torch_scores}
    print(f"weight [{args.rows}, {args.cols}] bf16, {args.threads} threads, {args.reps} reps, medians")
    print(f"{'search':<18} {'native s':>9} {'torch s':>9} {'speed-up':>9}  same grids")
    for name, call in searches(w, column_weights).items():
        times = {arm: [] for arm in scorers}
        results = {}
        for _ in range(args.reps):
            for arm, scorer in scorers.items():
                candidates.KERNEL = lambda scorer=scorer: scorer
                seconds, results[arm] = timed(call)
                times[arm].append(seconds)
        candidates.KERNEL = checked
        same = all(torch.equal(a, b) for a, b in zip(results["native"].tensors, results["torch"].tensors))
        med = {arm: statistics.median(t) for arm, t in times.items()}
        print(f"{name:<18} {med['native']:>9.3f} {med['torch']:>9.3f} {med['torch'] / med['native']:>8.1f}x  {same}")


if __name__ == "__main__":
    main()
