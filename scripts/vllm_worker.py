"""Runs inside a vLLM venv for scripts/vllm_check.py: load one checkpoint folder in vLLM, generate
greedily from the given prompt token ids, and print one JSON line (tokens, load time, single-stream
and batched tokens/s). Not for direct use.

    python vllm_worker.py <model dir> <prompts.json> <max new tokens>
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_INT4_W4A8", "0")  # exact W4A16, not int8 activations


def timed_generate(llm, prompts, params) -> float:
    """Seconds for one generate call over ``prompts``, after an untimed one of the same shape
    (the first call of a batch size may compile)."""
    llm.generate(prompts, params, use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, prompt_file, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.loads(open(prompt_file).read())]
    start = time.perf_counter()
    llm = LLM(model=model, max_model_len=512, dtype="bfloat16", seed=0)
    load_s = time.perf_counter() - start
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    fixed = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
    single = [timed_generate(llm, [p], fixed) for p in prompts[:3]]
    rates = {"single": round(max_tokens * len(single) / sum(single), 1)}
    for batch in (4, 16):
        seconds = timed_generate(llm, [prompts[i % len(prompts)] for i in range(batch)], fixed)
        rates[f"batch{batch}"] = round(batch * max_tokens / seconds, 1)
    print("RESULT " + json.dumps({"tokens": tokens, "load_s": round(load_s, 1), **rates}), flush=True)


if __name__ == "__main__":
    main()
