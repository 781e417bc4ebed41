"""Batched decode: B sequences a step through transformers' forward with a KV cache, an int4q
checkpoint against its bf16 source in one process, arms interleaved, medians. The int4 linears
take B rows through their decode path below the checkpoint's ``dequant_threshold`` and their
prefill path from it on, each with the process's activation choice (``--decode``/``--prefill``
of the CLI, ``INT4Q_ACTIVATIONS`` here).

    python benchmarks/bench_batched_decode.py models/smollm2-135m-int4-g64 models/smollm2-135m-bf16 \\
        [--batch 1 4 16] [--prompt 32] [--steps 32] [--reps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("baseline")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    arms = {"int4": load_model(args.model), "bf16": load_model(args.baseline)}
    print(f"threads {args.threads}, prompt {args.prompt}, {args.steps} steps, {args.reps} interleaved reps, medians; "
          f"int4 activations {current().encode()}")
    for batch in args.batch:
        rates = {name: [] for name in arms}
        for _ in range(args.reps):
            for name, model in arms.items():
                rates[name].append(decode_tokens_per_s(model, batch, args.prompt, args.steps))
        int4, bf16 = (statistics.median(rates[n]) for n in ("int4", "bf16"))
        print(f"batch {batch:3d}: int4 {int4:7.1f} tok/s, bf16 {bf16:7.1f} tok/s, ratio {int4 / bf16:.2f}", flush=True)


if __name__ == "__main__":
    main()
