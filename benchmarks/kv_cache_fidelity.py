"""What an int8 KV cache costs in fidelity: a checkpoint decoded over its bf16 cache and over an
int8 cache (``--kv-cache int8``), each scored against the bf16 source model on the held-out text.

Both arms take the same ``--context`` tokens as a prompt, then ``--steps`` tokens one at a time
(teacher-forced: the text's tokens, not their own), each step attending over the whole cache. Each
step's next-token distribution is compared with the source's (transformers' forward over the same
tokens): mean and 99th-percentile KLD and the top-1 agreement; and the two arms with each other.

    python benchmarks/kv_cache_fidelity.py --int4 models/<g64> --reference models/<bf16> \\
        --context 2048 --steps 256 --json kv_fidelity.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from quantizer.io.text import load_text, text_budget
from quantizer.io.tokenizer import load_tokenizer
from quantizer.runtime import load_model
from quantizer.runtime.activations import KV_CACHES, Activations
from quantizer.runtime.bench import describe_path
from quantizer.runtime.decode.opening import open_decoder


def kld(reference: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || logits) per row, both [N, V] logits."""
    p = reference.float().log_softmax(-1)
    return (p.exp() * (p - logits.float().log_softmax(-1))).sum(-1)


def summary(reference: torch.Tensor, logits: torch.Tensor) -> dict:
    d = kld(reference, logits)
    return {"mean_kld": round(d.mean().item(), 5), "p99_kld": round(d.quantile(0.99).item(), 5),
            "max_kld": round(d.max().item(), 4),
            "top1_agreement": round((reference.argmax(-1) == logits.argmax(-1)).float().mean().item(), 4)}


@torch.inference_mode()
def decoded_logits(model, ids: torch.Tensor, context: int, kv_cache: str) -> tuple[torch.Tensor, str]:
    """Logits [steps, V] of each token after ``context`` through the decoder over ``kv_cache``: the
    prompt's last position's, then one per single-token step; and the decode path."""
    decoder = open_decoder(model, ids.shape[1] + 1, compile=False, kv_cache=kv_cache)
    decoder.reset()
    rows = [decoder.forward(ids[:, :context])]
    for t in range(context, ids.shape[1] - 1):
        rows.append(decoder.forward(ids[:, t : t + 1]))
    return torch.cat(rows), describe_path(decoder)


@torch.inference_mode()
def reference_logits(path: Path, ids: torch.Tensor, context: int) -> torch.Tensor:
    """The source model's logits at positions context - 1 .. end - 2 (each predicting the next token)."""
    model = load_model(path)
    return model(input_ids=ids[:, :-1], logits_to_keep=ids.shape[1] - context).logits[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--int4", type=Path, required=True, help="a cpu_int4 checkpoint")
    ap.add_argument("--reference", type=Path, required=True, help="its bf16 source")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.int4)
    body, origin = load_text(None, "eval", text_budget(args.context + args.steps + 1))
    ids = tokenizer(body, return_tensors="pt").input_ids[:, : args.context + args.steps + 1]
    context = ids.shape[1] - args.steps - 1
    model = load_model(args.int4, activations=Activations("int8", "int8"))
    arms = {kv: decoded_logits(model, ids, context, kv) for kv in KV_CACHES}
    del model
    reference = reference_logits(args.reference, ids, context)
    report = {"int4": str(args.int4), "reference": str(args.reference), "text": origin, "context": context,
              "steps": args.steps, "arms": {}}
    for kv, (logits, path) in arms.items():
        report["arms"][kv] = {"decode_path": path, **summary(reference, logits)}
        print(f"{kv:>5} KV cache ({path}): against the bf16 source " + ", ".join(
            f"{k} {v}" for k, v in report["arms"][kv].items() if k != "decode_path"))
    report["int8_against_bf16_cache"] = summary(arms["bf16"][0], arms["int8"][0])
    print("int8 against the bf16 cache: " + ", ".join(f"{k} {v}" for k, v in report["int8_against_bf16_cache"].items()))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
