"""Open an int4q GPTQ export (``--format gptq``) in the loaders GPTQ users run, and compare each with
a plain-torch dequantization of the same tensors: max |Δlogit|, KLD and top-1 agreement on held-out
text, and greedy text. Optionally, what the v1 layout cost: KLD against the bf16 source of the
export and of the cpu_int4 output of the same settings.

GPTQModel and optimum are bench extras, never int4q dependencies: run this from an environment
that has them (scripts/setup_gptq_loaders.sh makes one), with int4q on PYTHONPATH:

    GPTQMODEL_CPU_WORKERS=2 PYTHONPATH=. /tmp/peers/bin/python benchmarks/gptq_loaders.py \\
        --export models/gptq-export --source .cache/smollm2-135m-bf16 [--cpu-int4 models/same-settings]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from quantizer.formats.gptq_v1 import SUFFIXES, dequantize_gptq
from quantizer.io.checkpoint import CheckpointReader, read_config
from quantizer.io.structure import build_config
from quantizer.io.text import load_text
from quantizer.io.tokenizer import load_tokenizer
from quantizer.runtime import load_model
from quantizer.verification.fidelity import teacher_forced, token_windows

PROMPT = "The three primary colours are"


def dequantized_reference(export: Path) -> torch.nn.Module:
    """The export's own tensors, dequantized by hand (v1: w = (q - (z + 1)) * s) into a bf16 model."""
    from transformers import AutoModelForCausalLM

    config = read_config(export)
    config.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(build_config(config), dtype=torch.bfloat16).eval()
    reader = CheckpointReader(export)
    state = {}
    for name in reader.infos:
        module, _, suffix = name.rpartition(".")
        if suffix == "qweight":
            parts = [reader.get(f"{module}.{s}") for s in SUFFIXES]
            state[f"{module}.weight"] = dequantize_gptq(*parts).to(torch.float16).to(torch.bfloat16)
        elif suffix not in SUFFIXES:
            state[name] = reader.get(name)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (model.config.tie_word_embeddings and m.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise SystemExit(f"reference: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    return model


def open_with_transformers(export: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(export, device_map="cpu", dtype=torch.bfloat16).eval()


def open_with_gptqmodel(export: Path) -> torch.nn.Module:
    from gptqmodel import GPTQModel

    loaded = GPTQModel.load(str(export), device="cpu")
    return getattr(loaded, "model", loaded).eval()


def logits_of(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids).logits.float()


def greedy_text(model, tokenizer, tokens: int = 24) -> str:
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def weight_mismatch(model, export: Path) -> dict:
    """Each quantized linear's effective weight (its output for the identity, bf16) against the
    hand-written v1 dequantization: the largest difference in units of the group's scale."""
    reader = CheckpointReader(export)
    worst, count = 0.0, 0
    with torch.inference_mode():
        for name, module in model.named_modules():
            if f"{name}.qweight" not in reader.infos or not hasattr(module, "bits"):
                continue
            parts = [reader.get(f"{name}.{s}") for s in SUFFIXES]
            want = dequantize_gptq(*parts)
            got = module(torch.eye(want.shape[1], dtype=torch.bfloat16)).float().t()
            scale = parts[2].float().abs().max().item()
            worst, count = max(worst, (got - want).abs().max().item() / scale), count + 1
    return {"quantized_linears_checked": count, "max_weight_error_in_scales": round(worst, 4)}


def compare(name: str, model, reference, windows, tokenizer, export: Path) -> dict:
    delta = (logits_of(model, windows[0]) - logits_of(reference, windows[0])).abs().max().item()
    fid = teacher_forced(reference, model, windows)
    return {"loader": name, **weight_mismatch(model, export), "max_abs_dlogit": round(delta, 4),
            "kld_vs_reference": round(fid.kld_mean, 6), "top1_vs_reference": round(fid.top1_agreement, 4),
            "greedy": greedy_text(model, tokenizer)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", type=Path, required=True)
    ap.add_argument("--source", type=Path, help="the bf16 source, for what the v1 layout cost")
    ap.add_argument("--cpu-int4", type=Path, help="the cpu_int4 output of the same settings")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    tokenizer = load_tokenizer(args.export)
    text, origin = load_text(None, "eval")
    windows = token_windows(tokenizer, text, args.ctx, args.windows)
    reference = dequantized_reference(args.export)
    rows = [{"loader": "plain-torch dequantization", "greedy": greedy_text(reference, tokenizer)}]
    for name, opener in (("transformers (optimum)", open_with_transformers), ("GPTQModel", open_with_gptqmodel)):
        started = time.perf_counter()
        try:
            model = opener(args.export)
        except Exception as e:  # a loader that refuses the export is the finding
            rows.append({"loader": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
            continue
        rows.append({**compare(name, model, reference, windows, tokenizer, args.export),
                     "load_seconds": round(time.perf_counter() - started, 1)})
        del model
    cost = {}
    if args.source:
        source = load_model(args.source)
        cost["export_kld_vs_bf16"] = round(teacher_forced(source, reference, windows).kld_mean, 6)
        if args.cpu_int4:
            cost["cpu_int4_kld_vs_bf16"] = round(teacher_forced(source, load_model(args.cpu_int4), windows).kld_mean, 6)
    out = {"export": str(args.export), "text": origin, "ctx": args.ctx, "windows": len(windows),
           "loaders": rows, "v1_layout_cost": cost}
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
