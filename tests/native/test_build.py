"""The native library: built at install from csrc/, loaded once, refused when built from other
sources, and built on first use (into the int4q cache) where no installed one exists."""

import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO, failing_compiler

from quantizer.native import build, library
from quantizer.runtime.kernels import gemv


@pytest.fixture
def fresh_library(monkeypatch):
    """library.ops() decides again; the process-wide library stays loaded."""
    monkeypatch.setattr(library, "_loaded", [])
    monkeypatch.setattr(library, "_failed", [])


def test_the_installed_library_is_the_one_loaded_and_it_was_built_from_these_sources():
    ops = library.ops()
    assert library.installed_path() is not None, "scripts/setup.sh builds the library at install"
    assert library.loaded_path() == library.installed_path()
    assert ops.source_digest() == build.source_digest()


def test_the_kernels_run_on_torchs_threads():
    ops = library.ops()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert ops.parallel_threads(64) == 2
        torch.set_num_threads(1)
        assert ops.parallel_threads(64) == 1
    finally:
        torch.set_num_threads(before)


def test_a_library_built_from_other_sources_is_refused(fresh_library, monkeypatch):
    monkeypatch.setattr(library, "source_digest", lambda: "0" * 64)
    with pytest.raises(build.NativeUnavailable, match="built from other sources than this int4q's; reinstall"):
        library.ops()
    with pytest.raises(build.NativeUnavailable):  # decided once: no second load
        library.ops()


def test_a_failing_compiler_is_named_with_its_first_error_line(tmp_path):
    cxx = failing_compiler(tmp_path, "c++", "warning: noise", "int4_ops.cpp:1: error: no torch headers")
    *first, last = (*build.C_SOURCES, *build.CXX_SOURCES)
    names = f"{', '.join(first)} and {last}"
    with pytest.raises(build.NativeUnavailable, match=f"could not compile {re.escape(names)}: .*error: no torch headers"):
        build.build(tmp_path / "lib.so", cxx=str(cxx))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c++"]  # nothing half-written


def test_a_missing_compiler_is_named(tmp_path):
    with pytest.raises(build.NativeUnavailable, match="cannot run the compiler '/nonexistent/cc'"):
        build.build(tmp_path / "lib.so", cxx="/nonexistent/cc")
    assert list(tmp_path.iterdir()) == []


FIRST_USE = """
import sys
from quantizer.native import build, library
library.installed_path = lambda: None  # a source checkout that was never installed
if sys.argv[1] == "again":
    build.build = lambda *a, **k: sys.exit("compiled again")
if sys.argv[1] == "truncated":  # the SIGBUS case: the cached file cut short
    path = build.library_path()
    path.write_bytes(path.read_bytes()[:4096])
from quantizer.runtime.kernels import dequant, gemv
simd, has_gemv = dequant.kernel().simd, gemv.has_gemv()
print(library.loaded_path(), simd, has_gemv)
"""


def test_a_checkout_without_the_installed_library_builds_it_once_on_first_use(tmp_path):
    """...and a cached build that is not byte for byte the one it recorded is built again, never loaded."""
    env = {**os.environ, "INT4Q_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    runs = [subprocess.run([sys.executable, "-c", FIRST_USE, which], capture_output=True, text=True, env=env,
                           timeout=600) for which in ("first", "again", "truncated", "again")]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-500:] for r in runs]
    first, again, rebuilt, after = (r.stdout.split() for r in runs)
    assert first == again == rebuilt == after
    assert first[0].startswith(str(tmp_path / "cache" / "native"))
    library.ops()
    assert first[1:] == [str(torch.ops.int4q_native.dequant_level()), str(gemv.has_gemv())]  # as installed
