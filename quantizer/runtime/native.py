"""The prefill dequantization in C (``int4_dequant.c``): the tinygemm layout to a bf16 weight,
bit for bit what :func:`quantizer.packing.dequantize_int4pack` computes, tens of times faster.

The source is compiled on first use with the machine's C compiler (``$CC``, else ``cc``; the
same one torch.compile needs) for this CPU, kept in the int4q cache and checked against the
torch reference when it is loaded. Where it cannot be built, loaded or trusted,
:func:`dequantize_int4pack` uses the torch reference after one warning (with ``INT4Q_NATIVE=0``,
without one).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shlex
import subprocess
import threading
from pathlib import Path

import torch

from .. import packing
from .cache import cache_dir, machine_identity, temporary_sibling

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int4_dequant.c")
FLAG_SETS = (("-march=native", "-fopenmp"), ("-fopenmp",), ())
"""Tried in order: this CPU's vector units and OpenMP threads, then less."""
VARIANTS = {"native": (), "avx512-exact-tables": ("-DINT4Q_NO_BF16",), "portable": ("-DINT4Q_PORTABLE",)}
"""Builds of the source: the runtime uses "native"; the others exist to test every code path of it
on one machine (no bf16 conversion instructions; no vector path at all)."""

_BUILD_SECONDS = 120
_buffers = threading.local()


class NativeUnavailable(Exception):
    """The kernel cannot be built, loaded or trusted here; the message says why."""


class NativeKernel:
    """The loaded library. ``simd``: the vector path it was built with (0 portable C, 1 AVX-512,
    2 AVX-512 with bf16-rounded tables)."""

    def __init__(self, path: Path):
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise NativeUnavailable(f"cannot load {path}: {e}") from e
        lib.int4q_dequant_int4pack.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        lib.int4q_dequant_int4pack.restype = None
        self._lib = lib
        self.path = path
        self.simd = int(lib.int4q_dequant_simd())

    def dequantize(self, int4pack: torch.Tensor, sz: torch.Tensor, group_size: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """bf16 weight [N, K] from int4pack uint8 [N, K/2] (N a multiple of 64) and sz bf16 [G, N, 2],
        written into ``out`` (contiguous bf16 [N, K]) when given."""
        n, half = int4pack.shape
        if (not supports(int4pack, group_size) or int4pack.dtype != torch.uint8 or sz.dtype != torch.bfloat16
                or sz.shape != (half * 2 // group_size, n, 2)):
            raise ValueError(f"expected uint8 [N, K/2] (N a multiple of 64) and bf16 [K/group, N, 2], got "
                             f"{int4pack.dtype} {tuple(int4pack.shape)} and {sz.dtype} {tuple(sz.shape)}")
        int4pack, sz = int4pack.contiguous(), sz.contiguous()
        if out is None:
            out = torch.empty(n, half * 2, dtype=torch.bfloat16)
        elif out.shape != (n, half * 2) or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise ValueError(f"out must be contiguous bf16 {(n, half * 2)}")
        self._lib.int4q_dequant_int4pack(int4pack.data_ptr(), sz.data_ptr(), out.data_ptr(), n, half * 2,
                                         group_size, torch.get_num_threads())
        return out


def supports(int4pack: torch.Tensor, group_size: int) -> bool:
    """Whether the kernel reads this weight: whole 64-channel blocks, whole groups."""
    n, half = int4pack.shape
    return n % packing.TINYGEMM_N_BLOCK == 0 and n > 0 and (half * 2) % group_size == 0


def library_path(variant: str = "native", cc: str | None = None) -> Path:
    """The cached library for this source, build variant, compiler and CPU."""
    return cached_library("int4_dequant-" + variant, [SOURCE], _compiler(cc), variant)


def cached_library(name: str, sources: list[Path], compiler: str, *extra: str) -> Path:
    """Where a library built from ``sources`` by ``compiler`` for this CPU is kept (``extra``: more
    of what its build depends on)."""
    key = [*(s.read_bytes() for s in sources), _compiler_identity(compiler).encode(), machine_identity().encode(),
           *(e.encode() for e in extra)]
    digest = hashlib.sha256(b"\0".join(key)).hexdigest()[:20]
    return cache_dir() / "native" / f"{name}-{digest}.so"


def build(target: Path, variant: str = "native", cc: str | None = None) -> Path:
    """Compile the source into ``target`` (atomically) with the first flag set that works."""
    cc = _compiler(cc)
    return compile_library(target, [SOURCE], lambda flags, out: [
        *shlex.split(cc), "-O3", "-fPIC", "-shared", *flags, *VARIANTS[variant], str(SOURCE), "-o", out])


def compile_library(target: Path, sources: list[Path], command) -> Path:
    """Run ``command(flags, output)`` for each of :data:`FLAG_SETS` until one compiles; the library
    appears at ``target`` only when complete. NativeUnavailable names the compiler's first error line."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(target)
    errors = []
    for flags in FLAG_SETS:
        argv = command(flags, str(tmp))
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=_BUILD_SECONDS)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NativeUnavailable(f"cannot run the compiler {argv[0]!r} ({e})") from e
        if done.returncode == 0:
            tmp.replace(target)
            return target
        errors.append(next((line for line in done.stderr.splitlines() if "error" in line),
                           (done.stderr.strip().splitlines() or ["no message"])[0]))
    raise NativeUnavailable(f"{argv[0]} could not compile {' and '.join(s.name for s in sources)}: {errors[-1]}")


def load(variant: str = "native", cc: str | None = None) -> NativeKernel:
    """The kernel, built first when it is not cached, after a bit-exact check against torch."""
    path = library_path(variant, cc)
    if not path.is_file():
        build(path, variant, cc)
    kernel = NativeKernel(path)
    self_test(kernel)
    return kernel


def self_test(kernel: NativeKernel) -> None:
    """Raise NativeUnavailable unless the kernel equals the torch reference on a seeded weight."""
    gen = torch.Generator().manual_seed(0)
    n, k = 2 * packing.TINYGEMM_N_BLOCK, 256
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    int4pack = packing.to_int4pack(packing.pack_nibbles(codes))
    for group_size in (32, 128):
        scale = torch.randn(n, k // group_size, generator=gen).to(torch.bfloat16)
        scale[0, 0] = 1e-39  # a denormal: its block and group take the exactly rounded tables
        zero = torch.randn(n, k // group_size, generator=gen).to(torch.bfloat16)
        sz = packing.scales_and_zeros(scale, zero)
        if not torch.equal(kernel.dequantize(int4pack, sz, group_size),
                           packing.dequantize_int4pack(int4pack, sz, group_size)):
            raise NativeUnavailable(f"{kernel.path.name} disagrees with the torch reference on this machine")


@functools.lru_cache(maxsize=None)
def kernel() -> NativeKernel | None:
    """This process's kernel, or None (after one warning) where it is off or unavailable."""
    return load_unless_off(load, "prefill dequantizes through torch", "Set CC to a working C compiler")


def load_unless_off(load_native, fallback: str, fix: str):
    """``load_native()``, or None: silently with ``INT4Q_NATIVE=0``, else after one warning line
    saying what runs instead (``fallback``), why, and ``fix``, where it raises NativeUnavailable."""
    if os.environ.get("INT4Q_NATIVE", "1") == "0":
        return None
    try:
        return load_native()
    except NativeUnavailable as e:
        log.warning("%s (slower): %s. %s, or INT4Q_NATIVE=0 to silence this", fallback, e, fix)
        return None


def dequantize_int4pack(int4pack: torch.Tensor, sz: torch.Tensor, group_size: int,
                        transient: bool = False) -> torch.Tensor:
    """bf16 weight [N, K] from the kernel layout: the native kernel where it applies, else torch's.

    ``transient``: the caller is done with the result before the next transient call, so inside
    :func:`shared_weight_buffer` it may live in that shared buffer.
    """
    native = kernel() if supports(int4pack, group_size) else None
    if native is None:
        return packing.dequantize_int4pack(int4pack, sz, group_size)
    n, half = int4pack.shape
    buffer = _shared_buffer(n * half * 2) if transient else None
    return native.dequantize(int4pack, sz, group_size, None if buffer is None else buffer.view(n, half * 2))


@contextlib.contextmanager
def shared_weight_buffer():
    """Within (on this thread), transient dequantized weights share one buffer, grown to the largest
    layer, instead of fresh pages per layer: a prefill faults in new memory for its largest layer
    once, not for every layer. The buffer is freed on exit."""
    previous = getattr(_buffers, "weight", None)
    _buffers.weight = torch.empty(0, dtype=torch.bfloat16)
    try:
        yield
    finally:
        _buffers.weight = previous


def _shared_buffer(numel: int) -> torch.Tensor | None:
    buffer = getattr(_buffers, "weight", None)
    if buffer is None:
        return None
    if buffer.numel() < numel:
        buffer = _buffers.weight = torch.empty(numel, dtype=torch.bfloat16)
    return buffer[:numel]


def _compiler(cc: str | None) -> str:
    """The C compiler command: ``cc`` when given, else ``$CC``, else ``cc``."""
    return cc or os.environ.get("CC") or "cc"


def _compiler_identity(cc: str) -> str:
    try:
        done = subprocess.run([*shlex.split(cc), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return cc
    return f"{cc} {done.stdout.strip()}"
