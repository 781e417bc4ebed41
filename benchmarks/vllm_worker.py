"""Runs inside a vLLM venv for benchmarks/vllm_check.py: load one or more checkpoint folders in vLLM,
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


def unsupported(model: str) -> str | None:
    """Why vLLM cannot run this checkpoint on this CPU, known before loading it: vLLM's GPTQ and
    AWQ layers call ``cpu_gemm_wna16``, which its library for CPUs without AVX-512 lacks (the
    engine then fails in its first forward with an unrelated-looking compile error)."""
    with open(os.path.join(model, "config.json")) as f:
        method = json.load(f).get("quantization_config", {}).get("quant_method")
    if method not in ("gptq", "awq"):
        return None
    import torch
    import vllm._custom_ops  # noqa: F401  (loads vLLM's library for this CPU)

    if hasattr(torch.ops._C, "cpu_gemm_wna16"):
        return None
    return f"vLLM's CPU library for this machine has no cpu_gemm_wna16, the kernel of its {method} layers (AVX-512 only)"


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompt_file, max_tokens, models = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.loads(open(prompt_file).read())]
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    fixed = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    runs, results = [], {}
    for model in models:
        reason = unsupported(model)
        if reason:
            results[model] = {"unsupported": reason}
            continue
        start = time.perf_counter()
        llm = LLM(model=model, max_model_len=512, dtype="bfloat16", seed=0)
        load_s = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
        for rows in BATCHES.values():  # each batch size's first call may compile: untimed
            llm.generate([prompts[i % len(prompts)] for i in range(rows)], fixed, use_tqdm=False)
        results[model] = {"tokens": tokens, "load_s": round(load_s, 1)}
        runs.append((llm, results[model], {name: [] for name in BATCHES}))
    for _ in range(REPS):  # the models' runs interleaved, so the machine's drift falls on each alike
        for name, rows in BATCHES.items():
            for llm, _, times in runs:
                times[name].append(seconds(llm, [prompts[i % len(prompts)] for i in range(rows)], fixed))
    for _, result, times in runs:
        result.update({name: round(BATCHES[name] * max_tokens / statistics.median(t), 1) for name, t in times.items()})
    for model in models:
        print("RESULT " + json.dumps(results[model]), flush=True)


if __name__ == "__main__":
    main()
