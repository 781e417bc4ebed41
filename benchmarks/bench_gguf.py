"""int4q's GGUF files against llama.cpp's own quantizer, measured by llama.cpp itself.

For one bf16 model: llama.cpp's converter writes the bf16 GGUF (the reference); ``llama-imatrix``
makes an importance matrix from the calibration text int4q calibrates on (the first half of
CPython's pydoc_data.topics); ``llama-quantize`` writes each type with and without it; int4q
writes the same types with each method, and ``llama-quantize`` once more with the importance
matrix int4q's weighted run wrote (``--imatrix-out``). Every file is then scored by ``llama-perplexity
--kl-divergence`` against the bf16 logits on the held-out half (mean KLD, same top token, PPL
ratio) and timed by ``llama-bench`` (pp512, tg128), one file at a time, same threads. With
``--llama-types`` and ``--targets``, llama-quantize's other types (with the importance matrix) and
int4q's ``--target-bpw`` files join them: the points and curves of the Pareto plot (plots.py).
With ``--chat N``, every file is also scored on N windows of chat-formatted held-out text, whose
tokens and 16-bit log probabilities :mod:`chat_logits` writes (llama-perplexity cannot tokenize a
chat template's special tokens itself); the bf16 GGUF's own score there is llama.cpp's floor.

    python benchmarks/bench_gguf.py --model models/smollm2 --work /tmp/bench-gguf --threads 2 --json out.json

llama.cpp's tools: ``bash scripts/setup_gguf.sh --build`` (or --llama-bin DIR).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TABLES_Q8 = ("--token-embedding-type", "q8_0", "--output-tensor-type", "q8_0")
# label -> (llama-quantize's type, its options, int4q's options), so both files hold the same types:
# the single types with their tables (token_embd/output) at Q8_0 on both sides (Q4_K: --pure, every
# other tensor Q4_K or its fallback); the K_M and IQ4 mixtures as llama-quantize chooses them (the
# IQ4 mixtures' early ffn_down take Q5_K without an importance matrix: in llama-quantize's files
# without one and int4q's minmax files).
TYPES = {
    "q4_0": ("Q4_0", TABLES_Q8, ("--gguf-type", "q4_0", "--recipe", "table8")),
    "q4_1": ("Q4_1", TABLES_Q8, ("--gguf-type", "q4_1", "--recipe", "table8")),
    "q4_k": ("Q4_K", ("--pure", *TABLES_Q8), ("--gguf-type", "q4_k", "--recipe", "table8")),
    "q4_k_m": ("Q4_K_M", (), ("--gguf-type", "q4_k_m")),
    "q5_k_m": ("Q5_K_M", (), ("--gguf-type", "q5_k_m")),
    "iq4_nl": ("IQ4_NL", (), ("--gguf-type", "iq4_nl")),
    "iq4_xs": ("IQ4_XS", (), ("--gguf-type", "iq4_xs")),
}
METHODS = ("minmax", "weighted", "gptq", "gptq-refined")  # gptq-refined: gptq --refine
SYMMETRIC_TYPES = ("q4_0",)  # the types --refine applies to


def sh(cmd: list, log: Path) -> str:
    """Run a command, its output appended to ``log``; the output, or exit with its tail."""
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    with log.open("a") as f:
        f.write(f"$ {' '.join(map(str, cmd))}\n{done.stdout}{done.stderr}\n")
    if done.returncode:
        sys.exit(f"failed ({done.returncode}): {' '.join(map(str, cmd))}\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    return float(m.group(1)) if m else float("nan")


def fidelity(bin_dir: Path, gguf: Path, base: Path, text: Path, ctx: int, chunks: int, threads: int, log: Path,
             prefix: str = ""):
    """Mean and 99.9th-percentile KLD, same top token %, PPL ratio of ``gguf`` against ``base``
    (keys prefixed by ``prefix``)."""
    out = sh([bin_dir / "llama-perplexity", "-m", gguf, "-f", text, "-c", ctx, "--chunks", chunks, "-t", threads,
              "--kl-divergence-base", base, "--kl-divergence"], log)
    return {prefix + "kld": number(r"Mean\s+KLD:\s+([-\d.]+)", out),
            prefix + "kld999": number(r"99\.9%\s+KLD:\s+([-\d.]+)", out),
            prefix + "top1": number(r"Same top p:\s+([\d.]+)", out),
            prefix + "ppl_ratio": number(r"Mean PPL\(Q\)/PPL\(base\)\s+:\s+([\d.]+)", out)}


def speeds(bin_dir: Path, files: list[Path], threads: int, reps: int, log: Path) -> list[dict]:
    """pp512 and tg128 tok/s of each file: llama-bench once per file per rep, the files
    interleaved within each rep (the machine drifts), the median of the reps."""
    runs: list[list[dict]] = [[] for _ in files]
    for _ in range(reps):
        for i, gguf in enumerate(files):
            out = sh([bin_dir / "llama-bench", "-m", gguf, "-p", 512, "-n", 128, "-t", threads, "-r", 1, "-o", "json"],
                     log)
            rows = json.loads(out[out.index("["):out.rindex("]") + 1])
            runs[i].append({("pp512" if r["n_prompt"] else "tg128"): r["avg_ts"] for r in rows})
    return [{k: round(statistics.median(r[k] for r in per), 1) for k in ("pp512", "tg128")} for per in runs]


def bits_per_weight(gguf: Path) -> float:
    from gguf import GGUFReader

    params = sum(int(t.n_elements) for t in GGUFReader(gguf).tensors)
    return round(8 * gguf.stat().st_size / params, 3)


def prepare(args, work: Path, log: Path) -> tuple[Path, Path, Path, Path]:
    """The bf16 GGUF, its logits on the eval text, the imatrix, and the eval text."""
    from quantizer.formats.gguf.converter import converter_root
    from quantizer.io.text import builtin_text

    calib, evalt = work / "calib.txt", work / "eval.txt"
    calib.write_text(builtin_text("calib"))
    evalt.write_text(builtin_text("eval"))
    bf16 = work / "bf16.gguf"
    if not bf16.exists():
        sh([sys.executable, converter_root() / "convert_hf_to_gguf.py", args.model, "--outtype", "bf16",
            "--outfile", bf16], log)
    base = work / "bf16.kld"
    if not base.exists():
        sh([args.llama_bin / "llama-perplexity", "-m", bf16, "-f", evalt, "-c", args.ctx, "--chunks", args.chunks,
            "-t", args.threads, "--kl-divergence-base", base], log)
    if args.chat and not (work / "chat.kld").exists():
        from chat_logits import write_base

        write_base(args.model, bf16, work / "chat.kld", args.ctx, args.chat)
    imatrix = work / "imatrix.gguf"
    if not imatrix.exists():
        chunks = ["--chunks", args.imatrix_chunks] if args.imatrix_chunks else []
        sh([args.llama_bin / "llama-imatrix", "-m", bf16, "-f", calib, "-c", args.ctx, "-t", args.threads,
            *chunks, "-o", imatrix], log)
    return bf16, base, imatrix, evalt


def arms(args, work: Path, bf16: Path, imatrix: Path, log: Path) -> list[tuple[str, Path, float]]:
    """(label, file, seconds to make it) for every arm, each file made once."""
    made = []
    for label in args.types:
        ltype, llama_options, int4q_options = TYPES[label]
        for use_imatrix in (False, True):
            out = work / f"llama-{label}{'-imatrix' if use_imatrix else ''}.gguf"
            start = time.perf_counter()
            if not out.exists():
                sh([args.llama_bin / "llama-quantize", *(["--imatrix", imatrix] if use_imatrix else []),
                    *llama_options, bf16, out, ltype], log)
            made.append((f"llama-quantize {ltype}{' + imatrix' if use_imatrix else ''}", out,
                         time.perf_counter() - start))
        for method in args.methods:
            if method == "gptq-refined" and label not in SYMMETRIC_TYPES:
                continue
            out = work / f"int4q-{label}-{method}.gguf"
            start = time.perf_counter()
            if not out.exists():
                calib = [*(["--nsamples", args.nsamples] if args.nsamples else []),
                         *(["--seqlen", args.seqlen] if args.seqlen else []),
                         "--imatrix-out", work / f"int4q-{label}-{method}-imatrix.gguf", "--overwrite"] \
                    if method != "minmax" else []
                sh([sys.executable, "-m", "quantizer", "quantize", "--model", args.model, "--out", out, "--format",
                    "gguf", *int4q_options, *method_options(method), "--no-progress", *calib], log)
            made.append((f"int4q {ltype} {method}", out, time.perf_counter() - start))
        if "weighted" in args.methods:
            made.append(with_int4q_imatrix(args, work, label, log))
    return made + llama_points(args, work, bf16, imatrix, log) + sized_arms(args, work, log)


def llama_points(args, work: Path, bf16: Path, imatrix: Path, log: Path) -> list[tuple[str, Path, float]]:
    """llama-quantize's own files at the --llama-types (with the importance matrix): the Pareto
    plot's reference points."""
    made = []
    for ltype in args.llama_types:
        out = work / f"llama-{ltype.lower()}-imatrix.gguf"
        start = time.perf_counter()
        if not out.exists():
            sh([args.llama_bin / "llama-quantize", "--imatrix", imatrix, bf16, out, ltype], log)
        made.append((f"llama-quantize {ltype} + imatrix", out, time.perf_counter() - start))
    return made


def sized_arms(args, work: Path, log: Path) -> list[tuple[str, Path, float]]:
    """int4q's --target-bpw files at each of --targets, for each method: the Pareto plot's curves."""
    made = []
    for target in args.targets:
        for method in (m for m in args.methods if m != "gptq-refined"):
            out = work / f"int4q-target{target:g}-{method}.gguf"
            start = time.perf_counter()
            if not out.exists():
                calib = [*(["--nsamples", args.nsamples] if args.nsamples else []),
                         *(["--seqlen", args.seqlen] if args.seqlen else [])] if method != "minmax" else []
                sh([sys.executable, "-m", "quantizer", "quantize", "--model", args.model, "--out", out, "--format",
                    "gguf", "--target-bpw", target, "--method", method, "--no-progress", *calib], log)
            made.append((f"int4q-target {target:g}bpw {method}", out, time.perf_counter() - start))
    return made


def method_options(method: str) -> tuple[str, ...]:
    return ("--method", "gptq", "--refine") if method == "gptq-refined" else ("--method", method)


def with_int4q_imatrix(args, work: Path, label: str, log: Path) -> tuple[str, Path, float]:
    """llama-quantize's file made with the importance matrix int4q's weighted run wrote."""
    ltype, llama_options, _ = TYPES[label]
    out = work / f"llama-{label}-int4q-imatrix.gguf"
    start = time.perf_counter()
    if not out.exists():
        sh([args.llama_bin / "llama-quantize", "--imatrix", work / f"int4q-{label}-weighted-imatrix.gguf",
            *llama_options, work / "bf16.gguf", out, ltype], log)
    return f"llama-quantize {ltype} + int4q's imatrix (weighted run)", out, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="bf16 checkpoint folder")
    ap.add_argument("--work", type=Path, required=True, help="folder for the files (reused when present)")
    ap.add_argument("--llama-bin", type=Path, default=Path(sys.prefix) / "share/int4q/llama.cpp/build/bin")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=40, help="eval windows of --ctx tokens")
    ap.add_argument("--types", nargs="+", default=list(TYPES), choices=list(TYPES))
    ap.add_argument("--methods", nargs="+", default=list(METHODS[:3]), choices=METHODS,
                    help="int4q's methods; gptq-refined (gptq --refine) on the symmetric types only")
    ap.add_argument("--llama-types", nargs="*", default=[], metavar="TYPE",
                    help="llama-quantize types (with the imatrix) to add as reference points, e.g. Q3_K_M Q6_K")
    ap.add_argument("--targets", nargs="*", type=float, default=[], metavar="BPW",
                    help="int4q --target-bpw files to add, for each of --methods")
    ap.add_argument("--imatrix-chunks", type=int,
                    help="llama-imatrix's windows of --ctx tokens (default: the whole calibration half)")
    ap.add_argument("--nsamples", type=int, help="calibration windows (default: int4q's for each method)")
    ap.add_argument("--seqlen", type=int, help="tokens per calibration window (default: int4q's, 512)")
    ap.add_argument("--reps", type=int, default=3, help="llama-bench repetitions (0: skip the speed columns)")
    ap.add_argument("--no-fidelity", action="store_true", help="only the speed columns")
    ap.add_argument("--chat", type=int, default=0, metavar="N",
                    help="also score every file on N windows of chat-formatted held-out text")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    log = args.work / "commands.log"
    bf16, base, imatrix, evalt = prepare(args, args.work, log)
    rows = []
    made = arms(args, args.work, bf16, imatrix, log)
    if args.chat:
        made.insert(0, ("llama.cpp bf16 (the chat reference's floor)", bf16, 0.0))
    for label, path, seconds in made:
        row = {"arm": label, "file": str(path), "mb": round(path.stat().st_size / 1e6, 2),
               "bpw": bits_per_weight(path), "make_s": round(seconds, 1)}
        if not args.no_fidelity and path != bf16:
            row.update(fidelity(args.llama_bin, path, base, evalt, args.ctx, args.chunks, args.threads, log))
        if args.chat and not args.no_fidelity:
            row.update(fidelity(args.llama_bin, path, args.work / "chat.kld", evalt, args.ctx, args.chat,
                                args.threads, log, prefix="chat_"))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.reps:
        for row, speed in zip(rows, speeds(args.llama_bin, [p for _, p, _ in made], args.threads, args.reps, log)):
            row.update(speed)
    print(f"\n{args.model.name}, eval: {args.chunks} x {args.ctx} tokens of the held-out text, "
          f"{args.threads} threads\n")
    keys = ("kld", "kld999", "top1", "ppl_ratio", *(("chat_kld", "chat_kld999", "chat_top1") if args.chat else ()))
    heads = {"kld": "mean KLD", "kld999": "99.9% KLD", "top1": "same top-1 %", "ppl_ratio": "PPL ratio",
             "chat_kld": "chat mean KLD", "chat_kld999": "chat 99.9% KLD", "chat_top1": "chat same top-1 %"}
    print(f"| arm | MB | bpw | {' | '.join(heads[k] for k in keys)} | pp512 t/s | tg128 t/s |")
    print("| --- " * (len(keys) + 5) + "|")
    for r in rows:
        fid = " | ".join(f"{r[k]:.4f}" if k in r else "-" for k in keys)
        print(f"| {r['arm']} | {r['mb']} | {r['bpw']} | {fid} | {r.get('pp512', '-')} | {r.get('tg128', '-')} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
