"""Decoding across architectures: for each model type, a small random stand-in built from its
transformers config, quantized by int4q; which decode path the runtime takes, whether its
greedy tokens (eager and compiled) equal transformers' ``generate`` on the same int4 model, and
decode tok/s of the int4 model's path against the bf16 model's ``generate``, side by side.

Random weights test paths and identity, not speed: on a stand-in the kernels are tiny and the
numbers say little about a real model of the type (SmolLM2 is the real-weight measurement).

    python benchmarks/arch_decode_check.py --work /tmp/archs [--types gpt2 phi3 ...] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CONFIGS = {
    "llama": {},
    "qwen3": dict(head_dim=32),
    "phi3": {},
    "gemma3_text": dict(head_dim=32, sliding_window=512, layer_types=["sliding_attention", "full_attention"]),
    "granite": dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                    logits_scaling=8.0),
    "olmo2": {},
    "stablelm": dict(num_key_value_heads=4, partial_rotary_factor=0.25),
    "falcon": dict(num_kv_heads=2, new_decoder_architecture=True, alibi=False, parallel_attn=True, bias=False),
    "gpt2": dict(n_embd=128, n_layer=2, n_head=4, n_positions=512),
}
PROMPTS = [[1, 17, 99, 4], [1, 300, 250, 8, 8, 60], [1, 5], [1, 400, 401, 402, 403, 404, 405, 406]]


def build(model_type: str, folder: Path) -> Path:
    from conftest import save_byte_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**SMALL, **CONFIGS[model_type]})
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(folder)
    save_byte_tokenizer(folder)
    return folder


def greedy_generate(model, n: int, cache: str | None = None) -> list[list[int]]:
    """transformers' greedy ``generate`` on each prompt (``cache``: its cache_implementation)."""
    out = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = torch.tensor([p])
            done = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, eos_token_id=[-1],
                                  do_sample=False, cache_implementation=cache)
            out.append(done[0, ids.shape[1]:].tolist())
    return out


def greedy_decoder(decoder, n: int) -> list[list[int]]:
    from quantizer.runtime.decode.generation import fast_greedy

    return [list(fast_greedy(decoder, torch.tensor([p]), n, set())) for p in PROMPTS]


def same(a: list[list[int]], b: list[list[int]]) -> str:
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def rate(fn, n: int, sequences: int = len(PROMPTS)) -> float:
    """New tokens per second of ``fn(n)``, which decodes ``n`` tokens for each of ``sequences``."""
    start = time.perf_counter()
    fn(n)
    return round(sequences * n / (time.perf_counter() - start), 1)


def check(model_type: str, work: Path, tokens: int) -> dict:
    from click.testing import CliRunner
    from transformers import AutoModelForCausalLM

    from quantizer.cli.main import main
    from quantizer.runtime import load_model
    from quantizer.runtime.decode.opening import open_decoder

    src, out = build(model_type, work / model_type / "bf16"), work / model_type / "int4"
    done = CliRunner().invoke(main, ["quantize", "--model", str(src), "--out", str(out), "--group-size", "32", "--overwrite",
                                     "--no-progress"])
    if done.exit_code:
        return {"type": model_type, "error": done.output.strip().splitlines()[-1]}
    model = load_model(out)
    eager = open_decoder(model, 64, compile=False)
    row = {"type": model_type, "path": type(eager).__name__ if eager else "generate"}
    if eager is not None:
        compiled = open_decoder(model, 64)
        mine = greedy_decoder(eager, tokens)
        for cache in (None, "static"):
            reference = greedy_generate(model, tokens, cache)
            row[f"eager = generate{' static' if cache else ''}"] = same(mine, reference)
        row["compiled = eager"] = same(greedy_decoder(compiled, tokens), mine) if compiled.compiled is not None \
            else "not compiled (differs from eager)"
        greedy_decoder(compiled, 2)
        row["int4 tok/s"] = rate(lambda n: greedy_decoder(compiled, n), tokens)
    bf16 = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    row["bf16 generate tok/s"] = rate(lambda n: greedy_generate(bf16, n), tokens)
    if eager is not None:
        row["ratio"] = round(row["int4 tok/s"] / row["bf16 generate tok/s"], 2)
    return row


def smollm2_as_phi3(src: Path, folder: Path) -> Path:
    """SmolLM2's own weights as a ``phi3`` model (fused qkv_proj and gate_up_proj): the same
    function, another architecture, real weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    config.update(model_type="phi3", architectures=["Phi3ForCausalLM"])
    weights = {}
    for shard in sorted(src.glob("*.safetensors")):
        weights.update(load_file(shard))
    out = {}
    for name, t in weights.items():
        prefix, _, rest = name.partition(".self_attn.")
        if rest.startswith(("k_proj", "v_proj")) or ".mlp.up_proj" in name:
            continue
        if rest.startswith("q_proj"):
            out[f"{prefix}.self_attn.qkv_proj.weight"] = torch.cat(
                [weights[f"{prefix}.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
        elif ".mlp.gate_proj" in name:
            base = name.split(".mlp.")[0]
            out[f"{base}.mlp.gate_up_proj.weight"] = torch.cat([t, weights[f"{base}.mlp.up_proj.weight"]])
        else:
            out[name] = t
    folder.mkdir(parents=True, exist_ok=True)
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    for aux in src.iterdir():
        if aux.suffix in (".json", ".txt", ".jinja") and aux.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(aux, folder / aux.name)
    return folder


def real_weights(smollm2: Path, work: Path, tokens: int, reps: int) -> list[dict]:
    """SmolLM2 as itself (int4q's decoder) and as phi3 (the static-cache decoder): greedy tokens
    on verify's 8 prompts against generate, and decode tok/s (median of ``reps``, arms
    interleaved) against the bf16 model's generate."""
    import statistics

    from click.testing import CliRunner
    from transformers import AutoModelForCausalLM

    from quantizer.cli.main import main
    from quantizer.io.tokenizer import load_tokenizer
    from quantizer.runtime import load_model
    from quantizer.runtime.decode.generation import (
        encode_prompt,
        fast_greedy,
        greedy_ids,
    )
    from quantizer.runtime.decode.opening import open_decoder
    from quantizer.verification.fidelity import GREEDY_PROMPTS

    prompts = [encode_prompt(load_tokenizer(smollm2), p, chat=k == "chat") for k, p in GREEDY_PROMPTS]
    arms = {}
    for name, src in (("llama", smollm2), ("phi3", smollm2_as_phi3(smollm2, work / "phi3-smollm2" / "bf16"))):
        out = work / f"{name}-smollm2" / "int4"
        CliRunner().invoke(main, ["quantize", "--model", str(src), "--out", str(out), "--group-size", "64",
                                  "--overwrite", "--no-progress"])
        model = load_model(out)
        decoder = open_decoder(model, 256)
        ref = [greedy_ids(model, p, tokens, eos={-1})[0].tolist() for p in prompts]
        got = [list(fast_greedy(decoder, p, tokens, set())) for p in prompts]
        bf16 = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
        arms[name] = {"type": f"{name} (SmolLM2's weights)", "path": type(decoder).__name__,
                      "compiled = generate": f"{sum(a == b for a, b in zip(got, ref))}/{len(prompts)}",
                      "run": (lambda d=decoder: fast_greedy(d, prompts[0], tokens, set()),
                              lambda m=bf16: greedy_ids(m, prompts[0], tokens, eos={-1})), "int4": [], "bf16": []}
    for _ in range(reps):
        for arm in arms.values():
            for key, fn in zip(("int4", "bf16"), arm["run"]):
                arm[key].append(rate(lambda n: list(fn()), tokens, 1))
    rows = []
    for arm in arms.values():
        int4, bf16 = statistics.median(arm.pop("int4")), statistics.median(arm.pop("bf16"))
        arm.pop("run")
        rows.append({**arm, "int4 tok/s": round(int4, 1), "bf16 generate tok/s": round(bf16, 1),
                     "ratio": round(int4 / bf16, 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--types", nargs="+", default=list(CONFIGS))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smollm2", type=Path, help="SmolLM2's bf16 folder: also measure real weights, as llama and phi3")
    ap.add_argument("--reps", type=int, default=5, help="speed repetitions on real weights (median)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for model_type in args.types:
        rows.append(check(model_type, args.work, args.tokens))
        print(json.dumps(rows[-1]), flush=True)
    if args.smollm2:
        rows += real_weights(args.smollm2, args.work, args.tokens, args.reps)
    keys = ["type", "path", "eager = generate", "eager = generate static", "compiled = eager", "compiled = generate",
            "int4 tok/s", "bf16 generate tok/s", "ratio", "error"]
    print("\n| " + " | ".join(keys) + " |\n|" + " --- |" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")


if __name__ == "__main__":
    main()
