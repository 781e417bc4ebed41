"""int4q's round-to-nearest GGUF tensors against llama-quantize's, tensor by tensor, on a model of
genuinely full-precision weights (a seeded random Llama with whole K-quant super-blocks and
SmolLM2's tokenizer): each layer tensor's squared error against the f32 weights, int4q's over
llama-quantize's (``--pure``, no importance matrix), for each type::

    .venv/bin/python benchmarks/bench_gguf_tensors.py --work /tmp/bench-tensors --json out.json

With ``--imatrix``, the same with an importance matrix: ``llama-imatrix`` on the calibration text
int4q calibrates on, ``llama-quantize --imatrix``, and int4q's weighted grid search with each
column's mean squared activation from that file (the grids ``--method weighted`` and GPTQ start
from), each tensor's error weighted by those columns' importance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
TYPES = ["q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"]


def squared_errors(path: Path, reference: dict) -> dict[str, np.ndarray]:
    """Per layer tensor of a GGUF file, its squared error against the f32 weights, per column [K]."""
    import gguf

    out = {}
    for t in gguf.GGUFReader(path).tensors:
        if t.name.startswith("blk.") and t.name.endswith(".weight") and "norm" not in t.name:
            got = gguf.quants.dequantize(t.data, t.tensor_type)
            out[t.name] = ((got.astype(np.float64) - reference[t.name]) ** 2).sum(0)
    return out


def errors(path: Path, reference: dict) -> dict[str, float]:
    """Per layer tensor of a GGUF file, its squared error against the f32 weights."""
    return {name: float(e.sum()) for name, e in squared_errors(path, reference).items()}


def importance(path: Path) -> dict[str, np.ndarray]:
    """Each weight's column mean squares [K] from llama.cpp's importance-matrix GGUF."""
    import gguf

    tensors = {t.name: np.array(t.data, dtype=np.float64).reshape(-1) for t in gguf.GGUFReader(path).tensors}
    return {name[:-len(".in_sum2")]: sums / tensors[name[:-len(".in_sum2")] + ".counts"][0]
            for name, sums in tensors.items() if name.endswith(".in_sum2")}


def int4q_weighted_errors(kind: str, reference: dict, columns: dict[str, np.ndarray]) -> dict[str, float]:
    """Per layer tensor, the importance-weighted squared error of int4q's weighted grid search."""
    import torch

    from quantizer.formats.gguf.blocks import TYPES as BLOCKS
    from quantizer.methods.grid import quantize_groupwise

    block = BLOCKS[kind.upper()]
    out = {}
    for name, weight in reference.items():
        if name in columns and name.startswith("blk.") and weight.ndim == 2:
            w, cw = torch.from_numpy(weight.astype(np.float32)), torch.from_numpy(columns[name].astype(np.float32))
            q = quantize_groupwise(w, 16 if kind == "q6_k" else 32, block.symmetric, storage=block.storage,
                                   column_weights=cw)
            out[name] = float((columns[name] * (q.dequantize().double().numpy() - weight) ** 2).sum())
    return out


def ratio_row(kind: str, theirs: dict[str, float], mine: dict[str, float]) -> dict:
    ratios = [mine[n] / theirs[n] for n in theirs]
    return {"type": kind.upper(), "tensors": len(ratios), "worst": round(max(ratios), 4),
            "median": round(statistics.median(ratios), 4), "best": round(min(ratios), 4),
            "whole_model": round(sum(mine.values()) / sum(theirs.values()), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--llama-bin", type=Path, default=ROOT / ".venv/share/int4q/llama.cpp/build/bin")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--imatrix", action="store_true", help="with an importance matrix (see above)")
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
    if args.imatrix:
        rows = with_imatrix(args, f32, reference)
    else:
        rows = []
        for kind in TYPES:
            theirs, mine = args.work / f"llama-{kind}.gguf", args.work / f"int4q-{kind}.gguf"
            subprocess.run([args.llama_bin / "llama-quantize", "--pure", f32, theirs, kind.upper(), "2"], check=True,
                           capture_output=True)
            subprocess.run([ROOT / ".venv/bin/int4q", "quantize", "--model", model, "--out", mine, "--format", "gguf",
                            "--gguf-type", kind, "--no-progress", "--overwrite"], check=True, capture_output=True)
            rows.append(ratio_row(kind, errors(theirs, reference), errors(mine, reference)))
            print(rows[-1], flush=True)
    print("| type | tensors | int4q / llama-quantize error: worst tensor | median | best | whole model |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['type']} | {r['tensors']} | {r['worst']} | {r['median']} | {r['best']} | {r['whole_model']} |")
    if args.json:
        args.json.write_text(json.dumps({"layers": args.layers, "imatrix": args.imatrix, "rows": rows}, indent=1)
                             + "\n")


def with_imatrix(args, f32: Path, reference: dict) -> list[dict]:
    """The rows with an importance matrix from ``llama-imatrix`` on int4q's calibration text."""
    from quantizer.io.text import builtin_text

    calib, imatrix = args.work / "calib.txt", args.work / "imatrix.gguf"
    calib.write_text(builtin_text("calib"))
    subprocess.run([args.llama_bin / "llama-imatrix", "-m", f32, "-f", calib, "-c", "512", "--chunks", "16", "-t", "2",
                    "-o", imatrix], check=True, capture_output=True)
    columns = importance(imatrix)
    rows = []
    for kind in TYPES:
        theirs = args.work / f"llama-{kind}-imatrix.gguf"
        subprocess.run([args.llama_bin / "llama-quantize", "--pure", "--imatrix", imatrix, f32, theirs, kind.upper(),
                        "2"], check=True, capture_output=True)
        weighted = {n: float((columns[n] * e).sum()) for n, e in squared_errors(theirs, reference).items()}
        rows.append(ratio_row(kind, weighted, int4q_weighted_errors(kind, reference, columns)))
        print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
