"""Where int4q keeps what it builds once per machine (compiled decode steps, a first-use build
of the native library), what such builds depend on, and how they are trusted: a private
folder of this user's, and each artefact's sha256 recorded when it was built and checked before
it is loaded."""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path


def cache_dir() -> Path:
    """``INT4Q_CACHE_DIR``, else ``$XDG_CACHE_HOME/int4q``, else ``~/.cache/int4q``."""
    if os.environ.get("INT4Q_CACHE_DIR"):
        return Path(os.environ["INT4Q_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "int4q"


class UntrustedCache(Exception):
    """The cache folder may hold code that others put there; the message says why and what to do."""


def trusted_cache_dir() -> Path:
    """:func:`cache_dir`, created private (0700) when missing. UntrustedCache when it belongs to
    another user or others can write it: int4q runs code it finds there."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = root.stat()
    if st.st_uid != os.geteuid():
        raise UntrustedCache(f"the int4q cache {root} belongs to another user; set INT4Q_CACHE_DIR to a folder of yours")
    if st.st_mode & 0o022:
        raise UntrustedCache(f"the int4q cache {root} can be written by others; run chmod go-w {root}, or set "
                             "INT4Q_CACHE_DIR to a private folder")
    return root


def digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def record_digest(path: Path) -> None:
    """Note the sha256 of an artefact int4q just built, beside it."""
    tmp = temporary_sibling(digest_path(path))
    tmp.write_text(file_digest(path) + "\n")
    tmp.replace(digest_path(path))


def matches_digest(path: Path) -> bool:
    """Whether ``path`` is, byte for byte, the artefact int4q recorded when it built it."""
    try:
        return path.is_file() and digest_path(path).read_text().strip() == file_digest(path)
    except OSError:
        return False


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
