"""The grid searches' time per weight in three arms, interleaved in one process on the same threads:
``fused``, int4q's native kernels as a run uses them (each group's candidates scored in one pass,
the grid recovery's fits checked natively); ``per grid``, the candidate loops in torch with each
candidate grid scored by the native scoring kernel (int4q before the fused loops); ``torch``,
every kernel's torch form.

    .venv/bin/python benchmarks/bench_grid_search.py [--rows 1536 --cols 8960] [--threads 2] [--reps 5]

For one seeded [rows, cols] weight (Qwen2.5-1.5B's gate projection by default) it times, per
search: round-to-nearest with the clip search (bf16 grids, group 64), the activation-weighted
search (group 64), and GGUF's K-quant super-blocks (Q4_K, Q5_K: group 32; Q6_K: group 16) plain
and weighted, each arm in turn within every repetition, and prints the medians, the speed-ups
over ``fused`` and whether every arm chose the same grids and codes (they compute the same
operations in the same order, so they should, to the bit), and ``fused``'s rate in MB of bf16
source a second.
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

from quantizer.formats.gguf.blocks import Q4_K, Q5_K, Q6_K  # noqa: E402
from quantizer.methods import candidates, llama_searches, recovery, shrink_search  # noqa: E402
from quantizer.methods.grid import quantize_groupwise  # noqa: E402

FUSED = (shrink_search.SHRINK, llama_searches.STRETCH, llama_searches.SIGNED, candidates.ERRORS,
         recovery.FIRST_FIT)
"""The kernels the fused loops added; ``per grid`` and ``torch`` run their torch forms."""


def searches(w: torch.Tensor, column_weights: torch.Tensor) -> dict:
    """name -> a call quantizing w with that search."""
    found = {
        "clip search g64": lambda: quantize_groupwise(w, 64, clip_search=True),
        "weighted g64": lambda: quantize_groupwise(w, 64, column_weights=column_weights),
    }
    for block in (Q4_K, Q5_K, Q6_K):
        size, symmetric = (16, True) if block is Q6_K else (32, False)
        for label, weights in (("minmax", None), ("weighted", column_weights)):
            found[f"{block.name} {label}"] = (lambda storage=block.storage, size=size, symmetric=symmetric,
                                              weights=weights: quantize_groupwise(
                                                  w, size, symmetric, storage=storage, column_weights=weights))
    return found


def chosen(arm: str, scorer, natives: dict) -> None:
    """Every checked kernel set to what ``arm`` runs (``natives``: each fused kernel's native form,
    already past its probe, so no repetition pays for the probe)."""
    candidates.KERNEL._chosen[:] = [scorer]
    for kernel in FUSED:
        kernel._chosen[:] = [natives[kernel] if arm == "fused" else kernel.reference]


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
    native, natives = candidates.KERNEL(), {kernel: kernel() for kernel in FUSED}
    if native is candidates.torch_scores or any(natives[k] is k.reference for k in FUSED):
        sys.exit("int4q's native library is not available here: nothing to compare")
    arms = {"fused": native, "per grid": native, "torch": candidates.torch_scores}
    print(f"weight [{args.rows}, {args.cols}] bf16, {args.threads} threads, {args.reps} reps, medians")
    print(f"{'search':<18} {'fused s':>9} {'per grid s':>10} {'torch s':>9} {'per grid/fused':>14} "
          f"{'torch/fused':>11} {'fused MB/s':>10}  same")
    for name, call in searches(w, column_weights).items():
        times = {arm: [] for arm in arms}
        results = {}
        for _ in range(args.reps):
            for arm, scorer in arms.items():
                chosen(arm, scorer, natives)
                seconds, results[arm] = timed(call)
                times[arm].append(seconds)
        chosen("fused", native, natives)
        same = all(torch.equal(a, b) for arm in ("per grid", "torch")
                   for a, b in zip(results["fused"].tensors, results[arm].tensors))
        med = {arm: statistics.median(t) for arm, t in times.items()}
        print(f"{name:<18} {med['fused']:>9.3f} {med['per grid']:>10.3f} {med['torch']:>9.3f} "
              f"{med['per grid'] / med['fused']:>13.1f}x {med['torch'] / med['fused']:>10.1f}x "
              f"{w.numel() * 2 / med['fused'] / 1e6:>10.0f}  {same}")

if __name__ == "__main__":
    main()
