"""Where int4q keeps what it builds once per machine (compiled decode steps, a first-use build
of the native library), what such builds depend on, and how they are trusted: a private
folder of this user's, and each artefact's sha256 recorded when it was built and checked before
it is loaded."""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """``INT4Q_CACHE_DIR``, else ``$XDG_CACHE_HOME/int4q``, else ``~/.cache/int4q``."""
    if os.environ.get("INT4Q_CACHE_DIR"):
        return Path(os.environ["INT4Q_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "int4q"


class UntrustedCache(Exception):
    """The cache folder may hold code that others put there; the message says why and what to do."""


def trusted_cache_dir(folder: str | None = None) -> Path:
    """:func:`cache_dir` (or its subfolder ``folder``), created private (0700) when missing.
    UntrustedCache, after one warning per process, where it or the subfolder belongs to another
    user, others can write it, or it is a link: int4q runs code it finds there."""
    root = cache_dir()
    try:
        _check_private(root, follow=True)  # the root may be a link of the user's making
        if folder:
            _check_private(root / folder, follow=False)  # int4q makes its subfolders: a link there was planted
    except UntrustedCache as e:
        if str(e) not in _warned:
            _warned.add(str(e))
            log.warning("%s; this run neither loads nor saves builds, compiled steps or snapshots there", e)
        raise
    return root / folder if folder else root


_warned: set[str] = set()


def _check_private(path: Path, follow: bool) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat() if follow else path.lstat()
    if not follow and path.is_symlink():
        raise UntrustedCache(f"the int4q cache folder {path} is a link; remove it, or set INT4Q_CACHE_DIR to a folder "
                             "of yours")
    if st.st_uid != os.geteuid():
        raise UntrustedCache(f"the int4q cache {path} belongs to another user; set INT4Q_CACHE_DIR to a folder of "
                             "yours")
    if st.st_mode & 0o022:
        raise UntrustedCache(f"the int4q cache {path} can be written by others; run chmod go-w {path}, or set "
                             "INT4Q_CACHE_DIR to a private folder")


def machine_identity() -> str:
    """The machine and, on Linux, its instruction-set flags: what natively compiled code depends on."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {flags.strip()}"
