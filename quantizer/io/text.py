"""Text for calibration and evaluation without a download: user files, or CPython's own
documentation (``pydoc_data.topics``, ~465 KB of English) split into two disjoint halves."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import InputError

BUILTIN_NAME = "pydoc_data.topics"


def builtin_text(split: str) -> str:
    """The ``calib`` half (topics sorted by name, first half) or the ``eval`` half (the rest)."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    half = len(names) // 2
    chosen = names[:half] if split == "calib" else names[half:] if split == "eval" else None
    if chosen is None:
        raise ValueError(f"split must be 'calib' or 'eval', got {split!r}")
    return "\n\n".join(topics[n] for n in chosen)


BYTES_PER_TOKEN = 64
"""Bytes of text read for each token a run asks for: several times what any tokenizer takes, so
that a file's prefix of this size holds enough tokens."""
MIN_TEXT_BYTES = 1 << 20


def text_budget(tokens: int) -> int:
    """How much of a text file a run that needs ``tokens`` tokens reads, in bytes."""
    return max(MIN_TEXT_BYTES, BYTES_PER_TOKEN * tokens)


def read_text_file(path: Path, max_bytes: int | None = None) -> str:
    """Plain text, or JSON Lines whose records carry a ``text`` field (``.jsonl``); at most
    ``max_bytes`` of the file (ending at a line break where the file is longer), so that a huge
    file, or a device that never ends, costs no more than the tokens asked for need."""
    path = Path(path)
    raw = _read_prefix(path, max_bytes)
    if path.suffix == ".jsonl":
        texts = []
        for i, line in enumerate(raw.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise InputError(f"{path}:{i}: not valid JSON") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise InputError(f"{path}:{i}: a JSON Lines record needs a string 'text' field")
            texts.append(record["text"])
        raw = "\n\n".join(texts)
    if not raw.strip():
        raise InputError(f"{path}: no text")
    return raw


def _read_prefix(path: Path, max_bytes: int | None) -> str:
    """The file's text, or its first ``max_bytes`` cut back to the last whole line (to the last
    whole character where it has no line break)."""
    try:
        with open(path, "rb") as f:
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from None
    cut = max_bytes is not None and len(data) > max_bytes
    if cut:
        data = data[:max_bytes]
        line_end = data.rfind(b"\n")
        data = data[:line_end + 1] if line_end > 0 else data
    return _decode(path, data, cut)


def _decode(path: Path, data: bytes, cut: bool) -> str:
    """UTF-8 text; where the read was ``cut``, a character the cut split is left out."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if cut and e.start >= len(data) - 3 and e.reason == "unexpected end of data":
            return data[:e.start].decode("utf-8")
        raise InputError(f"{path}: cannot read as UTF-8 text ({e})") from None


def load_text(path: Path | None, split: str, max_bytes: int | None = None) -> tuple[str, str]:
    """(text, description of where it came from); of a file, at most ``max_bytes`` (see
    :func:`read_text_file`)."""
    if path is None:
        return builtin_text(split), f"{BUILTIN_NAME} ({split} half)"
    return read_text_file(path, max_bytes), str(path)
