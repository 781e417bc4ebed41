"""int4q's round-to-nearest GGUF tensors against llama-quantize's, tensor by tensor, on a model of
genuinely full-precision weights (a seeded random Llama with whole K-quant super-blocks and
SmolLM2's tokenizer): each layer tensor's squared error against the f32 weights, int4q's over
llama-quantize's (``--pure``, no importance matrix), for each type::

    .venv/bin/python benchmarks/bench_gguf_tensors.py --work /tmp/bench-tensors --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
TYPES = ["q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"]


def errors(path: Path, reference: dict) -> dict[str, float]:
    import gguf

    out = {}
    for t in gguf.GGUFReader(path).tensors:
        if t.name.startswith("blk.") and t.name.endswith(".weight") and "norm" not in t.name:
            got = gguf.quants.dequantize(t.data, t.tensor_type)
            out[t.name] = float(((got - reference[t.name]) ** 2).sum())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--llama-bin", type=Path, default=ROOT / ".venv/share/int4q/llama.cpp/build/bin")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import gguf
    import torch
    from conftest import TOKENIZER_FILES, save_tiny_llama

    from quantizer.formats.gguf.converter import converter_root
    from quantizer.io.bundled import build_default_model

    args.work.mkdir(parents=True, exist_ok=True)
    smollm2 = ROOT / ".cache" / "smollm2-135m-bf16"
    if not (smollm2 / "config.json").is_file():
        build_default_model(smollm2, overwrite=True)
    model = save_tiny_llama(args.work / "fp32", dtype=torch.float32, vocab_size=49152, hidden_size=512,
                            intermediate_size=1536, num_hidden_layers=args.layers, num_attention_heads=8,
                            num_key_value_heads=4, shard=None)
    for name in TOKENIZER_FILES:
        (model / name).write_bytes((smollm2 / name).read_bytes())
    f32 = args.work / "f32.gguf"
    subprocess.run([sys.executable, converter_root() / "convert_hf_to_gguf.py", model, "--outtype", "f32",
                    "--outfile", f32], check=True, capture_output=True)
    reference = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(f32).tensors}
    rows = []
    for kind in TYPES:
        theirs, mine = args.work / f"llama-{kind}.gguf", args.work / f"int4q-{kind}.gguf"
        subprocess.run([args.llama_bin / "llama-quantize", "--pure", f32, theirs, kind.upper(), "2"], check=True,
                       capture_output=True)
        subprocess.run([ROOT / ".venv/bin/int4q", "quantize", "--model", model, "--out", mine, "--format", "gguf",
                        "--gguf-type", kind, "--no-progress", "--overwrite"], check=True, capture_output=True)
        a, b = errors(theirs, reference), errors(mine, reference)
        ratios = [b[n] / a[n] for n in a]
        rows.append({"type": kind.upper(), "tensors": len(ratios), "worst": round(max(ratios), 4),
                     "median": round(statistics.median(ratios), 4), "best": round(min(ratios), 4),
                     "whole_model": round(sum(b.values()) / sum(a.values()), 4)})
        print(rows[-1], flush=True)
    print("| type | tensors | int4q / llama-quantize error: worst tensor | median | best | whole model |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['type']} | {r['tensors']} | {r['worst']} | {r['median']} | {r['best']} | {r['whole_model']} |")
    if args.json:
        args.json.write_text(json.dumps({"layers": args.layers, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
