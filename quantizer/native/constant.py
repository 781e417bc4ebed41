"""Which of int4q's functions torch.compile may take as constants (whether a kernel is loaded,
decided once per process), marked without importing ``torch._dynamo`` on import: that import
takes a second, and a process that only decodes through the native step compiles nothing."""

from __future__ import annotations

import sys

_marked: list = []  # every function decorated here


def constant_result(fn):
    """``fn``, which :func:`prepare_compile` marks for ``torch.compiler.assume_constant_result``
    (marked now where torch._dynamo is already imported)."""
    _marked.append(fn)
    if "torch._dynamo" in sys.modules:
        _assume_constant(fn)
    return fn


def prepare_compile() -> None:
    """Mark every :func:`constant_result` function for torch.compile; call before compiling."""
    for fn in _marked:
        _assume_constant(fn)


def _assume_constant(fn) -> None:
    import torch

    torch.compiler.assume_constant_result(fn)
