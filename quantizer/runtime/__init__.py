"""Run cpu_int4 checkpoints on the CPU: tinygemm for decode, dequantize + oneDNN for prefill."""

from .loader import load_model, load_tokenizer

__all__ = ["load_model", "load_tokenizer"]
