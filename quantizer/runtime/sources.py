"""What the runtime's compiled artefacts (decode steps, quick-start snapshots) are generated from:
the sources of the runtime package and of the native library beneath it."""

from __future__ import annotations

import functools
from pathlib import Path

from ..native.build import tree_digest

SOURCE_SUFFIXES = (".py", ".c", ".cpp", ".h")


@functools.lru_cache(maxsize=None)
def runtime_source_digest() -> str:
    """sha256 over every source file of ``quantizer.runtime`` and ``quantizer.native`` (names and
    bytes, relative to ``quantizer/``)."""
    package = Path(__file__).parent.parent
    files = (p for folder in ("runtime", "native") for p in (package / folder).rglob("*")
             if p.suffix in SOURCE_SUFFIXES)
    return tree_digest(package, files)
