"""Round-to-nearest quantize: throughput against the I/O limit, and peak RSS across shard caps
and model sizes.

    .venv/bin/python benchmarks/bench_quantize.py [--sizes-gb 1 6] [--shard-sizes 200MB 2GB]

Each quantize is a separate `int4q quantize` process; seconds and peak RSS (VmHWM) are the ones
it reports. The I/O limit is measured in the same run, per model, by a child process that reads
every input tensor and writes as many bytes as the quantized output holds, with nothing in
between: quantize can approach it but not beat it. Inputs are freshly written, so both read
them from the page cache alike.
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
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantizer.io.checkpoint import CheckpointReader  # noqa: E402
from quantizer.io.shards import ShardWriter, TensorSpec  # noqa: E402
from quantizer.io.structure import build_empty_model  # noqa: E402
from quantizer.memory import proc_status_mb  # noqa: E402


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
    shapes = {name: tuple(p.shape) for name, p in build_empty_model(config).state_dict().items()}
    writer = ShardWriter(path, [TensorSpec(n, torch.bfloat16, s) for n, s in shapes.items()], 1_000_000_000)
    gen = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        writer.add(name, (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16))
    writer.finish()
    return path


def quantize(src: Path, out: Path, shard_size: str) -> tuple[float, float, int]:
    """Run int4q quantize in a child; return (seconds, peak RSS MiB, output bytes)."""
    proc = subprocess.run(
        [str(REPO / ".venv/bin/int4q"), "quantize", "--model", str(src), "--out", str(out), "--group-size", "64",
         "--no-progress", "--max-shard-size", shard_size],
        check=True, capture_output=True, text=True,
    )
    match = re.search(r"in ([\d.]+) s, peak RSS (\d+) MiB", proc.stdout)
    output_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    return float(match.group(1)), float(match.group(2)), output_bytes


def io_limit(src: Path, output_bytes: int, dst: Path) -> float:
    """Seconds for a child to read every tensor of ``src`` and write ``output_bytes`` to ``dst``."""
    proc = subprocess.run([sys.executable, __file__, "--io-child", str(src), str(output_bytes), str(dst)],
                          check=True, capture_output=True, text=True)
    return float(proc.stdout.split()[-1])


def io_child(src: Path, output_bytes: int, dst: Path) -> None:
    start = time.perf_counter()
    reader = CheckpointReader(src)
    ratio = output_bytes / reader.total_bytes
    with open(dst, "wb") as f:
        for name in sorted(reader.infos):
            tensor = reader.get(name)
            f.write(memoryview(tensor.view(torch.uint8).reshape(-1).numpy())[: int(tensor.numel() * 2 * ratio)])
        os.fsync(f.fileno())
    print(f"peak {proc_status_mb('VmHWM'):.0f} seconds {time.perf_counter() - start:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-gb", type=float, nargs="*", default=[1.0, 6.0])
    ap.add_argument("--shard-sizes", nargs="*", default=["200MB", "2GB"])
    ap.add_argument("--io-child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.io_child:
        return io_child(Path(args.io_child[0]), int(args.io_child[1]), Path(args.io_child[2]))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    work = Path(tempfile.mkdtemp(prefix="int4q-bench-"))
    try:
        print(f"{'model':<14} {'shards':>6} {'input MB':>9} {'seconds':>8} {'MB/s':>6} {'peak RSS MiB':>13} "
              f"{'I/O limit MB/s':>15} {'limit/ours':>10}")
        for gb in sorted(args.sizes_gb):
            src = synthetic_checkpoint(work / f"syn{gb:g}", gb)
            size = sum(p.stat().st_size for p in src.glob("*.safetensors")) / 1e6
            for shard in args.shard_sizes:
                out = work / "out"
                seconds, peak, output_bytes = quantize(src, out, shard)
                shutil.rmtree(out)
                limit = io_limit(src, output_bytes, work / "io.bin")
                (work / "io.bin").unlink()
                print(f"{f'synthetic {gb:g} GB':<14} {shard:>6} {size:>9.0f} {seconds:>8.1f} {size / seconds:>6.0f} "
                      f"{peak:>13.0f} {size / limit:>15.0f} {seconds / limit:>10.2f}", flush=True)
            shutil.rmtree(src)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
