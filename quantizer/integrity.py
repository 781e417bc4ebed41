"""One rule for every file int4q reads back after writing it earlier (resume state, quick-start
snapshots, compiled decode steps, the native library, a GGUF's blocks): its sha256 is recorded
beside it (``<name>.sha256``) when it is written, and checked before it is used. A file whose
record is missing or does not match is not int4q's as it wrote it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def digest_path(path: Path) -> Path:
    """Where ``path``'s recorded sha256 is kept."""
    return path.with_name(path.name + ".sha256")


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def temporary_sibling(path: Path) -> Path:
    """A name beside ``path`` that no other process writes to; rename it onto ``path`` when done."""
    return path.with_name(f"{path.name}.tmp{os.getpid()}")


def record_digest(path: Path) -> None:
    """Note the sha256 of a file int4q just wrote, beside it."""
    tmp = temporary_sibling(digest_path(path))
    tmp.write_text(file_digest(path) + "\n")
    tmp.replace(digest_path(path))


def matches_digest(path: Path) -> bool:
    """Whether ``path`` is, byte for byte, the file int4q recorded when it wrote it."""
    try:
        return path.is_file() and digest_path(path).read_text().strip() == file_digest(path)
    except OSError:
        return False


def changed_files(paths) -> list[Path]:
    """Those of ``paths`` that are not, byte for byte, what int4q recorded when it wrote them."""
    return [p for p in paths if not matches_digest(p)]
