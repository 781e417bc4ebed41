"""A model's tokenizer without transformers: the ``tokenizers`` backend that transformers built,
saved as JSON, and its chat template rendered once around a placeholder (the text before and
after a user message), so that a run can encode and decode without importing transformers or
Jinja. :func:`quick_record` makes one only where it gives transformers' ids and text on samples."""

from __future__ import annotations

from dataclasses import dataclass

from .generation import encode_prompt

PLACEHOLDER = "\x00int4q prompt\x00"
SAMPLES = ("Hello", "  spaces, a tab\tand lines\n\n", "Ünïcödé, 日本語, 🙂",
           "def f(x):\n    return x * 2 # <|im_end|>", "a , b . c ? d ! it 's, do n't")
"""Texts on which the quick form must encode and decode as transformers does (the last one as
transformers' clean-up of tokenization spaces would change it)."""


@dataclass(frozen=True)
class QuickTokenizer:
    """``encode(prompt, chat)`` -> ids and ``decode(ids, skip_special_tokens)`` -> text, as
    :func:`.generation.encode_prompt` and transformers' ``decode`` give them.
    ``chat``: the text before and after the user's message, or None (no chat form)."""

    backend: object  # tokenizers.Tokenizer
    chat: tuple[str, str] | None

    @classmethod
    def from_json(cls, backend_json: str, chat: tuple[str, str] | None) -> "QuickTokenizer":
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(backend_json), chat)

    def encode(self, prompt: str, chat: bool) -> list[int]:
        if not chat:
            return self.backend.encode(prompt).ids
        before, after = self.chat
        return self.backend.encode(before + prompt + after, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


def quick_record(tokenizer) -> tuple[str, tuple[str, str] | None] | None:
    """(backend JSON, chat parts or None) of a transformers tokenizer where the quick form agrees
    with it on :data:`SAMPLES` (the chat form also on the placeholder's split), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    saved = backend.to_str()
    quick = QuickTokenizer.from_json(saved, _chat_parts(tokenizer))  # as a later run reads it
    for text in SAMPLES:
        ids = quick.encode(text, chat=False)
        if ids != encode_prompt(tokenizer, text, chat=False)[0].tolist():
            return None
        sample = ids + [t for t in (tokenizer.eos_token_id, tokenizer.bos_token_id) if t is not None] + ids[:3]
        if quick.decode(sample) != tokenizer.decode(sample, skip_special_tokens=True):
            return None
        if quick.chat and quick.encode(text, chat=True) != encode_prompt(tokenizer, text, chat=True)[0].tolist():
            quick = QuickTokenizer(quick.backend, None)
    return saved, quick.chat


def _chat_parts(tokenizer) -> tuple[str, str] | None:
    """The rendered chat template's text before and after one user message, where rendering does
    not depend on the day (``strftime_now``) and places the message unchanged; else None."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "strftime" in template:
        return None
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": PLACEHOLDER}],
                                                 add_generation_prompt=True, tokenize=False)
    except Exception:  # a template that needs more than one user message: no chat form
        return None
    if not isinstance(rendered, str) or rendered.count(PLACEHOLDER) != 1:
        return None
    before, after = rendered.split(PLACEHOLDER)
    return before, after
