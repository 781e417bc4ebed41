"""Runs inside a vLLM venv for scripts/vllm_check.py: load one or more checkpoint folders in vLLM,
in this one process, generate greedily from the given prompt token ids with each,
and time single-stream and batched decoding with the models' runs interleaved, rep by rep; print
one JSON line per model (tokens, load time, tokens/s medians). Not for direct use.

    python vllm_worker.py <prompts.json> <max new tokens> <model dir> [<model dir> ...]
"""

import json
import os
import statistics
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_INT4_W4A8", "0")  # exact W4A16, not int8 activations
REPS = 3
BATCHES = {"single": 1, "batch4": 4, "batch16": 16}


def seconds(llm, prompts, params) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompt_file, max_tokens, models = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.loads(open(prompt_file).read())]
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    fixed = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    runs = []
    for model in models:
        start = time.perf_counter()
        llm = LLM(model=model, max_model_len=512, dtype="bfloat16", seed=0)
        load_s = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
        for rows in BATCHES.values():  # each batch size's first call may compile: untimed
            llm.generate([prompts[i % len(prompts)] for i in range(rows)], fixed, use_tqdm=False)
        runs.append((llm, {"tokens": tokens, "load_s": round(load_s, 1)}, {name: [] for name in BATCHES}))
    for _ in range(REPS):  # the models' runs interleaved, so the machine's drift falls on each alike
        for name, rows in BATCHES.items():
            for llm, _, times in runs:
                times[name].append(seconds(llm, [prompts[i % len(prompts)] for i in range(rows)], fixed))
    for _, result, times in runs:
        rates = {name: round(BATCHES[name] * max_tokens / statistics.median(t), 1) for name, t in times.items()}
        print("RESULT " + json.dumps({**result, **rates}), flush=True)


if __name__ == "__main__":
    main()
