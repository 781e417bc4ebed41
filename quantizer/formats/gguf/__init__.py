"""GGUF output: int4q's grids on llama.cpp's block types, written by llama.cpp's converter.

``FORMAT`` and ``variant`` are resolved on first use (they import torch); ``types`` does not, so
the CLI lists the ``--gguf-type`` names cheaply."""

__all__ = ["FORMAT", "variant"]


def __getattr__(name: str):
    if name in __all__:
        from . import staging

        return getattr(staging, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
