"""A llama-perplexity KLD base file for chat-formatted text, made from the 16-bit model itself.

``llama-perplexity`` tokenizes its text without parsing special tokens, so a chat template's
markers (``<|im_start|>`` ...) would be scored as plain text. Its ``--kl-divergence`` mode reads
the tokens from the base file instead, so this writes that file: held-out questions and answers
(the held-out half of CPython's ``pydoc_data.topics``: "What does the Python reference say about
<topic> (part k)?", answered by the k-th few paragraphs of the topic) through the model's own chat template, tokenized with
its special tokens, packed into windows of whole conversations, and the bf16 model's log
probabilities computed by transformers in fp32, stored as llama.cpp stores them. Every GGUF is
then scored by llama.cpp on the same tokens; the bf16 GGUF's own score is llama.cpp's engine
floor against this reference.

    python benchmarks/chat_logits.py --model models/smollm2 --gguf <bf16.gguf> --out chat.kld

``--calib-out FILE.jsonl`` writes the calibration half's chats the same way, as text for
``int4q quantize --calib``.
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import numpy as np
import torch

QUESTION = "What does the Python reference say about {} (part {})?"
ANSWER_CHARS = 600  # each answer's length at most: a window holds several conversations and their markers


def answers(text: str) -> list[str]:
    """A topic's text as answers of whole paragraphs, each at most :data:`ANSWER_CHARS` (a longer
    paragraph cut there)."""
    parts, current = [], ""
    for paragraph in (p.strip()[:ANSWER_CHARS] for p in text.split("\n\n") if p.strip()):
        if current and len(current) + 2 + len(paragraph) > ANSWER_CHARS:
            parts.append(current)
            current = ""
        current = f"{current}\n\n{paragraph}" if current else paragraph
    return parts + ([current] if current else [])


def topic_chats(held_out: bool) -> list[list[dict]]:
    """One question-and-answer chat (messages) per part of each topic of one half of CPython's
    ``pydoc_data.topics``: the held-out half (scored) or the calibration half, as int4q splits them."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    half = names[len(names) // 2:] if held_out else names[:len(names) // 2]
    return [[{"role": "user", "content": QUESTION.format(name, part)}, {"role": "assistant", "content": answer}]
            for name in half for part, answer in enumerate(answers(topics[name]), start=1)]


def conversations(tokenizer) -> list[list[int]]:
    """Token ids of each held-out chat, with the template's special tokens as tokens."""
    chats = []
    for messages in topic_chats(held_out=True):
        ids = tokenizer.apply_chat_template(messages, tokenize=True)
        chats.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return chats


def write_calibration(model_dir: Path, out: Path) -> None:
    """The calibration half's chats through the model's template, as JSON Lines of ``text`` for
    ``int4q quantize --calib`` (its tokenizer reads the template's markers as special tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out.write_text("".join(json.dumps({"text": tokenizer.apply_chat_template(m, tokenize=False)}) + "\n"
                           for m in topic_chats(held_out=False)))


def windows(chats: list[list[int]], ctx: int, count: int) -> list[list[int]]:
    """``count`` windows of ``ctx`` tokens, each starting at a conversation's first token and
    filled with whole conversations (the last one cut at the window's end)."""
    out, i = [], 0
    while len(out) < count and i < len(chats):
        window = []
        while len(window) < ctx and i < len(chats):
            window += chats[i]
            i += 1
        if len(window) >= ctx:
            out.append(window[:ctx])
    if len(out) < count:
        raise SystemExit(f"the held-out chats fill only {len(out)} windows of {ctx} tokens; ask for fewer")
    return out


def llama_log_probs(logits: np.ndarray) -> np.ndarray:
    """llama-perplexity's stored form of each row of logits [T, V] fp32: uint16 [T, 2 * ceil(V / 2)
    + 4], the first 4 holding (scale, min log-probability) as two fp32, then each logit above
    max - 16 as round((logit - min) / scale)."""
    t, v = logits.shape
    top = logits.max(-1)
    bottom = np.maximum(logits.min(-1), top - np.float32(16))
    log_sum_exp = np.log(np.exp(logits - top[:, None]).astype(np.float64).sum(-1)).astype(np.float32)
    min_log_prob = bottom - top - log_sum_exp
    scale = ((top - bottom) / np.float32(65535)).astype(np.float32)
    inv = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    levels = np.where(logits > bottom[:, None], np.rint(inv[:, None] * (logits - bottom[:, None])), 0)
    out = np.zeros((t, 2 * ((v + 1) // 2) + 4), dtype=np.uint16)
    out[:, :4] = np.stack([scale, min_log_prob.astype(np.float32)], -1).view(np.uint16)
    out[:, 4:4 + v] = levels.astype(np.uint16)
    return out


def gguf_bos(gguf: Path) -> int | None:
    """The BOS id llama.cpp puts at each window's start for this file, or None where it adds none."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields
    add = fields.get("tokenizer.ggml.add_bos_token")
    if add is None or not bool(add.contents()):
        return None
    return int(fields["tokenizer.ggml.bos_token_id"].contents())


def write_base(model_dir: Path, gguf: Path, out: Path, ctx: int, count: int) -> int:
    """Write the base file for ``count`` windows of ``ctx`` chat tokens; returns the vocabulary size."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chosen = windows(conversations(tokenizer), ctx, count)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    vocab = model.get_output_embeddings().weight.shape[0]
    bos, first = gguf_bos(gguf), ctx // 2
    with open(out, "wb") as f:
        f.write(b"_logits_" + struct.pack("<Iii", ctx, vocab, count))
        f.write(np.asarray(chosen, dtype=np.int32).tobytes())
        for window in chosen:
            ids = torch.tensor([[bos if bos is not None else window[0], *window[1:]]])
            with torch.inference_mode():
                logits = model(ids).logits[0, first:ctx - 1].float().numpy()
            f.write(llama_log_probs(np.ascontiguousarray(logits)).tobytes())
    return vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="the bf16 checkpoint folder")
    ap.add_argument("--gguf", type=Path, help="its bf16 GGUF (for llama.cpp's BOS rule)")
    ap.add_argument("--out", type=Path, help="the KLD base file to write")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--calib-out", type=Path, metavar="FILE.jsonl",
                    help="instead, write the calibration half's chats for int4q quantize --calib")
    args = ap.parse_args()
    if args.calib_out:
        write_calibration(args.model, args.calib_out)
    elif args.gguf and args.out:
        write_base(args.model, args.gguf, args.out, args.ctx, args.chunks)
    else:
        ap.error("give --gguf and --out (the KLD base file), or --calib-out")


if __name__ == "__main__":
    main()
