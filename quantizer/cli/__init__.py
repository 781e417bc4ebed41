"""The ``int4q`` command line: ``main`` (the group, error mapping) and one module per command family:
``quantize`` (quantize, bundled-model), ``runtime`` (generate, bench), ``publish`` (verify, push),
``progress`` (bars and lines)."""

from .main import main

__all__ = ["main"]
