"""Builds int4q's native library (quantizer/native/csrc) with torch.utils.cpp_extension
when int4q is installed; the rest of the package metadata is in pyproject.toml.

Install without build isolation (``pip install --no-build-isolation``), so the library is built
against the torch already installed, the one it will run with. Without torch in the build
environment, or with ``INT4Q_BUILD_NATIVE=0``, the library is left out and the runtime builds it on
first use.
"""

import importlib.util
import os
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).parent
BUILD = HERE / "quantizer" / "native" / "build.py"


def native_extension():
    spec = importlib.util.spec_from_file_location("int4q_native_build", BUILD)
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)  # its constants import nothing
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    sources = [str(p.relative_to(HERE)) for p in build.sources()]
    flags = [*build.COMPILE_FLAGS, build.digest_define()]
    extension = CppExtension(f"quantizer.native.{build.LIBRARY_STEM}", sources,
                             extra_compile_args={"cxx": flags}, extra_link_args=list(build.LINK_FLAGS),
                             py_limited_api=False)
    return [extension], {"build_ext": BuildExtension.with_options(no_python_abi_suffix=False)}


if os.environ.get("INT4Q_BUILD_NATIVE", "1") == "0" or importlib.util.find_spec("torch") is None:
    setup()
else:
    ext_modules, cmdclass = native_extension()
    setup(ext_modules=ext_modules, cmdclass=cmdclass)
