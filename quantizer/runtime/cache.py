"""Where the runtime keeps what it builds once per machine (compiled decode steps, the native
prefill kernel), and what such builds depend on."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from pathlib import Path


def cache_dir() -> Path:
    """``INT4Q_CACHE_DIR``, else ``$XDG_CACHE_HOME/int4q``, else ``~/.cache/int4q``."""
    if os.environ.get("INT4Q_CACHE_DIR"):
        return Path(os.environ["INT4Q_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "int4q"


def temporary_sibling(path: Path) -> Path:
    """A name beside ``path`` that no other process writes to; rename it onto ``path`` when done."""
    return path.with_name(f"{path.name}.tmp{os.getpid()}")


def machine_identity() -> str:
    """The machine and, on Linux, its instruction-set flags: what natively compiled code depends on."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {flags.strip()}"


SOURCE_SUFFIXES = (".py", ".c", ".cpp")


@functools.lru_cache(maxsize=None)
def runtime_source_digest() -> str:
    """sha256 over every source file of the runtime package (names and bytes): what a compiled
    decode step's code was generated from."""
    root = Path(__file__).parent
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()
