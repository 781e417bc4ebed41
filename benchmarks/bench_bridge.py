"""Checkpoints other tools quantized, converted by int4q, measured by llama.cpp itself.

For each source folder under ``--sources`` (``benchmarks/make_quantized_sources.py`` makes them with
GPTQModel and llm-compressor): ``int4q quantize --format gguf`` (and ``--format cpu_int4``) from the
quantized checkpoint, what became of its grids (modules carried exactly, to the nearest stored scale
and zero, rounded again; the largest error against the source's values), time and peak RSS, the
vocabulary table kept in 16 bits as the producers keep it; then
``llama-perplexity --kl-divergence`` of the GGUF against the bf16 original, beside the source's
own KLD (its dequantized weights as llama.cpp's converter writes them in f32), on the held-out half
of CPython's pydoc_data.topics::

    python benchmarks/bench_bridge.py --model models/smollm2-135m-bf16 --sources .cache/quantized-sources \
        --work /tmp/bench-bridge --json docs/benchmarks/data/bridge.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from bench_gguf import fidelity, sh

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def convert(source: Path, out: Path, fmt: str, log: Path) -> dict:
    """int4q's conversion of ``source``: seconds, peak RSS and what became of its grids. The
    vocabulary table stays in 16 bits, as the producers keep it, so the file differs from the
    source only where the source is quantized."""
    start = time.perf_counter()
    said = sh([ROOT / ".venv/bin/int4q", "quantize", "--model", source, "--out", out, "--format", fmt,
               "--embedding-bits", "16", "--no-progress", "--overwrite"], log)
    seconds = time.perf_counter() - start
    grids = re.search(r"(\d+) carried over exactly, (\d+) to the nearest stored scale and zero, (\d+) rounded again"
                      r"(?:; largest error of the others against the source's values ([\d.e+-]+))?", said)
    return {"seconds": round(seconds, 1), "peak_rss_mib": int(re.search(r"peak RSS (\d+) MiB", said).group(1)),
            "exact": int(grids.group(1)), "nearest": int(grids.group(2)), "rounded": int(grids.group(3)),
            "max_abs_err": float(grids.group(4) or 0.0)}


def markdown_table(rows: list[dict]) -> str:
    """The benchmark page's table of ``rows`` (as the JSON holds them)."""
    lines = ["| source | MB | GGUF modules exact / nearest / rounded | largest error | GGUF KLD | source's own KLD "
             "| GGUF s | peak MiB | cpu_int4 exact / nearest / rounded |", "|" + " --- |" * 9]
    for r in rows:
        g, c, own = r["gguf"], r["cpu_int4"], r["source_kld"]
        lines.append(f"| {r['source']} | {r['source_mb']} | {g['exact']} / {g['nearest']} / {g['rounded']} | "
                     f"{g['max_abs_err']:.3g} | {g['kld']:.4f} | {own['kld'] if own else 'n/a':.4f} | {g['seconds']} | "
                     f"{g['peak_rss_mib']} | {c['exact']} / {c['nearest']} / {c['rounded']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="the bf16 original")
    parser.add_argument("--sources", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--llama-bin", type=Path, default=ROOT / ".venv/share/int4q/llama.cpp/build/bin")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from quantizer.formats.gguf.converter import converter_root
    from quantizer.io.text import builtin_text

    args.work.mkdir(parents=True, exist_ok=True)
    log = args.work / "log.txt"
    text = args.work / "eval.txt"
    text.write_text(builtin_text("eval"))
    bf16, base = args.work / "bf16.gguf", args.work / "bf16.kld"
    if not bf16.exists():
        sh([sys.executable, converter_root() / "convert_hf_to_gguf.py", args.model, "--outtype", "bf16",
            "--outfile", bf16], log)
    if not base.exists():
        sh([args.llama_bin / "llama-perplexity", "-m", bf16, "-f", text, "-c", args.ctx, "--chunks", args.chunks,
            "-t", args.threads, "--kl-divergence-base", base], log)
    rows = []
    for source in sorted(p for p in args.sources.iterdir() if (p / "config.json").is_file()):
        out = args.work / f"{source.name}.gguf"
        row = {"source": source.name, "source_mb": round(sum(f.stat().st_size for f in source.glob("*.safetensors"))
                                                         / 1e6, 1),
               "gguf": convert(source, out, "gguf", log), "cpu_int4": convert(source, args.work / source.name,
                                                                              "cpu_int4", log)}
        row["gguf"].update(fidelity(args.llama_bin, out, base, text, args.ctx, args.chunks, args.threads, log))
        own = args.work / f"{source.name}.f32.gguf"
        try:
            sh([sys.executable, converter_root() / "convert_hf_to_gguf.py", source, "--outtype", "f32",
                "--outfile", own], log)
            row["source_kld"] = fidelity(args.llama_bin, own, base, text, args.ctx, args.chunks, args.threads, log)
            own.unlink()
        except SystemExit:  # the converter has no dequantization for this layout (AWQ)
            row["source_kld"] = None
        rows.append(row)
        g, s = row["gguf"], row["source_kld"]
        print(f"{source.name:32s} GGUF: {g['exact']} exact / {g['nearest']} nearest / {g['rounded']} rounded, "
              f"max err {g['max_abs_err']:.3g}, KLD {g['kld']:.5f} (source's own {s['kld'] if s else 'n/a'}), "
              f"{g['seconds']} s, {g['peak_rss_mib']} MiB; cpu_int4: {row['cpu_int4']['exact']} exact, "
              f"{row['cpu_int4']['seconds']} s", flush=True)
    print(markdown_table(rows))
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "threads": args.threads, "ctx": args.ctx,
                                         "chunks": args.chunks, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
