"""Loading the native library, ``torch.ops.int4q_native``, once per process: the one installed
beside this module (built by ``setup.py``), else the first-use build of the same sources (see
:mod:`.build`). Each kernel's wrapper then checks its operator against an exact reference."""

from __future__ import annotations

import importlib.machinery
import logging
import os
from pathlib import Path

from ..integrity import matches_digest, record_digest
from .build import LIBRARY_STEM, NativeUnavailable, build, library_path, source_digest
from .cache import UntrustedCache

log = logging.getLogger(__name__)

_loaded: list[Path] = []  # the library this process loaded
_failed: list[NativeUnavailable] = []  # or why it could not


def installed_path() -> Path | None:
    """The library the install step built, when there is one."""
    here = Path(__file__).parent
    return next((here / (LIBRARY_STEM + s) for s in importlib.machinery.EXTENSION_SUFFIXES
                 if (here / (LIBRARY_STEM + s)).is_file()), None)


def ops():
    """``torch.ops.int4q_native`` with int4q's library loaded (built first where no installed one
    exists and none is cached); NativeUnavailable says why not. Decided once per process."""
    import torch

    if not _loaded and not _failed:
        try:
            _loaded.append(_load(torch))
        except NativeUnavailable as e:
            _failed.append(e)
    if _failed:
        raise _failed[0]
    return torch.ops.int4q_native


def loaded_path() -> Path | None:
    """The library file this process loaded, if any."""
    return _loaded[0] if _loaded else None


def _load(torch) -> Path:
    path = installed_path()
    if path is not None:
        return _open(torch, path)
    try:
        path = library_path()
    except UntrustedCache as e:
        raise NativeUnavailable(str(e)) from None
    fresh = not matches_digest(path)  # never load a file int4q did not build as it is
    if fresh:
        _build(path)
    try:
        return _open(torch, path)
    except NativeUnavailable:
        if fresh:
            raise
        _build(path)  # a damaged or foreign file: built again, once
        return _open(torch, path)


def _build(path: Path) -> None:
    log.info("building int4q's native library (a source checkout without an installed one) -> %s", path)
    build(path)
    record_digest(path)


def _open(torch, path: Path) -> Path:
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:
        raise NativeUnavailable(f"cannot load {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    if torch.ops.int4q_native.source_digest() != source_digest():
        raise NativeUnavailable(f"{path.name} was built from other sources than this int4q's; reinstall int4q "
                                "(bash scripts/setup.sh in a checkout)")
    return path


def native_off() -> bool:
    """Whether the user turned int4q's native kernels off (``INT4Q_NATIVE=0``)."""
    return os.environ.get("INT4Q_NATIVE", "1") == "0"


def load_unless_off(load_native, fallback: str, fix: str):
    """``load_native()``, or None: silently with ``INT4Q_NATIVE=0``, else after one warning line
    saying what runs instead (``fallback``), why, and ``fix``, where it raises NativeUnavailable."""
    if native_off():
        return None
    try:
        return load_native()
    except NativeUnavailable as e:
        log.warning("%s (slower): %s. %s, or INT4Q_NATIVE=0 to silence this", fallback, e, fix)
        return None


def passes_self_test(self_test, instead: str) -> bool:
    """Whether the library loads here and ``self_test()`` passes: False silently where the library
    does not load or is off (the kernels that need it already say why), and after one warning
    saying what runs ``instead`` where the self-test raises NativeUnavailable."""
    if native_off():
        return False
    try:
        ops()
    except NativeUnavailable:
        return False
    try:
        self_test()
    except NativeUnavailable as e:
        log.warning("%s: %s", instead, e)
        return False
    return True
