"""Batched decode: B sequences a step, tokens a second over all of them, arms interleaved per rep,
medians.

int4q arms run transformers' forward with a KV cache over an int4q checkpoint (and its bf16 source
with ``--baseline``), in this process: the int4 linears take B rows through their decode path below
the checkpoint's ``dequant_threshold`` and their prefill path from it on, each with the process's
activation choice (``--decode``/``--prefill`` of the CLI, ``INT4Q_ACTIVATIONS`` here). Each
``--batched-bench LABEL=BINARY`` also runs ``--gguf`` through that llama.cpp build's own
``llama-batched-bench`` (mainline or a fork such as ik_llama.cpp; found by its path, never part of
int4q) with that build's ``--bench-flags LABEL="FLAGS"``: B sequences of their own ``--prompt``
tokens, then ``--steps`` steps, its S_TG (tokens a second over all sequences) taken.

    python benchmarks/bench_batched_decode.py models/smollm2-135m-int4-g64 [--baseline models/smollm2-135m-bf16] \\
        [--gguf smollm2-q4_0.gguf --batched-bench ik=<ik build>/bin/llama-batched-bench --bench-flags ik="-rtr 1 -fa 1"] \\
        [--batch 1 4 16] [--prompt 32] [--steps 32] [--reps 3] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import time
from pathlib import Path

import torch
from engines import failure_line

from quantizer.runtime import load_model
from quantizer.runtime.activations import current


@torch.inference_mode()
def decode_tokens_per_s(model, batch: int, prompt: int, steps: int) -> float:
    """Tokens a second over ``steps`` greedy steps of ``batch`` sequences after a ``prompt``-token
    prefill (not timed)."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(100, model.config.get_text_config().vocab_size - 1, (batch, prompt), generator=gen)
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    start = time.perf_counter()
    for _ in range(steps):
        token = logits[:, -1].argmax(-1, keepdim=True)
        logits = model(input_ids=token, cache=cache, use_cache=True).logits
    return batch * steps / (time.perf_counter() - start)


def batched_bench_tokens_per_s(binary: str, gguf: str, flags: tuple[str, ...], batch: int, prompt: int, steps: int,
                               threads: int) -> float:
    """S_TG of one ``llama-batched-bench`` run: ``batch`` sequences, each its own prompt."""
    done = subprocess.run([binary, "-m", gguf, "-t", str(threads), "-c", str(batch * (prompt + steps) + 16),
                           "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(steps), "-npl", str(batch),
                           *flags], capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{binary} failed (exit {done.returncode}): {failure_line(done)}")
    for line in (done.stdout + done.stderr).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[:3] == [str(prompt), str(steps), str(batch)]:
            return float(cells[7])
    raise SystemExit(f"{binary} printed no result row for B={batch}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--baseline", help="the bf16 source, through the same forward")
    parser.add_argument("--gguf", help="the same model as a GGUF, for --batched-bench")
    parser.add_argument("--batched-bench", action="append", default=[], help="LABEL=BINARY (repeatable)")
    parser.add_argument("--bench-flags", action="append", default=[], help='LABEL="FLAGS" for that build')
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.batched_bench and not args.gguf:
        parser.error("--batched-bench needs --gguf")
    torch.set_num_threads(args.threads)
    models = {"int4": load_model(args.model)} | ({"bf16": load_model(args.baseline)} if args.baseline else {})
    arms = {name: (lambda b, m=model: decode_tokens_per_s(m, b, args.prompt, args.steps)) for name, model in models.items()}
    flags = {label: tuple(shlex.split(text)) for label, text in (f.split("=", 1) for f in args.bench_flags)}
    for label, binary in (b.split("=", 1) for b in args.batched_bench):
        arms[label] = (lambda b, binary=binary, label=label: batched_bench_tokens_per_s(
            binary, args.gguf, flags.get(label, ()), b, args.prompt, args.steps, args.threads))
    print(f"threads {args.threads}, prompt {args.prompt}, {args.steps} steps, {args.reps} interleaved reps, medians "
          f"(tok/s over all sequences); int4 activations {current().encode()}")
    report = {"threads": args.threads, "prompt": args.prompt, "steps": args.steps, "reps": args.reps,
              "activations": current().encode(), "batches": {}}
    for batch in args.batch:
        rates = {name: [] for name in arms}
        for _ in range(args.reps):
            for name, measure in arms.items():
                rates[name].append(measure(batch))
        medians = {name: round(statistics.median(v), 1) for name, v in rates.items()}
        report["batches"][batch] = {"medians": medians, "reps": {n: [round(x, 1) for x in v] for n, v in rates.items()}}
        print(f"batch {batch:3d}: " + ", ".join(f"{n} {t:7.1f}" for n, t in medians.items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
