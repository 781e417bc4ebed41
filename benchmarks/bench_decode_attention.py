"""Int8 decode's single-token step with bf16 attention against fp32 attention, side by side.

    .venv/bin/python benchmarks/bench_decode_attention.py <int4q folder> [--context 4 384] [--tokens 128]
        [--reps 5] [--threads 2]

Three steps are compiled in this process and timed alternately: bf16 attention (transformers',
as exact decode runs it), fp32 attention through PyTorch on the widened cache, and fp32 attention
through int4q's operator (what ``--decode int8`` runs where the library loads). For each context
length, ``--reps`` rounds of ``--tokens`` single-token steps after a prompt of that many tokens.
Prints each arm's tok/s per round and the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def tokens_per_second(decoder, prompt: torch.Tensor, tokens: int) -> float:
    decoder.reset()
    decoder.forward(prompt)
    token = torch.tensor([[5]])
    start = time.perf_counter()
    for _ in range(tokens):
        decoder.forward(token)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--context", type=int, nargs="+", default=[4, 384])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    os.environ["INT4Q_ACTIVATIONS"] = "decode=int8"
    torch.set_num_threads(args.threads)
    from quantizer.runtime import load_model
    from quantizer.runtime.decode import compiled, decoder

    model = load_model(args.model)
    arms = {}
    for name, attention, variant in (("bf16 attention", decoder.attend, ""),
                                     ("fp32, PyTorch", decoder.attend_widened, "fp32-attention-pytorch"),
                                     ("fp32, int4q", decoder.attend_in_fp32, "fp32-attention")):
        arm = decoder.FastDecoder(model, max(args.context) + args.tokens + 1)
        arm.attention, arm.variant = attention, variant
        compiled.compile_step(arm, compiled.artifact_path(model, variant))
        if arm.compiled is None:
            raise SystemExit(f"the {name} step did not compile")
        arms[name] = arm
    for context in args.context:
        prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
        for arm in arms.values():
            tokens_per_second(arm, prompt, 16)
        rounds = {name: [] for name in arms}
        for _ in range(args.reps):
            for name, arm in arms.items():
                rounds[name].append(tokens_per_second(arm, prompt, args.tokens))
        for name, values in rounds.items():
            print(f"context {context:5d}  {name}: median {statistics.median(values):6.1f} tok/s  "
                  f"rounds {' '.join(f'{v:.1f}' for v in values)}")


if __name__ == "__main__":
    main()
