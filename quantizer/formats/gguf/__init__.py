"""GGUF output: int4q's grids on llama.cpp's block types, written by llama.cpp's converter."""

from .staging import FORMAT, variant

__all__ = ["FORMAT", "variant"]
