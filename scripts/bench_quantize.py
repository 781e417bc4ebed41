"""Quantize throughput (MB/s of input) and peak RSS, for SmolLM2-135M and for synthetic sharded
checkpoints of growing size, to show peak RSS does not grow with model size.

    .venv/bin/python scripts/bench_quantize.py [--sizes-gb 1 4] [--keep]

Each run is a separate `int4q quantize` process; seconds and peak RSS are the ones it reports in
its summary (its own ru_maxrss, and wall time from start-up to the renamed output folder).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantizer.checkpoint import ShardWriter  # noqa: E402
from quantizer.structure import build_empty_model  # noqa: E402


def synthetic_checkpoint(path: Path, target_gb: float) -> Path:
    """A Llama-shaped random bf16 checkpoint of about target_gb, written one tensor at a time."""
    hidden, inter = 2048, 5632
    per_layer = 2 * (4 * hidden * hidden + 3 * hidden * inter)
    layers = max(1, round((target_gb * 1e9 - 2 * 32000 * hidden * 2) / per_layer))
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": 16,
        "num_key_value_heads": 16, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    writer = ShardWriter(path, max_shard_bytes=1_000_000_000)
    gen = torch.Generator().manual_seed(0)
    for name, p in build_empty_model(config).state_dict().items():
        writer.add(name, (torch.randn(p.shape, generator=gen) * 0.02).to(torch.bfloat16))
    writer.finish()
    return path


def quantize(src: Path, out: Path) -> tuple[float, float]:
    """Run int4q quantize in a child; return (seconds, peak RSS MiB) from its summary line."""
    proc = subprocess.run(
        [str(REPO / ".venv/bin/int4q"), "quantize", "--model", str(src), "--out", str(out), "--group-size", "64",
         "--no-progress", "--max-shard-size", "200MB"],
        check=True, capture_output=True, text=True,
    )
    match = re.search(r"in ([\d.]+) s, peak RSS (\d+) MiB", proc.stdout)
    return float(match.group(1)), float(match.group(2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-gb", type=float, nargs="*", default=[1.0, 3.0, 6.0])
    ap.add_argument("--smollm2", default=str(REPO / ".cache/smollm2-135m-bf16"))
    args = ap.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    cases = []
    work = Path(tempfile.mkdtemp(prefix="int4q-bench-"))
    try:
        if Path(args.smollm2, "config.json").is_file():
            cases.append(("SmolLM2-135M", Path(args.smollm2)))
        for gb in sorted(args.sizes_gb):
            cases.append((f"synthetic {gb:g} GB", synthetic_checkpoint(work / f"syn{gb:g}", gb)))
        print(f"{'model':<18} {'input MB':>9} {'seconds':>8} {'MB/s':>7} {'peak RSS MiB':>13}")
        for label, src in cases:
            size = sum(p.stat().st_size for p in src.glob("*.safetensors")) / 1e6
            seconds, peak = quantize(src, work / f"out-{src.name}")
            print(f"{label:<18} {size:>9.0f} {seconds:>8.1f} {size / seconds:>7.0f} {peak:>13.0f}", flush=True)
            shutil.rmtree(work / f"out-{src.name}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
