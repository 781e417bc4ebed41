"""Greedy text generation with streaming, on top of transformers ``generate``."""

from __future__ import annotations

import threading
from typing import Iterator

import torch

from ..errors import InputError


def encode_prompt(tokenizer, prompt: str, chat: bool) -> torch.Tensor:
    """Token ids [1, T] for ``prompt``, wrapped in the chat template when ``chat``."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise InputError("this model has no chat template; drop --chat")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt")
        return ids if torch.is_tensor(ids) else ids["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


def greedy_ids(model, input_ids: torch.Tensor, max_new_tokens: int, streamer=None) -> torch.Tensor:
    """Greedy continuation ids [1, <= max_new_tokens] (stops at EOS)."""
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             do_sample=False, streamer=streamer, temperature=None, top_p=None, top_k=None)
    return out[:, input_ids.shape[1]:]


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int, chat: bool = False) -> Iterator[str]:
    """Yield decoded text pieces as they are generated."""
    from transformers import TextIteratorStreamer

    ids = encode_prompt(tokenizer, prompt, chat)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    errors: list[BaseException] = []

    def work():
        try:
            greedy_ids(model, ids, max_new_tokens, streamer)
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)
            streamer.end()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    yield from streamer
    thread.join()
    if errors:
        raise errors[0]
