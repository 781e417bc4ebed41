"""Fidelity per bit on the bundled SmolLM2-135M: method x precision recipe x group size, each
variant quantized, verified against the bf16 source on the held-out half of pydoc_data.topics,
and (with --bench) its decode speed measured; one table, and every number in a JSON file.

    .venv/bin/python benchmarks/quality_per_bit.py [--methods minmax weighted gptq gptq-wg] [--recipes all4 table8 mixed]
        [--groups 64 128] [--nsamples 128] [--seqlen 256] [--windows 16] [--bench] [--out models/qpb]

gptq is GPTQ on min/max group grids (--minmax-grids), gptq-wg on weighted ones (the default). Calibrated methods read the other half of pydoc_data.topics, so no evaluation text is seen in
calibration. Group 128 falls back to 64 on the tensors 128 does not divide (576 columns here).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
INT4Q = str(REPO / ".venv/bin/int4q")


def run(args: list[str]) -> str:
    proc = subprocess.run([INT4Q, *args], capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        sys.exit(f"int4q {' '.join(args)} failed:\n{proc.stderr}")
    return proc.stdout


def measure(args, method: str, recipe: str, group: int) -> dict:
    name = f"{method}-{recipe}-g{group}"
    out = Path(args.out) / name
    base = method.removesuffix("-wg")  # gptq-wg: GPTQ with weighted grids
    cmd = ["quantize", "--model", args.source, "--out", str(out), "--group-size", str(group), "--method", base,
           "--recipe", recipe, "--overwrite", "--no-progress"]
    if base == "gptq":
        cmd.append("--weighted-grids" if method.endswith("-wg") else "--minmax-grids")
    if base != "minmax":
        cmd += ["--nsamples", str(args.nsamples if base == "gptq" else args.weighted_nsamples),
                "--seqlen", str(args.seqlen)]
    report = out / "verify_report.json"
    if not (args.reuse and report.is_file()):
        run(cmd)
        run(["verify", str(out), "--reference", args.source, "--max-windows", str(args.windows), "--greedy-tokens",
             "0", "--json", str(report)])
    fid = json.loads(report.read_text())["fidelity"]
    q = json.loads((out / "quantization_report.json").read_text())["summary"]
    row = {"variant": name, "bpw_model": q["whole_model_bits_per_weight"], "bpw_quantized": q["bits_per_weight"],
           "kld_mean": fid["kld_mean"], "kld_p999": fid["kld_p999"], "top1": fid["top1_agreement"],
           "ppl_ratio": fid["ppl_ratio"], "quantize_s": q["seconds"], "peak_mib": q.get("peak_rss_mb")}
    if args.bench:
        bench = out / "bench.json"
        run(["bench", str(out), "--prompt-tokens", "0", "--gen-tokens", "128", "--reps", "3", "--json", str(bench)])
        row["decode_tok_s"] = json.loads(bench.read_text())["arms"]["int4"]["tg_median"]
    print(f"done {name}", file=sys.stderr, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default=str(REPO / ".cache/smollm2-135m-bf16"))
    ap.add_argument("--out", default=str(REPO / "models/qpb"))
    ap.add_argument("--methods", nargs="*", default=["minmax", "weighted", "gptq"])
    ap.add_argument("--recipes", nargs="*", default=["all4", "table8", "mixed"])
    ap.add_argument("--groups", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--nsamples", type=int, default=128, help="GPTQ calibration windows")
    ap.add_argument("--weighted-nsamples", type=int, default=16, help="weighted round-to-nearest windows")
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--bench", action="store_true", help="also measure decode tok/s (int4q bench, tg128)")
    ap.add_argument("--reuse", action="store_true", help="read variants already verified under --out from disk")
    args = ap.parse_args()
    if not Path(args.source, "config.json").is_file():
        run(["bundled-model", args.source])
    rows = [measure(args, m, r, g) for g in args.groups for m in args.methods for r in args.recipes]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "quality_per_bit.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"SmolLM2-135M-Instruct, eval: held-out half of pydoc_data.topics, ctx 512, {args.windows} windows; "
          f"calibration from the other half: gptq {args.nsamples} x {args.seqlen}, weighted "
          f"{args.weighted_nsamples} x {args.seqlen} tokens")
    print("| variant | bpw (model) | bpw (quantized) | KLD | KLD p99.9 | top-1 | ppl ratio | quantize s | peak MiB |"
          + (" decode tok/s |" if args.bench else ""))
    print("|---|---|---|---|---|---|---|---|---|" + ("---|" if args.bench else ""))
    for r in rows:
        print(f"| {r['variant']} | {r['bpw_model']} | {r['bpw_quantized']} | {r['kld_mean']:.4f} | {r['kld_p999']:.3f} "
              f"| {100 * r['top1']:.2f}% | {r['ppl_ratio']:.4f} | {r['quantize_s']:.1f} | {r['peak_mib']} |"
              + (f" {r['decode_tok_s']} |" if args.bench else ""))


if __name__ == "__main__":
    main()
