"""Relative squared error of GGUF files' tensors against the bf16 checkpoint they came from.

    python benchmarks/gguf_tensor_error.py --model <bf16 folder> --tensor blk.0.ffn_gate.weight=model.layers.0.mlp.gate_proj.weight \
        a.gguf b.gguf ...

Give only tensors the converter does not reorder (not attn_q/attn_k, which Llama's permutes).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import torch
from safetensors import safe_open


def source_tensors(model: Path, names: set[str]) -> dict[str, torch.Tensor]:
    found = {}
    for shard in sorted(model.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            found.update({n: f.get_tensor(n).float() for n in names & set(f.keys())})
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--tensor", action="append", required=True, help="GGUF_NAME=CHECKPOINT_NAME")
    ap.add_argument("files", type=Path, nargs="+")
    args = ap.parse_args()
    pairs = dict(t.split("=", 1) for t in args.tensor)
    source = source_tensors(args.model, set(pairs.values()))
    for path in args.files:
        cells = []
        for t in gguf.GGUFReader(path).tensors:
            if t.name in pairs:
                w, s = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).float(), source[pairs[t.name]]
                cells.append(f"{t.name} {t.tensor_type.name} {((w - s).pow(2).sum() / s.pow(2).sum()).item():.2e}")
        print(f"{path.name}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
