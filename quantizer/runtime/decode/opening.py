"""Opening a decoder: the native step where it covers the model, else the compiled step, read or
compiled now or, for a checkpoint folder, in a background process while decoding starts eagerly
(:mod:`.background`)."""

from __future__ import annotations

from pathlib import Path

import torch

from ...native.cache import UntrustedCache
from . import compiled as steps
from .background import PendingStep, compiling_elsewhere, saved_step_ready, start_worker
from .decoder import FastDecoder
from .native_step import native_step
from .static import StaticDecoder


def open_decoder(model: torch.nn.Module, max_len: int, compile: bool = True,
                 source: Path | None = None, kv_cache: str = "bf16") -> FastDecoder | StaticDecoder | None:
    """A ready decoder (see :func:`.compiled.new_decoder`) for sequences of up to ``max_len``
    tokens over a ``kv_cache`` KV cache, or None. Its single-token steps are native where
    :mod:`.native_step` covers the model (nothing to compile); else, with ``compile`` and a bf16
    cache, the compiled step: with the checkpoint folder ``source``, taken between tokens once read
    or compiled in the background, so decoding starts at once; without, read or compiled now; else
    eager."""
    decoder = steps.new_decoder(model, max_len, kv_cache)
    if decoder is None:
        return None
    decoder.native = native_step(decoder)
    if decoder.native is not None or not compile:
        return decoder
    if kv_cache != "bf16":
        steps.warn_once(f"decoding eagerly over the {kv_cache} KV cache (slower): this model or CPU has no native "
                        "decode step (see the log)")
        return decoder
    try:
        artifact = steps.artifact_path(model, decoder.variant)
    except UntrustedCache:  # trusted_cache_dir has said so, once
        artifact = None
    if source is None or artifact is None or artifact in steps.checked_steps:
        steps.compile_step(decoder, artifact)
    else:
        _step_in_background(decoder, artifact, source)
    return decoder


def _step_in_background(decoder, artifact: Path, source: Path) -> None:
    steps.use_direct_kernels(decoder)
    if steps.failed_marker(artifact).is_file():
        steps.log.info("decoding eagerly: this model's step did not compile here (%s)", steps.failed_marker(artifact))
        return
    worker, elsewhere = None, False
    if not saved_step_ready(artifact):
        elsewhere = compiling_elsewhere(artifact)
        if not elsewhere:
            worker = start_worker(source, artifact, decoder.max_len)
            if worker is None:
                steps.compile_step(decoder, artifact)
                return
        who = "another int4q run compiles it" if elsewhere else "the decode step compiles"
        steps.warn_once(f"decoding eagerly while {who} in the background (about "
                        f"{steps.expected_compile_seconds(decoder.layer_count):.0f} s, once for this model and "
                        "machine; `int4q compile` does it ahead); this run switches to it when it is ready")
    decoder.pending = PendingStep(decoder, artifact, source, worker, elsewhere)
