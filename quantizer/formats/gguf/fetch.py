"""Fetching llama.cpp's converter (``conversion/`` and ``gguf-py/``) once, from the source
distribution of llama-cpp-python on the package index pip uses, into the folder
:func:`.converter.default_location` names: what ``int4q setup-gguf`` does."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from ...errors import InputError

LLAMA_CPP_PYTHON = "0.3.36"
"""The llama-cpp-python release whose vendored llama.cpp int4q is tested against."""
VERSION_FILE = ".version"


def installed_version(dest: Path) -> str | None:
    """The llama-cpp-python release whose converter ``dest`` holds, or None."""
    try:
        return (dest / VERSION_FILE).read_text().strip() or None
    except OSError:
        return None


def fetch_converter(dest: Path, version: str = LLAMA_CPP_PYTHON) -> bool:
    """Put llama-cpp-python ``version``'s ``vendor/llama.cpp`` (its models folder left out) at
    ``dest``, unless it is there already; True when it was fetched. ``dest`` appears complete or
    not at all. InputError names the fix where pip cannot download it."""
    if installed_version(dest) == version and (dest / "conversion" / "__init__.py").is_file():
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".int4q-fetch-") as tmp:
        archive = _download(Path(tmp), version)
        staged = Path(tmp) / "llama.cpp"
        _extract_vendor(archive, f"llama_cpp_python-{version}/vendor/llama.cpp/", staged)
        (staged / VERSION_FILE).write_text(version + "\n")
        if dest.is_symlink() or dest.is_file() or (dest.exists() and installed_version(dest) is None
                                                   and any(dest.iterdir())):
            raise InputError(f"{dest} holds something int4q did not fetch; remove it yourself, or name another "
                             "folder (--dest) and set INT4Q_LLAMA_CPP to it")
        if dest.exists():
            shutil.rmtree(dest)  # an older converter int4q fetched here itself
        staged.rename(dest)
    return True


def _download(folder: Path, version: str) -> Path:
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
            "--dest", str(folder), f"llama-cpp-python=={version}"]
    done = subprocess.run(argv, capture_output=True, text=True)
    archive = folder / f"llama_cpp_python-{version}.tar.gz"
    if done.returncode != 0 or not archive.is_file():
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise InputError(f"pip could not download llama-cpp-python {version}'s source ({last}); check the package "
                         "index is reachable, or set INT4Q_LLAMA_CPP to a llama.cpp checkout")
    return archive


def _extract_vendor(archive: Path, prefix: str, target: Path) -> None:
    """The members under ``prefix`` (but its ``models/``), as plain files and folders under
    ``target``; links and devices are skipped."""
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:
            if not member.name.startswith(prefix) or not (member.isfile() or member.isdir()):
                continue
            relative = member.name[len(prefix):]
            if not relative or relative.split("/")[0] == "models" or ".." in relative.split("/"):
                continue
            path = target / relative
            if member.isdir():
                path.mkdir(parents=True, exist_ok=True)
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as source, open(path, "wb") as out:
                shutil.copyfileobj(source, out)
            path.chmod(0o755 if member.mode & 0o111 else 0o644)
