"""Choosing and compiling the decode path.

:func:`open_decoder` returns a :class:`FastDecoder` whose single-token steps are compiled with
``torch.compile`` (Inductor told to round like eager, so greedy tokens stay identical), or None
when the model needs transformers' own ``generate``. Compiled artifacts are saved per model,
torch version and thread count under the int4q cache folder, so only the first run compiles.
Where compilation fails, decoding continues eagerly after one warning.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path

import torch

from .cache import cache_dir, write_atomically
from .decoder import FastDecoder, decode_step, unsupported_reason
from .modules import Int4Linear

log = logging.getLogger(__name__)

INDUCTOR_OPTIONS = {
    # Round every intermediate to bf16 where eager does.
    "emulate_precision_casts": True,
    # The graph's kernel calls from generated C++ rather than Python: per-call overhead is what
    # a small model's decode step is made of.
    "cpp_wrapper": True,
}
_warned: set[str] = set()


def artifact_path(model: torch.nn.Module) -> Path:
    """Where this model's compiled decode step is kept: keyed by everything the code depends on."""
    import transformers

    key = {"torch": torch.__version__, "transformers": transformers.__version__,
           "threads": torch.get_num_threads(), "config": model.config.to_dict()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return cache_dir() / "compiled" / f"{digest}.bin"


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def open_decoder(model: torch.nn.Module, max_len: int, compile: bool = True) -> FastDecoder | None:
    """A ready FastDecoder for sequences of up to ``max_len`` tokens, or None (with one warning)
    when ``model`` must use transformers' generate. With ``compile`` the step is compiled now."""
    reason = unsupported_reason(model, max_len)
    if reason:
        _warn_once(f"decoding through transformers' generate (slower): {reason}")
        return None
    decoder = FastDecoder(model, max_len)
    if compile:
        _compile(decoder, artifact_path(model))
    return decoder


def _compile(decoder: FastDecoder, artifacts: Path) -> None:
    """Compile the decoder's single-token step, from saved artifacts when they exist."""
    loaded = False
    if artifacts.is_file():
        try:
            torch.compiler.load_cache_artifacts(artifacts.read_bytes())
            loaded = True
        except Exception as e:  # a stale or truncated file only costs a fresh compile
            log.info("ignoring compiled artifacts %s: %s", artifacts, e)
    for module in (*decoder.layers.modules(), decoder.head):
        if isinstance(module, Int4Linear):  # a static row count: call the kernel, not the opaque op
            module.use_custom_op = False
    decoder.compiled = _compiled_step()
    try:
        decoder.forward(torch.zeros(1, 2, dtype=torch.long))  # the compiled step runs from position 1 on
        decoder.forward(torch.zeros(1, 1, dtype=torch.long))
    except Exception as e:
        decoder.compiled = None
        _warn_once(f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                   "decoding eagerly")
        return
    finally:
        decoder.reset()
    if not loaded:
        _save_artifacts(artifacts)


@functools.lru_cache(maxsize=None)
def _compiled_step():
    """One compiled decode step per process, shared by every decoder (its graphs are reused
    wherever the guards hold)."""
    return torch.compile(decode_step, dynamic=False, options=INDUCTOR_OPTIONS)


def _save_artifacts(path: Path) -> None:
    saved = torch.compiler.save_cache_artifacts()
    if not saved:
        return
    try:
        write_atomically(path, saved[0])
    except OSError as e:
        log.info("cannot save compiled artifacts to %s: %s", path, e)
