"""Output folders: built beside their final place and renamed in only when complete.

An existing folder is replaced only when the caller recognises it as one int4q wrote (or it is
empty), and never when it is, or holds, one of the inputs. Nothing else is ever deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator, Sequence

from ..errors import InputError, UsageError
from ..schema.config import QUANT_METHOD

REPORT_NAME = "quantization_report.json"


def lock_path(out: Path) -> Path:
    """The lock a run holds while it writes ``out``: beside it, hidden, removed when the run ends."""
    out = Path(out).resolve()
    return out.parent / f".{out.name}.int4q-lock"


@contextlib.contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold ``out``'s lock for the duration; InputError at once when another run holds it."""
    path = lock_path(out)
    busy = InputError(f"another int4q run is writing {out}; wait for it to finish, or choose another --out")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy from None
        try:
            if os.stat(path).st_ino != os.fstat(fd).st_ino:  # its holder removed it after we opened it
                raise busy
        except FileNotFoundError:
            raise busy from None
        try:
            yield
        finally:
            path.unlink(missing_ok=True)
    finally:
        os.close(fd)


def partial_dir(out: Path) -> Path:
    """Where the output is built before it is renamed into place (stable, so a run can resume)."""
    out = Path(out).resolve()
    return out.parent / f".{out.name}.int4q-partial"


def is_int4q_output(folder: Path) -> bool:
    """True for a folder ``int4q quantize`` wrote: a cpu_int4 config, or any quantization_config
    beside int4q's quantization report (the GPTQ export)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(qc, dict):
        return False
    return qc.get("quant_method") == QUANT_METHOD or (Path(folder) / REPORT_NAME).is_file()


def check_output_target(
    out: Path, overwrite: bool, inputs: Sequence[Path] = (), replaceable: Callable[[Path], bool] = is_int4q_output
) -> Path:
    """Raise InputError unless ``out`` may be written; return it resolved.

    ``out`` must not be an input nor contain one. An existing ``out`` needs ``overwrite`` and must
    be a folder that is empty or that ``replaceable`` recognises.
    """
    target = Path(out).resolve()
    _check_parents(target, out, "--out")
    for src in inputs:
        src = Path(src).resolve()
        if target == src or target in src.parents:
            what = "is" if target == src else "contains"
            raise InputError(f"--out {out} {what} the input {src}; choose an output folder outside it")
    if not target.exists() and not target.is_symlink():
        return target
    if not overwrite:
        raise UsageError(f"{out} already exists; pass --overwrite to replace it")
    if not target.is_dir():
        raise InputError(f"{out} exists and is not a folder; remove it or choose another --out")
    if any(target.iterdir()) and not replaceable(target):
        raise InputError(
            f"{out} is not a folder int4q wrote, so --overwrite will not replace it; "
            "remove it yourself or choose another --out"
        )
    return target


def check_output_file(out: Path, overwrite: bool, inputs: Sequence[Path], replaceable: Callable[[Path], bool],
                      option: str = "--out") -> Path:
    """Like :func:`check_output_target` for a single-file output: never a link, never an input,
    an existing file only with ``overwrite`` when ``replaceable`` recognises it. Returns it absolute.
    ``option``: the command-line option that named it, for the messages."""
    target = Path(out).absolute()
    _check_parents(target, out, option)
    for src in inputs:
        if target.resolve() == Path(src).resolve():
            raise InputError(f"{option} {out} is the input {src}; choose another file")
    if target.is_symlink():
        raise InputError(f"{option} {out} is a link; name the file itself")
    if not target.exists():
        return target
    if not overwrite:
        raise UsageError(f"{out} already exists; pass --overwrite to replace it")
    if not target.is_file() or not replaceable(target):
        raise InputError(f"{out} is not a file int4q wrote, so --overwrite will not replace it; "
                         f"remove it yourself or choose another {option}")
    return target


def _check_parents(target: Path, out: Path, option: str) -> None:
    """InputError where a folder on the way to ``target`` exists but is a file."""
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise InputError(f"{option} {out}: {parent} is a file, not a folder; choose another {option}")
            return


def check_free_space(out: Path, needed_bytes: int) -> None:
    """Raise InputError when the file system that will hold ``out`` has less than ``needed_bytes`` free."""
    folder = Path(out).resolve().parent
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if free < needed_bytes:
        raise InputError(f"{folder} has {readable_bytes(free)} free, but writing {Path(out).name} needs about "
                         f"{readable_bytes(needed_bytes)}; free space or choose another --out")


def readable_bytes(n: int) -> str:
    """Bytes as GB, MB or kB, whichever shows them with at least one significant digit."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} bytes"


@contextlib.contextmanager
def atomic_output_dir(
    out: Path,
    overwrite: bool,
    keep_partial: bool = False,
    resume: bool = False,
    inputs: Sequence[Path] = (),
    replaceable: Callable[[Path], bool] = is_int4q_output,
) -> Iterator[Path]:
    """Yield the partial folder; on success it replaces ``out``. On failure it is removed, or
    kept (``keep_partial``) for a later run to resume from. An existing partial folder is reused
    when ``resume`` and cleared otherwise. ``out`` is checked by :func:`check_output_target`
    before anything is created, and again under its lock (another run may have finished it)."""
    target = check_output_target(out, overwrite, inputs, replaceable)
    target.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(target):
        check_output_target(out, overwrite, inputs, replaceable)
        yield from _built_aside(target, keep_partial, resume)


def _built_aside(target: Path, keep_partial: bool, resume: bool) -> Iterator[Path]:
    tmp = partial_dir(target)
    if tmp.exists() and not resume:
        shutil.rmtree(tmp)
    tmp.mkdir(exist_ok=True)
    try:
        yield tmp
    except BaseException:
        if not keep_partial:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        old = target.parent / f".{target.name}.int4q-old-{os.getpid()}"
        target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(target)


def write_new_file(path: Path, text: str) -> None:
    """Create ``path`` with ``text``; never through a link, never over an existing file (both are
    an OSError: FileExistsError, or ELOOP for a link)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
