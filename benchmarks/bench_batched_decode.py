"""Batched decode: B sequences a step, tokens a second over all of them, arms interleaved per rep,
medians.

The int4 arm decodes the int4q checkpoint with :class:`quantizer.runtime.decode.batched.BatchedDecoder`
(one native call a step for all sequences, each sequence as it decodes alone) where the model has the
native step, else through transformers' forward with a KV cache (the line says which); ``--baseline``
runs its bf16 source through transformers' forward. The int4 linears use the process's activation
choice (``--decode``/``--prefill`` of the CLI, ``INT4Q_ACTIVATIONS`` here). Each
``--batched-bench LABEL=BINARY`` also runs ``--gguf`` through that llama.cpp build's own
``llama-batched-bench`` (mainline or a fork such as ik_llama.cpp; found by its path, never part of
int4q) with that build's ``--bench-flags LABEL="FLAGS"``. Every arm: B sequences of their own
``--prompt`` tokens (not timed), then ``--steps`` greedy steps, tokens a second over all sequences
(llama-batched-bench's S_TG).

    python benchmarks/bench_batched_decode.py models/smollm2-135m-int4-g64 [--baseline models/smollm2-135m-bf16] \\
        [--gguf smollm2-q4_0.gguf --batched-bench ik=<ik build>/bin/llama-batched-bench --bench-flags ik="-rtr 1 -fa 1"] \\
        [--batch 1 4 16] [--prompt 32] [--steps 32] [--reps 3] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import time
from pathlib import Path

import torch
from engines import run_tool

from quantizer.errors import InputError
from quantizer.runtime import load_model
from quantizer.runtime.activations import current
from quantizer.runtime.decode.batched import BatchedDecoder


def prompts(model, batch: int, prompt: int) -> torch.Tensor:
    """``batch`` seeded prompts [batch, prompt] of ordinary token ids."""
    gen = torch.Generator().manual_seed(batch)
    return torch.randint(100, model.config.get_text_config().vocab_size - 1, (batch, prompt), generator=gen)


def native_tokens_per_s(model, batch: int, prompt: int, steps: int) -> float:
    """:func:`forward_tokens_per_s` through a :class:`BatchedDecoder`."""
    decoder = BatchedDecoder(model, batch, prompt + steps)
    logits = decoder.prefill(list(prompts(model, batch, prompt)))
    start = time.perf_counter()
    for _ in range(steps):
        logits = decoder.step(logits.argmax(-1))
    return batch * steps / (time.perf_counter() - start)


@torch.inference_mode()
def forward_tokens_per_s(model, batch: int, prompt: int, steps: int) -> float:
    """Tokens a second over ``steps`` greedy steps of ``batch`` sequences after a ``prompt``-token
    prefill (not timed), through transformers' forward."""
    from transformers import DynamicCache

    ids = prompts(model, batch, prompt)
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
    done = run_tool(binary, "-m", gguf, "-t", str(threads), "-c", str(batch * (prompt + steps) + 16), "-b", "2048",
                    "-ub", "512", "-npp", str(prompt), "-ntg", str(steps), "-npl", str(batch), *flags)
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
    model = load_model(args.model)
    try:
        BatchedDecoder(model, 1, 8)
        int4_path, int4_measure = "native batched step", native_tokens_per_s
    except InputError as e:
        int4_path, int4_measure = f"transformers' forward ({e})", forward_tokens_per_s
    arms = {"int4": lambda b: int4_measure(model, b, args.prompt, args.steps)}
    if args.baseline:
        baseline = load_model(args.baseline)
        arms["bf16"] = lambda b: forward_tokens_per_s(baseline, b, args.prompt, args.steps)
    flags = {label: tuple(shlex.split(text)) for label, text in (f.split("=", 1) for f in args.bench_flags)}
    for label, binary in (b.split("=", 1) for b in args.batched_bench):
        arms[label] = (lambda b, binary=binary, label=label: batched_bench_tokens_per_s(
            binary, args.gguf, flags.get(label, ()), b, args.prompt, args.steps, args.threads))
    print(f"threads {args.threads}, prompt {args.prompt}, {args.steps} steps, {args.reps} interleaved reps, medians "
          f"(tok/s over all sequences); int4 activations {current().encode()}, through the {int4_path}")
    report = {"threads": args.threads, "prompt": args.prompt, "steps": args.steps, "reps": args.reps,
              "activations": current().encode(), "int4_path": int4_path, "batches": {}}
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
