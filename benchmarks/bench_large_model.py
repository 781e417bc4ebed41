"""A large model end to end, side by side: llama.cpp's pipeline (``convert_hf_to_gguf.py --outtype
bf16`` then ``llama-quantize``) against int4q writing the same GGUF type in one pass, and int4q's
round-to-nearest cpu_int4; time, CPU time and peak RSS of every step.

    .venv/bin/python benchmarks/make_shaped_model.py --like models/qwen2.5-coder-1.5b-bf16 \
        --shape qwen2.5-7b --out /tmp/qwen2.5-7b-shaped
    .venv/bin/python benchmarks/bench_large_model.py --model /tmp/qwen2.5-7b-shaped [--type Q4_K_M] \
        [--threads 2] [--work /tmp/large-bench] [--json docs/benchmarks/data/large_model.json]

Each step is its own process, run one at a time (nothing else should run on the machine); its
peak RSS is the kernel's high-water mark for that process (``wait4``). Outputs are deleted as soon
as they are measured; the work folder needs the bf16 intermediate (about the source's size) free.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantizer.formats.gguf.converter import converter_root  # noqa: E402

INT4Q = [sys.executable, "-m", "quantizer"]


def measured(label: str, cmd: list, log: Path) -> dict:
    """Run ``cmd`` alone; its wall seconds, user and system CPU seconds and peak RSS (GB)."""
    start = time.perf_counter()
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(map(str, cmd))}\n")
        out.flush()
        proc = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{label} failed; see {log}")
    return {"step": label, "seconds": round(seconds, 1), "user": round(usage.ru_utime, 1),
            "system": round(usage.ru_stime, 1), "peak_rss_gb": round(usage.ru_maxrss / 1024**2, 2)}


def size_gb(path: Path) -> float:
    files = [path] if path.is_file() else list(path.glob("*.safetensors"))
    return round(sum(f.stat().st_size for f in files) / 1e9, 2)


def llama_pipeline(model: Path, work: Path, gguf_type: str, threads: int, llama_bin: Path, log: Path) -> list[dict]:
    bf16, out = work / "llama-bf16.gguf", work / f"llama-{gguf_type}.gguf"
    steps = [measured("llama.cpp convert_hf_to_gguf --outtype bf16",
                      [sys.executable, converter_root() / "convert_hf_to_gguf.py", model, "--outtype", "bf16",
                       "--outfile", bf16], log)]
    steps.append(measured(f"llama.cpp llama-quantize {gguf_type}",
                          [llama_bin / "llama-quantize", bf16, out, gguf_type, str(threads)], log))
    bf16.unlink()
    steps[-1]["output_gb"] = size_gb(out)
    out.unlink()
    return steps


def int4q_gguf(model: Path, work: Path, gguf_type: str, log: Path) -> dict:
    out = work / f"int4q-{gguf_type}.gguf"
    step = measured(f"int4q quantize --format gguf --gguf-type {gguf_type.lower()}",
                    [*INT4Q, "quantize", "--model", model, "--out", out, "--format", "gguf", "--gguf-type",
                     gguf_type.lower(), "--overwrite"], log)
    step["output_gb"] = size_gb(out)
    out.unlink()
    return step


def int4q_cpu_int4(model: Path, work: Path, log: Path) -> dict:
    out = work / "int4q-cpu_int4"
    step = measured("int4q quantize --group-size 128 (cpu_int4)",
                    [*INT4Q, "quantize", "--model", model, "--out", out, "--group-size", "128", "--overwrite"], log)
    step["output_gb"] = size_gb(out)
    subprocess.run(["rm", "-rf", str(out)], check=True)
    return step


def print_table(source_gb: float, steps: list[dict]) -> None:
    print(f"{'step':<58} {'seconds':>8} {'source MB/s':>11} {'user':>7} {'system':>7} {'peak RSS GB':>11} "
          f"{'output GB':>9}")
    for s in steps:
        print(f"{s['step']:<58} {s['seconds']:>8.1f} {1000 * source_gb / s['seconds']:>11.0f} {s['user']:>7.1f} "
              f"{s['system']:>7.1f} {s['peak_rss_gb']:>11.2f} {s.get('output_gb', ''):>9}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--type", default="Q4_K_M", help="llama-quantize's type name; int4q's --gguf-type is its lower case")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path("/tmp/int4q-large-bench"))
    p.add_argument("--llama-bin", type=Path, default=Path(sys.prefix) / "share/int4q/llama.cpp/build/bin")
    p.add_argument("--skip-llama", action="store_true", help="int4q's steps only")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    log = a.work / "bench.log"
    source_gb = size_gb(a.model)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; source {a.model} "
          f"({source_gb} GB); log {log}", flush=True)
    steps = [] if a.skip_llama else llama_pipeline(a.model, a.work, a.type, a.threads, a.llama_bin, log)
    steps += [int4q_gguf(a.model, a.work, a.type, log), int4q_cpu_int4(a.model, a.work, log)]
    if not a.skip_llama:
        pipeline = {"step": f"llama.cpp pipeline (both steps), {a.type}",
                    "seconds": round(steps[0]["seconds"] + steps[1]["seconds"], 1),
                    "user": round(steps[0]["user"] + steps[1]["user"], 1),
                    "system": round(steps[0]["system"] + steps[1]["system"], 1),
                    "peak_rss_gb": max(steps[0]["peak_rss_gb"], steps[1]["peak_rss_gb"])}
        steps.insert(2, pipeline)
    print_table(source_gb, steps)
    record = {"model": str(a.model), "source_gb": source_gb, "threads": a.threads, "steps": steps}
    if not a.skip_llama:
        pipeline, gguf = steps[2], steps[3]
        record["gguf_over_pipeline"] = {"seconds": round(gguf["seconds"] / pipeline["seconds"], 3),
                                        "peak_rss": round(gguf["peak_rss_gb"] / pipeline["peak_rss_gb"], 3)}
        print(f"int4q's GGUF over llama.cpp's pipeline: {record['gguf_over_pipeline']['seconds']:.2f}x the time, "
              f"{record['gguf_over_pipeline']['peak_rss']:.2f}x the peak RSS")
    if a.json:
        a.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
