"""Round-to-nearest vs GPTQ on the bundled SmolLM2-135M: quantize each variant, verify it against
the bf16 source on the held-out half of pydoc_data.topics, print one table.

    .venv/bin/python scripts/compare_methods.py [--groups 64] [--nsamples 128] [--seqlen 512] [--out models/compare]

GPTQ calibrates on the other half of pydoc_data.topics, so no evaluation text is seen in calibration.
"""

from __future__ import annotations

import argparse
import json
import re
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default=str(REPO / ".cache/smollm2-135m-bf16"))
    ap.add_argument("--out", default=str(REPO / "models/compare"))
    ap.add_argument("--groups", type=int, nargs="*", default=[64])
    ap.add_argument("--methods", nargs="*", default=["minmax", "gptq"])
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--windows", type=int, default=16)
    args = ap.parse_args()
    if not Path(args.source, "config.json").is_file():
        run(["bundled-model", args.source])
    rows = []
    for group in args.groups:
        for method in args.methods:
            for sym in ("--asym", "--sym"):
                name = f"{method}-g{group}-{sym[2:]}"
                out = Path(args.out) / name
                cmd = ["quantize", "--model", args.source, "--out", str(out), "--group-size", str(group),
                       "--method", method, sym, "--overwrite", "--no-progress"]
                if method == "gptq":
                    cmd += ["--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen)]
                summary = run(cmd).strip()
                seconds, peak = re.search(r"in ([\d.]+) s, peak RSS (\d+) MiB", summary).groups()
                report = out / "verify_report.json"
                run(["verify", str(out), "--reference", args.source, "--max-windows", str(args.windows),
                     "--json", str(report)])
                data = json.loads(report.read_text())
                fid, q = data["fidelity"], json.loads((out / "quantization_report.json").read_text())["summary"]
                rows.append((name, q["bits_per_weight"], fid["kld_mean"], fid["kld_p999"], fid["top1_agreement"],
                             fid["ppl_ratio"], f"{fid['greedy_matches']}/{fid['greedy_total']}", float(seconds),
                             int(peak), data["ok"]))
                print(f"done {name}", file=sys.stderr, flush=True)
    print(f"SmolLM2-135M-Instruct, eval: held-out half of pydoc_data.topics, ctx 512, {args.windows} windows; "
          f"gptq calib: {args.nsamples} x {args.seqlen} tokens from the other half")
    print(f"{'variant':<20} {'bpw':>5} {'KLD':>8} {'KLD p99.9':>9} {'top-1':>7} {'ppl ratio':>9} {'greedy':>6} "
          f"{'quant s':>8} {'peak MiB':>8} verify")
    for r in rows:
        print(f"{r[0]:<20} {r[1]:>5} {r[2]:>8.4f} {r[3]:>9.3f} {100 * r[4]:>6.2f}% {r[5]:>9.4f} {r[6]:>6} "
              f"{r[7]:>8.1f} {r[8]:>8} {'PASS' if r[9] else 'FAIL'}")


if __name__ == "__main__":
    main()
