"""A full-size stand-in checkpoint: a real model folder's config and tokenizer, the shape fields
of a published model of the same architecture, and seeded random bf16 weights.

    .venv/bin/python benchmarks/make_shaped_model.py --like models/qwen2.5-coder-1.5b-bf16 \
        --shape qwen2.5-7b --out /tmp/qwen2.5-7b-shaped [--shard-gb 5] [--layers N]

Weights are N(0, 0.02) (norms 1), written one tensor at a time into sharded safetensors with an
index, so the builder's memory is the largest tensor's. The tokenizer files are copied from
``--like``; the vocabulary rows beyond the tokenizer's are padding, as in the published models.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantizer.io.shards import ShardWriter, TensorSpec  # noqa: E402
from quantizer.io.structure import build_empty_model  # noqa: E402

SHAPES = {
    # the shape fields of the published config.json files
    "qwen2.5-7b": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "tie_word_embeddings": False, "max_window_layers": 28},
    "qwen2.5-3b": {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                   "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936,
                   "tie_word_embeddings": True, "max_window_layers": 36},
}
COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
          "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model")


def shaped_config(like: dict, shape: dict) -> dict:
    """``like``'s config with ``shape``'s fields; per-layer lists follow the new layer count."""
    config = {**like, **shape}
    layers = config["num_hidden_layers"]
    if isinstance(like.get("layer_types"), list) and like["layer_types"]:
        config["layer_types"] = [like["layer_types"][0]] * layers
    config["dtype"] = "bfloat16"
    return config


def write_shaped_model(like_dir: Path, shape: dict, out: Path, shard_bytes: int, seed: int = 0) -> Path:
    """Write the stand-in to ``out`` (which must not exist); return it."""
    config = shaped_config(json.loads((like_dir / "config.json").read_text()), shape)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in COPIED:
        if (like_dir / name).is_file():
            shutil.copyfile(like_dir / name, out / name)
    state = build_empty_model(config).state_dict()
    if config.get("tie_word_embeddings"):
        state = {n: p for n, p in state.items() if n != "lm_head.weight"}
    shapes = {name: tuple(p.shape) for name, p in state.items()}
    writer = ShardWriter(out, [TensorSpec(n, torch.bfloat16, s) for n, s in shapes.items()], shard_bytes)
    gen = torch.Generator().manual_seed(seed)
    for name, shape_ in shapes.items():
        if len(shape_) == 1:
            value = torch.zeros(shape_) if name.endswith("bias") else torch.ones(shape_)
        else:
            value = torch.randn(shape_, generator=gen).mul_(0.02)
        writer.add(name, value.to(torch.bfloat16))
        del value
    writer.finish()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--like", type=Path, required=True, help="a real model folder: config and tokenizer")
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shard-gb", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, help="fewer decoder layers than the shape's, to time a few of them")
    a = p.parse_args()
    if a.out.exists():
        sys.exit(f"{a.out} exists; give a new folder")
    shape = {**SHAPES[a.shape], **({"num_hidden_layers": a.layers, "max_window_layers": a.layers} if a.layers else {})}
    write_shaped_model(a.like, shape, a.out, int(a.shard_gb * 1e9), a.seed)
    print(a.out)


if __name__ == "__main__":
    main()
