"""Run cpu_int4 checkpoints on the CPU: int4q's GEMV (or tinygemm) for decode, dequantize + oneDNN for
prefill. ``load_model``, ``load_tokenizer`` and ``BatchedDecoder`` (several sequences a step) are the
public entry points, imported on first use so that the package's light modules (``activations``) do
not bring in torch and transformers."""

from __future__ import annotations

import importlib

_ENTRY_POINTS = {"load_model": ".loader", "load_tokenizer": "..io.tokenizer", "BatchedDecoder": ".decode.batched"}
__all__ = list(_ENTRY_POINTS)


def __getattr__(name: str):
    if name not in _ENTRY_POINTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_ENTRY_POINTS[name], __name__), name)
