"""Greedy agreement between a checkpoint's decode paths, on verify's prompts: the exact decode
path against int8 decode (each through the decoder ``int4q generate`` opens: native, compiled or
eager), and, with ``--reference``, both against the bf16 source's transformers ``generate``.

    python benchmarks/decode_agreement.py models/<int4> [--reference models/<bf16>] [--tokens 32]

Prints, per prompt, whether the token sequences match and where they first part, then the counts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from quantizer.io.tokenizer import load_tokenizer
from quantizer.runtime import load_model
from quantizer.runtime.activations import EXACT, Activations
from quantizer.runtime.bench import describe_path
from quantizer.runtime.decode.generation import (
    encode_prompt,
    eos_token_ids,
    fast_greedy,
    greedy_ids,
)
from quantizer.runtime.decode.opening import open_decoder
from quantizer.verification.fidelity import GREEDY_PROMPTS


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the sequences differ (a length where one ends early), None if equal."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--reference", type=Path, help="the bf16 source, decoded by transformers' generate")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.checkpoint)
    has_chat = bool(getattr(tokenizer, "chat_template", None))
    prompts = [(kind, p) for kind, p in GREEDY_PROMPTS if kind == "plain" or has_chat]
    arms = {}
    for name, activations in (("exact", EXACT), ("int8", Activations("int8", "int8"))):
        model = load_model(args.checkpoint, activations=activations)
        arms[name] = (model, open_decoder(model, 1024))
        print(f"{name}: decode path {describe_path(arms[name][1])}")
    reference = load_model(args.reference) if args.reference else None
    counts = {"int8 = exact": 0, "exact = bf16": 0, "int8 = bf16": 0}
    for kind, prompt in prompts:
        ids = encode_prompt(tokenizer, prompt, chat=kind == "chat")
        tokens = {}
        for name, (model, decoder) in arms.items():
            tokens[name] = list(fast_greedy(decoder, ids, args.tokens, eos_token_ids(model, tokenizer)))
        if reference is not None:
            tokens["bf16"] = greedy_ids(reference, ids, args.tokens)[0].tolist()
        for pair in counts:
            a, b = pair.split(" = ")
            if b in tokens:
                counts[pair] += first_difference(tokens[a], tokens[b]) is None
        print(f"{kind:5} int8 vs exact parts at {first_difference(tokens['int8'], tokens['exact'])}: {prompt[:50]!r}")
    for pair, n in counts.items():
        if reference is not None or "bf16" not in pair:
            print(f"{pair}: {n}/{len(prompts)}")


if __name__ == "__main__":
    main()
