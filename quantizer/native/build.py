"""How the native library is built from ``csrc/``: the sources and flags that ``setup.py`` gives
``torch.utils.cpp_extension`` at install time, and the same build run on first use, into the int4q
cache, for a source checkout that was never installed.

The module-level constants import nothing, so ``setup.py`` can read this file before int4q exists.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
C_SOURCES = ("int4_gemv.c", "int4_gemv_rows.c", "int4_w4a8.c", "int4_w4a8_rows.c", "int4_dequant.c", "gram_bf16.c",
             "gptq_columns.c", "refine_codes.c", "grid_scores.c", "grid_search.c", "grid_fits.c",
             "rtn_minmax.c", "decode_attention.c", "decode_attention_int8.c", "causal_attention.c")
CXX_SOURCES = ("int4_ops.cpp", "gemv_rows_ops.cpp", "w4a8_ops.cpp", "refine_ops.cpp", "grid_ops.cpp",
               "attention_ops.cpp", "kv_int8_ops.cpp", "decode_plan.cpp")
COMPILE_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-w")
"""Both builds: each square of mean_square rounded before it is added (no contraction); vector
code comes from the kernels' own target attributes, not from -march, so one build serves every
x86-64 CPU. ATen's parallel_for is OpenMP inside its header, so without -fopenmp every kernel
would run on one thread; the library then uses the libgomp torch has loaded (the same soname)."""
LINK_FLAGS = ("-fopenmp",)
BUILD_SECONDS = 300
LIBRARY_STEM = "_C"
"""The installed library: ``quantizer/native/_C<extension suffix>``."""


class NativeUnavailable(Exception):
    """The library cannot be built, loaded or trusted here; the message says why."""


def sources() -> list[Path]:
    return [CSRC / name for name in (*C_SOURCES, *CXX_SOURCES)]


def tree_digest(root: Path, paths) -> str:
    """sha256 over ``paths`` under ``root``, in sorted order: each one's name relative to ``root``
    and its bytes."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted(paths):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def source_digest() -> str:
    """sha256 of every file in csrc/: compiled into the library as ``source_digest()``, so a
    library built from other sources is never taken for this one."""
    return tree_digest(CSRC, CSRC.iterdir())


def digest_define() -> str:
    """The preprocessor definition that carries :func:`source_digest` into the library."""
    return f'-DINT4Q_SOURCE_DIGEST="{source_digest()}"'


def compiler(cxx: str | None = None) -> str:
    """The C++ compiler command: ``cxx`` when given, else ``$CXX``, else ``c++``."""
    return cxx or os.environ.get("CXX") or "c++"


def library_path(cxx: str | None = None) -> Path:
    """Where the first-use build for these sources, compiler, torch build and CPU is kept."""
    import hashlib

    import torch

    from .cache import machine_identity, trusted_cache_dir

    key = [source_digest(), _compiler_identity(compiler(cxx)), machine_identity(), torch.__version__,
           str(_cxx11_abi()), *COMPILE_FLAGS]
    digest = hashlib.sha256("\0".join(key).encode()).hexdigest()[:20]
    return trusted_cache_dir("native") / f"int4q_native-{digest}.so"


def build(target: Path, cxx: str | None = None) -> Path:
    """Compile the library into ``target``, which appears only when complete. NativeUnavailable
    names the compiler's first error line."""
    from torch.utils import cpp_extension

    from ..integrity import temporary_sibling

    cxx = compiler(cxx)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(target)
    argv = [*shlex.split(cxx), *COMPILE_FLAGS, digest_define(), "-fPIC", "-shared", "-std=c++17",
            f"-D_GLIBCXX_USE_CXX11_ABI={_cxx11_abi()}",
            *(f"-I{p}" for p in cpp_extension.include_paths()),
            "-x", "c", *(str(CSRC / s) for s in C_SOURCES), "-x", "c++", *(str(CSRC / s) for s in CXX_SOURCES),
            *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu", *LINK_FLAGS, "-o", str(tmp)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeUnavailable(f"cannot run the compiler {argv[0]!r} ({e})") from e
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        lines = done.stderr.strip().splitlines() or ["no message"]
        first = next((line for line in lines if "error" in line), lines[0])
        names = ", ".join(p.name for p in sources()[:-1]) + f" and {sources()[-1].name}"
        raise NativeUnavailable(f"{argv[0]} could not compile {names}: {first}")
    tmp.replace(target)
    return target


def _cxx11_abi() -> int:
    import torch

    return int(torch._C._GLIBCXX_USE_CXX11_ABI)


def _compiler_identity(cxx: str) -> str:
    try:
        done = subprocess.run([*shlex.split(cxx), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return cxx
    return f"{cxx} {done.stdout.strip()}"
