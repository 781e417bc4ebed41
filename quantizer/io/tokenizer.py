"""A model folder's tokenizer, loaded by transformers without a network."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise InputError(f"{path}: cannot load a tokenizer ({str(e).splitlines()[0]})") from None
