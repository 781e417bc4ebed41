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


def read_text_file(path: Path) -> str:
    """Plain text, or JSON Lines whose records carry a ``text`` field (``.jsonl``)."""
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read as UTF-8 text ({e})") from None
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


def load_text(path: Path | None, split: str) -> tuple[str, str]:
    """(text, description of where it came from)."""
    if path is None:
        return builtin_text(split), f"{BUILTIN_NAME} ({split} half)"
    return read_text_file(path), str(path)
