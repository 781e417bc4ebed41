"""Greedy text generation with streaming: the fast decoder where the model allows it, else
transformers ``generate`` (which is also the reference path that verify uses)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ...errors import InputError

STEP_PAYS_FROM = 1024
"""New tokens from which ``generate`` takes the compiled decode step. Reading a saved step takes
seconds, and the eager tokens decoded meanwhile slow down several-fold (the reader holds the
interpreter lock); below this the eager decode alone finishes first (docs/runtime.md, "No wait")."""


def step_pays(max_new_tokens: int) -> bool:
    """Whether a generation of up to ``max_new_tokens`` should take the compiled step."""
    return max_new_tokens >= STEP_PAYS_FROM


def encode_prompt(tokenizer, prompt: str, chat: bool) -> torch.Tensor:
    """Token ids [1, T] for ``prompt``, wrapped in the chat template when ``chat``."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise InputError("this model has no chat template; drop --chat")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt")
        return ids if torch.is_tensor(ids) else ids["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


def greedy_ids(model, input_ids: torch.Tensor, max_new_tokens: int, streamer=None,
               eos: set[int] | None = None) -> torch.Tensor:
    """Greedy continuation ids [1, <= max_new_tokens]; stops at any id of ``eos`` (default: the
    model's generation config's)."""
    from transformers import LogitsProcessorList

    stop = {"eos_token_id": sorted(eos)} if eos else {}
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             do_sample=False, streamer=streamer, temperature=None, top_p=None, top_k=None,
                             logits_processor=LogitsProcessorList([_refuse_non_finite]), **stop)
    return out[:, input_ids.shape[1]:]


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every id that ends generation: the generation config's and the tokenizer's."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class NonFiniteLogits(InputError):
    """The model computed NaN or infinite logits."""


def check_finite(logits: torch.Tensor) -> torch.Tensor:
    """``logits``, or NonFiniteLogits in one line where any is NaN or infinite (a damaged
    checkpoint: a greedy pick among them would be meaningless)."""
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogits("the model computed NaN or infinite logits, so its weights, scales or zeros are not "
                              "finite; run `int4q verify` on the checkpoint, and quantize it again")
    return logits


def _refuse_non_finite(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    return check_finite(scores)


def greedy_token(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1, keepdim=True)`` for logits [..., V]: the first largest, a NaN counting as
    the largest. Taken from ``max``, whose CPU kernel is the faster of the two on bf16 (docs/runtime.md)."""
    return logits.max(-1, keepdim=True).indices


def fast_greedy(decoder, input_ids: torch.Tensor, max_new_tokens: int, eos: set[int]) -> Iterator[int]:
    """Greedy token ids from a fresh :class:`FastDecoder` run, the EOS that ends it included."""
    decoder.reset()
    logits = decoder.forward(input_ids)
    for i in range(max_new_tokens):
        token = int(greedy_token(check_finite(logits)))
        yield token
        if token in eos or i == max_new_tokens - 1:
            return
        logits = decoder.forward(torch.tensor([[token]]))


def detokenize(tokenizer, tokens: Iterator[int]) -> Iterator[str]:
    """Text pieces as tokens arrive; a piece waits while it ends inside a multi-byte character."""
    ids: list[int] = []
    shown = ""
    for token in tokens:
        ids.append(token)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(shown):
            continue
        if len(text) > len(shown):
            yield text[len(shown):]
            shown = text


@dataclass
class GenerationStats:
    """Filled while generating: prompt and new token counts, and perf_counter() times (s) at
    which the first and the last new token were known."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None

    def tick(self, tokens: int = 1) -> None:
        """``tokens`` more new tokens are known now."""
        self.last_token_at = time.perf_counter()
        self.first_token_at = self.first_token_at or self.last_token_at
        self.new_tokens += tokens

    def count(self, tokens: Iterator[int]) -> Iterator[int]:
        for token in tokens:
            self.tick()
            yield token


def check_positions(config, tokens: int, what: str) -> None:
    """InputError when ``tokens`` positions exceed the model's ``max_position_embeddings`` (if it
    has one): past it a model computes garbage without a word. ``what`` says where they come from."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if isinstance(limit, int) and tokens > limit:
        raise InputError(f"{what} make {tokens} positions, more than this model's {limit} "
                         "(max_position_embeddings); ask for fewer")


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int, chat: bool = False,
                  compile: bool = True, stats: GenerationStats | None = None,
                  source: Path | None = None, kv_cache: str = "bf16") -> Iterator[str]:
    """Yield decoded text pieces as they are generated (fast decoder where the model allows).
    ``source``: the model's checkpoint folder, so the compiled step can be made in the background;
    ``kv_cache``: what the fast decoder's KV cache holds (see :func:`.opening.open_decoder`)."""
    from .opening import open_decoder

    ids = encode_prompt(tokenizer, prompt, chat)
    check_positions(model.config, ids.shape[1] + max_new_tokens,
                    f"the prompt's {ids.shape[1]} tokens and --max-new-tokens {max_new_tokens}")
    stats = stats or GenerationStats()
    stats.prompt_tokens = ids.shape[1]
    decoder = open_decoder(model, ids.shape[1] + max_new_tokens, compile=compile, source=source, kv_cache=kv_cache)
    eos = eos_token_ids(model, tokenizer)
    if decoder is None:
        yield from _generate_text_transformers(model, tokenizer, ids, max_new_tokens, eos, stats)
        return
    tokens = fast_greedy(decoder, ids, max_new_tokens, eos)
    yield from detokenize(tokenizer, stats.count(tokens))


def _generate_text_transformers(model, tokenizer, ids: torch.Tensor, max_new_tokens: int, eos: set[int],
                                stats: GenerationStats) -> Iterator[str]:
    from transformers import TextIteratorStreamer

    class CountingStreamer(TextIteratorStreamer):
        def put(self, value):
            if not self.next_tokens_are_prompt:
                stats.tick(value.numel())
            super().put(value)

    streamer = CountingStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    errors: list[BaseException] = []

    def work():
        try:
            greedy_ids(model, ids, max_new_tokens, streamer, eos)
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)
            streamer.end()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    yield from streamer
    thread.join()
    if errors:
        raise errors[0]
