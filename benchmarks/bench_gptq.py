"""GPTQ's time per phase, against the machine's GEMM rate measured in the same process.

    .venv/bin/python benchmarks/bench_gptq.py --model models/smollm2-135m-bf16 [--nsamples 128 --seqlen 512]
        [--group-size 64] [--threads 2] [--verify] [--json out.json]

Runs one `int4q quantize --method gptq` in this process with each phase timed (the core is
wrapped from outside, not changed) and prints, per phase, the wall time, the floating-point
operations counted by formula and the achieved rate as a fraction of an fp32 GEMM (and a bf16
one) timed here on the same threads, before and after the run:

- forward: the calibration passes through the layers and their traces, attention aside (each
  ``nn.Linear`` product computed, 2·rows·in·out; norms are not counted, so this rate is a lower bound);
- attention: int4q's causal kernel or PyTorch's SDPA, 2·T·T·D per head of T queries as causal
  attention does it (half of the full products);
- hessian: the statistic's updates, 2·n·K² per batch of n rows as a GEMM would do them;
- factorisation: the upper Cholesky factor of H⁻¹, counted as K³ per solve (a Cholesky and a
  triangular inverse are K³/3 each; the rest of the work is counted as a third K³/3);
- column loop: the lazy-block updates, N·K² per solve (plus N·K·block inside the blocks);
- report: GPTQ's error statistics and round-to-nearest's objective per linear (2·N·K²; GPTQ's objective
  comes from its solve's errors);
- io: reading the layers' weights, saving each finished layer, writing the output.

Also the calibration objective Σ tr((W−Q)H(W−Q)ᵀ) over the linears (with round-to-nearest's
beside it), the seconds end to end, the peak RSS, and with ``--verify`` verify's KLD.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantizer.calibrate import (
    capture,  # noqa: E402
    native_attention,  # noqa: E402
)
from quantizer.calibrate import state as calib_state  # noqa: E402
from quantizer.calibrate.windows import CalibrationSettings  # noqa: E402
from quantizer.memory import peak_rss_mb  # noqa: E402
from quantizer.methods import gptq, gptq_method, hessian_factor  # noqa: E402
from quantizer.methods.gram import add_gram  # noqa: E402
from quantizer.quantization import layerwise  # noqa: E402
from quantizer.quantization.planning import QuantizeOptions  # noqa: E402
from quantizer.quantization.request import QuantizeRequest  # noqa: E402
from quantizer.quantization.run import quantize_checkpoint  # noqa: E402

PHASES = ("forward", "attention", "hessian", "factorisation", "column loop", "report", "io")


class Clock:
    """Seconds and counted operations per phase; nested phases are subtracted from their parent."""

    def __init__(self):
        self.seconds, self.flops, self.stack = defaultdict(float), defaultdict(float), []

    def timed(self, phase: str, fn, flops=None):
        def wrapper(*args, **kwargs):
            self.stack.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                inner = self.stack.pop()
                self.seconds[phase] += elapsed - inner
                if self.stack:
                    self.stack[-1] += elapsed
                if flops is not None:
                    self.flops[phase] += flops(*args, **kwargs)
        return wrapper


def _hessian_flops(acc, x):
    return 2.0 * (x.numel() // x.shape[-1]) * x.shape[-1] ** 2


def _attention_flops(q, k, *args, **kwargs):
    return 2.0 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]


def _factor_flops(H, *args, **kwargs):
    return float(H.shape[0]) ** 3 / 3  # one Cholesky factorisation


def _loop_flops(W, factor, group_size, symmetric, act_order, block_size, *args, **kwargs):
    n, k = W.shape
    return float(n) * k * k + float(n) * k * block_size


def _report_flops(W, q, H, *args):
    n, k = W.shape
    rows = len(range(0, n, max(1, -(-n * k * k // gptq_method.REPORT_WORK))))
    return 2.0 * rows * k * k


def instrument(clock: Clock) -> None:
    """Wrap the core's phase functions (module attributes, looked up at call time) and count the
    products of every ``nn.Linear`` computed."""
    capture.capture_inputs = clock.timed("forward", capture.capture_inputs)
    capture.accumulate = clock.timed("forward", capture.accumulate)
    capture.head_statistic = clock.timed("forward", capture.head_statistic)
    layerwise._replay_layer = clock.timed("forward", layerwise._replay_layer)
    layerwise.trace_layer = clock.timed("forward", layerwise.trace_layer)
    layerwise.replay_inputs = clock.timed("forward", layerwise.replay_inputs)
    F.scaled_dot_product_attention = clock.timed("attention", F.scaled_dot_product_attention, _attention_flops)
    native_attention.causal_attention = clock.timed("attention", native_attention.causal_attention, _attention_flops)
    gptq.HessianAccumulator.add = clock.timed("hessian", gptq.HessianAccumulator.add, _hessian_flops)
    hessian_factor._lower_cholesky = clock.timed("factorisation", hessian_factor._lower_cholesky, _factor_flops)
    gptq._solve_rows = clock.timed("column loop", gptq._solve_rows, _loop_flops)
    gptq_method._report = clock.timed("report", gptq_method._report, _report_flops)
    layerwise._materialize = clock.timed("io", layerwise._materialize)
    calib_state.LayerSaves.wait = clock.timed("io", calib_state.LayerSaves.wait)
    layerwise._write_output = clock.timed("io", layerwise._write_output)

    real = torch.nn.Linear.forward

    def counted(module, x):  # class-level, so outputs answered from a cache are not counted
        clock.flops["forward"] += 2.0 * (x.numel() // module.in_features) * module.in_features * module.out_features
        return real(module, x)

    torch.nn.Linear.forward = counted


def gemm_rates(k: int, rows: int = 4096, reps: int = 5) -> dict[str, float]:
    """GFLOP/s of the Hessian's own shape, xᵀx for x [rows, k]: ATen's GEMM in
    fp32 and bf16, and the Gram the Hessians use (``gram``: GPTQ's ``add_gram``, which computes
    the half on and above the diagonal), each counted as a full GEMM's 2·rows·k²."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(0))
    x16, C = x.to(torch.bfloat16), torch.zeros(k, k)
    products = {"fp32": lambda: x.t() @ x, "bf16": lambda: x16.t() @ x16,
                "gram": lambda: add_gram(C, x16, 1.0, 0.0)}
    rates = {}
    for name, product in products.items():
        product()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            product()
            times.append(time.perf_counter() - start)
        rates[name] = 2.0 * rows * k * k / statistics.median(times) / 1e9
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "smollm2-135m-bf16")
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--group-size", type=int, help="default: int4q quantize's")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="--calib-precision")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, help="keep the output here (default: a temporary folder)")
    ap.add_argument("--verify", action="store_true", help="also run verify's KLD on the output")
    ap.add_argument("--json", type=Path, help="write the numbers here too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    config = json.loads((args.model / "config.json").read_text())
    k = config["hidden_size"]
    before = gemm_rates(k)
    clock = Clock()
    instrument(clock)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp) / "q"
        request = QuantizeRequest(str(args.model), out, QuantizeOptions(method="gptq", group_size=args.group_size),
                                  overwrite=True, windows=CalibrationSettings(args.nsamples, args.seqlen, 0, args.precision))
        start = time.perf_counter()
        report = quantize_checkpoint(request)
        total = time.perf_counter() - start
        counted, seconds, peak = dict(clock.flops), dict(clock.seconds), peak_rss_mb()  # the quantize's, not verify's
        kld = _verify(out, args.model) if args.verify else None
    after = gemm_rates(k)
    gemm = {name: statistics.mean((before[name], after[name])) for name in before}
    losses = [(e.get("gptq_loss"), e.get("rtn_loss")) for e in report.tensors.values() if "gptq_loss" in e]
    result = {"model": str(args.model), "nsamples": args.nsamples, "seqlen": args.seqlen, "precision": args.precision,
              "group_size": args.group_size, "threads": args.threads, "seconds": round(total, 1),
              "peak_rss_mb": round(peak), "gemm_gflops": {n: round(r, 1) for n, r in gemm.items()},
              "objective": sum(g for g, _ in losses), "objective_rtn": sum(r for _, r in losses), "kld": kld,
              "phases": {p: {"seconds": round(seconds.get(p, 0.0), 2), "gflop": round(counted.get(p, 0) / 1e9, 1)}
                         for p in PHASES}}
    _print(result, total)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def _verify(out: Path, model: Path) -> float:
    from quantizer.verification.run import run_verify

    report = run_verify(out, model, None, 512, 16, 0, None, lambda m: None)
    return report["fidelity"]["kld_mean"]


def _print(result: dict, total: float) -> None:
    gemm = result["gemm_gflops"]
    print(f"{result['model']}: {result['nsamples']} x {result['seqlen']} tokens in {result['precision']}, "
          f"group {result['group_size']}, "
          f"{result['threads']} threads: {total:.1f} s, peak RSS {result['peak_rss_mb']} MiB")
    print(f"GEMM here (xᵀx, K = hidden): fp32 {gemm['fp32']:.0f} GFLOP/s, bf16 {gemm['bf16']:.0f}, "
          f"int4q's Gram {gemm['gram']:.0f} (as a full GEMM)")
    print(f"{'phase':<14}{'seconds':>9}{'share':>8}{'GFLOP':>10}{'GFLOP/s':>9}{'of fp32':>9}")
    counted = 0.0
    for phase, p in result["phases"].items():
        counted += p["seconds"]
        rate = p["gflop"] / p["seconds"] if p["seconds"] and p["gflop"] else None
        print(f"{phase:<14}{p['seconds']:>9.1f}{100 * p['seconds'] / total:>7.0f}%{p['gflop']:>10.0f}"
              + (f"{rate:>9.0f}{100 * rate / gemm['fp32']:>8.0f}%" if rate else ""))
    print(f"{'other':<14}{total - counted:>9.1f}{100 * (total - counted) / total:>7.0f}%")
    math_phases = [result["phases"][p] for p in ("hessian", "factorisation", "column loop")]
    flops, seconds = sum(p["gflop"] for p in math_phases), sum(p["seconds"] for p in math_phases)
    if seconds:
        print(f"hessian + factorisation + column loop: {flops / seconds:.0f} GFLOP/s, "
              f"{100 * flops / seconds / gemm['fp32']:.0f}% of the fp32 GEMM")
    print(f"objective Σ tr((W−Q)H(W−Q)ᵀ): GPTQ {result['objective']:.6g}, round-to-nearest "
          f"{result['objective_rtn']:.6g}" + (f"; verify KLD {result['kld']:.5f}" if result["kld"] is not None else ""))


if __name__ == "__main__":
    main()
