"""A prompt through the native plan in one call against the eager prefill, same model, same
prompt, interleaved: the measurement behind ``native_step.PROMPT_ROWS``.

    python benchmarks/plan_prefill.py models/smollm2-135m-int4-g64 [--threads 2] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quantizer.runtime import load_model
from quantizer.runtime.activations import Activations
from quantizer.runtime.decode import native_step as native
from quantizer.runtime.decode.decoder import FastDecoder

LENGTHS = (8, 32, 64, 128, 256, 512)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    decoder = FastDecoder(load_model(args.model, activations=Activations("int8", "int8")), max(LENGTHS) + 8)
    step = native.native_step(decoder)
    if step is None:
        raise SystemExit("the native step does not run this model here (see the log line above)")
    step.rows = max(LENGTHS)  # every length through the plan, for the comparison
    print(f"threads {args.threads}, {args.reps} interleaved reps, medians")
    for length in LENGTHS:
        ids = torch.randint(0, 1000, (1, length), generator=torch.Generator().manual_seed(length))
        times = {"plan": [], "eager": []}
        for _ in range(args.reps):
            for arm, times_of_arm in times.items():
                decoder.native = step if arm == "plan" else None
                decoder.reset()
                start = time.perf_counter()
                decoder.forward(ids)
                times_of_arm.append(time.perf_counter() - start)
        plan, eager = (statistics.median(times[a]) for a in ("plan", "eager"))
        print(f"{length:4d} tokens: plan {plan * 1e3:7.1f} ms ({length / plan:6.0f} tok/s), "
              f"eager {eager * 1e3:7.1f} ms ({length / eager:6.0f} tok/s), plan / eager time {plan / eager:.2f}",
              flush=True)


if __name__ == "__main__":
    main()
