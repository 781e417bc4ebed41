"""Run cpu_int4 checkpoints on the CPU: int4q's GEMV (or tinygemm) for decode, dequantize + oneDNN for
prefill. ``load_model`` and ``load_tokenizer`` are the public entry points."""

from ..io.tokenizer import load_tokenizer
from .loader import load_model

__all__ = ["load_model", "load_tokenizer"]
