"""llama.cpp's own Hugging Face -> GGUF converter (``convert_hf_to_gguf.py``'s ``conversion``
package and its ``gguf-py`` writer), found on this machine and imported once.

int4q does not carry a table of architectures: the converter decides every name, shape, key and
tokenizer field, exactly as ``convert_hf_to_gguf.py`` would for the same folder.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import struct
import sys
from pathlib import Path

from ...errors import InputError, UnsupportedError
from ...io.checkpoint import read_config
from ..sources import open_quantized

ENV = "INT4Q_LLAMA_CPP"
GGUF_MAGIC = b"GGUF"
SETUP_HINT = "run `int4q setup-gguf` once (it fetches llama.cpp's converter with pip), or set INT4Q_LLAMA_CPP to a " \
             "llama.cpp checkout"


def default_location() -> Path:
    """Where ``int4q setup-gguf`` puts the converter: inside the active environment."""
    return Path(sys.prefix) / "share" / "int4q" / "llama.cpp"


def converter_root() -> Path:
    """The llama.cpp folder holding ``conversion/`` and ``gguf-py/``; InputError naming the fix."""
    root = Path(os.environ.get(ENV) or default_location())
    if not (root / "conversion" / "__init__.py").is_file():
        where = f"{ENV}={root}" if os.environ.get(ENV) else str(root)
        raise InputError(f"--format gguf and --imatrix-out need llama.cpp's converter, and {where} has none; "
                         f"{SETUP_HINT}")
    return root


@functools.lru_cache(maxsize=1)
def load() -> tuple[object, object]:
    """(the ``conversion`` package, the ``gguf`` package it was written against)."""
    root = converter_root()
    if str(root / "gguf-py") not in sys.path:
        sys.path.insert(0, str(root / "gguf-py"))  # its own writer before any other gguf
    if str(root) not in sys.path:
        sys.path.append(str(root))  # last: the checkout's other folders never shadow a package
    gguf = importlib.import_module("gguf")
    if Path(gguf.__file__).resolve().parent.parent != (root / "gguf-py").resolve():
        _check_same_writer(gguf, root)
    try:
        conversion = importlib.import_module("conversion")
    except (ImportError, AttributeError) as e:
        raise InputError(f"llama.cpp's converter at {root} does not import with this gguf package ({e}); "
                         f"pip install {root / 'gguf-py'}") from None
    return conversion, gguf


def has_key(path: Path, key: str) -> bool:
    """True for a GGUF file whose metadata holds ``key``; read as far as that key only (a full
    reader parses every token of the vocabulary: seconds)."""
    try:
        with open(path, "rb") as f:
            return key in _metadata_keys(f)
    except (OSError, ValueError, struct.error):
        return False


_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> size
_STRING, _ARRAY = 8, 9


def _metadata_keys(f):
    """The metadata keys of a little-endian GGUF file (version 2 or later), in order, each value
    skipped unread; ValueError where it is not one."""
    if f.read(4) != GGUF_MAGIC:
        raise ValueError("not a GGUF file")
    version, _, count = struct.unpack("<IQQ", f.read(20))
    if not 2 <= version < 1 << 16:
        raise ValueError(f"GGUF version {version}")
    for _ in range(count):
        (length,) = struct.unpack("<Q", f.read(8))
        name = f.read(length).decode("utf-8", "replace")
        yield name
        _skip_value(f, struct.unpack("<I", f.read(4))[0])


def _skip_value(f, kind: int) -> None:
    if kind in _SCALAR_BYTES:
        f.seek(_SCALAR_BYTES[kind], 1)
    elif kind == _STRING:
        f.seek(struct.unpack("<Q", f.read(8))[0], 1)
    elif kind == _ARRAY:
        item, n = struct.unpack("<IQ", f.read(12))
        if item in _SCALAR_BYTES:
            f.seek(n * _SCALAR_BYTES[item], 1)
        else:
            for _ in range(n):
                _skip_value(f, item)
    else:
        raise ValueError(f"GGUF value type {kind}")


def _check_same_writer(gguf, root: Path) -> None:
    """An already imported gguf must be the converter's own (its constants grow with llama.cpp)."""
    mine = (root / "gguf-py" / "gguf" / "constants.py").read_bytes()
    if Path(gguf.__file__).with_name("constants.py").read_bytes() != mine:
        raise InputError(f"the installed gguf package ({Path(gguf.__file__).parent}) is not the one llama.cpp's "
                         f"converter at {root} was written for; pip install {root / 'gguf-py'}")


def converter_class(config: dict):
    """The converter's model class for a config.json; UnsupportedError in one line for an
    architecture it does not know."""
    conversion, _ = load()
    archs = config.get("architectures") or []
    if not archs:
        raise UnsupportedError("config.json names no architectures, so llama.cpp's converter cannot map it")
    try:
        return conversion.get_model_class(archs[0])
    except NotImplementedError:
        raise UnsupportedError(f"llama.cpp's converter does not know {archs[0]}; choose another --format") from None


def converter_for(model_dir: Path, config: dict, out_file: Path | None = None, cls=None):
    """The converter object for a source folder, as convert_hf_to_gguf.py builds it (lazy tensors,
    the float type it guesses from the weights), writing to ``out_file``."""
    _, gguf = load()
    logging.getLogger("hf-to-gguf").setLevel(logging.ERROR)  # its notes are for its own CLI
    cls = cls or converter_class(config)
    quantized = open_quantized(Path(model_dir), read_config(Path(model_dir)))
    if quantized is not None:
        cls = _reading_view(cls, quantized)
    try:
        return cls(Path(model_dir), gguf.LlamaFileType.GUESSED, Path(out_file or Path(model_dir) / "unused.gguf"), eager=False)
    except (KeyError, ValueError, NotImplementedError) as e:
        raise UnsupportedError(f"llama.cpp's converter cannot convert {model_dir}: {e}") from None


def _reading_view(base_cls, view):
    """The converter's class reading a quantized source as int4q's float view of it (the
    converter's own dequantization covers fewer layouts, and int4q's blocks replace those
    weights anyway)."""

    class Int4qFloatView(base_cls):
        model_arch = base_cls.model_arch

        def dequant_model(self):
            for name in view.consumed:
                self.model_tensors.pop(name, None)
            for name in view.infos:
                if name not in view.raw.infos and name not in self.model_tensors:
                    self.model_tensors[name] = lambda name=name: view.get(name)

    Int4qFloatView.__name__ = base_cls.__name__
    return Int4qFloatView


def preflight(model_dir: Path, config: dict) -> bool:
    """Check, before anything is written, that the converter takes this folder's architecture and
    tokenizer (UnsupportedError in one line otherwise); return whether it writes an
    ``lm_head.weight`` of its own (some architectures, like Gemma's, read the head from the table)."""
    import torch

    model = converter_for(model_dir, config)
    try:
        model.set_vocab()
    except (NotImplementedError, FileNotFoundError, ValueError, KeyError, AssertionError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsupportedError(f"llama.cpp's converter cannot write the tokenizer of {model_dir}: {first}") from None
    try:
        model.set_gguf_parameters()
    except KeyError as e:
        raise UnsupportedError(f"llama.cpp's converter needs {e} in {model_dir}/config.json for this architecture; "
                               "add it (the original model's config.json has it)") from None
    return bool(list(model.modify_tensors(torch.zeros(2, 2), "lm_head.weight", None)))
