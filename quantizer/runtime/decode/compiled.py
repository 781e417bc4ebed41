"""Choosing and compiling the decode path.

:func:`.opening.open_decoder` returns a decoder (:class:`FastDecoder`, or :class:`StaticDecoder` for the
models it does not cover) whose single-token steps run one ahead-of-time compiled graph
(``torch.compile(...).aot_compile``; Inductor told to round like eager), or None when the model
needs transformers' own ``generate``.

The compiled step is saved per model, decoder, int4q runtime source, torch and transformers
version, thread count and machine under the int4q cache folder, with the C++ Inductor built for
it, so a later run loads it without tracing or compiling anything. Its guards are not evaluated
per token (that check cost as much as a fifth of a step): the cache key stands for them, and
each step, saved or fresh, must match an eager step before it is used. Where compilation fails,
decoding continues eagerly after one warning, and later runs with the same key do not retry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sys
from pathlib import Path

import torch

from ...errors import UsageError
from ...integrity import matches_digest, record_digest
from ...native.cache import UntrustedCache, machine_identity, trusted_cache_dir
from ...native.constant import prepare_compile
from ..kernels.attention import has_attend_one
from ..kernels.gemv import has_gemv, has_mean_square
from ..nn.int4 import Int4Linear
from ..sources import runtime_source_digest
from .decoder import MIN_CACHE, FastDecoder, check_against_eager, int8_cache_unsupported, unsupported_reason
from .static import StaticDecoder

log = logging.getLogger(__name__)

INDUCTOR_OPTIONS = {
    # Round every intermediate to bf16 where eager does.
    "emulate_precision_casts": True,
    # The graph's kernel calls from generated C++ rather than Python: per-call overhead is what
    # a small model's decode step is made of.
    "cpp_wrapper": True,
}

_warned: set[str] = set()
checked_steps: dict[Path, object] = {}  # checked compiled steps by artifact, shared by decoders of one model


def compiled_dir() -> Path:
    """Where compiled decode steps are saved (Inductor's code for them: beside, in ``inductor``)."""
    return trusted_cache_dir("compiled")


def artifact_path(model: torch.nn.Module, variant: str = "") -> Path:
    """Where this model's compiled decode step is kept: keyed by everything its graph depends on
    (``variant``: the decoder's, e.g. a static cache's length)."""
    import transformers

    key = {"torch": torch.__version__, "transformers": transformers.__version__,
           "threads": torch.get_num_threads(), "config": model.config.to_dict(), "modules": repr(model),
           "machine": machine_identity(), "native_gemv": has_gemv(),
           "native_mean_square": has_mean_square(), "native_attention": has_attend_one(),
           "sources": runtime_source_digest(), "decoder": variant}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return compiled_dir() / f"{digest}.aot"


SECONDS_PER_LAYER = 4.5
"""A compile's expected duration per decoder layer until this machine has measured its own."""


def _rate_file() -> Path:
    return compiled_dir() / "compile_seconds_per_layer.json"


def expected_compile_seconds(layers: int) -> float:
    """What compiling a step of ``layers`` layers took here last time (a default before any)."""
    try:
        rate = float(json.loads(_rate_file().read_text())["seconds_per_layer"])
    except (OSError, ValueError, KeyError, TypeError, UntrustedCache):
        rate = SECONDS_PER_LAYER
    return rate * layers


def record_compile_seconds(seconds: float, layers: int) -> None:
    with contextlib.suppress(OSError, UntrustedCache):
        _rate_file().write_text(json.dumps({"seconds_per_layer": round(seconds / max(layers, 1), 2)}))


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def new_decoder(model: torch.nn.Module, max_len: int, kv_cache: str = "bf16") -> FastDecoder | StaticDecoder | None:
    """The decoder for ``model`` over ``max_len`` tokens: int4q's own where it covers the model,
    else the model's forward over a static cache; None (with one warning) where transformers
    cannot give the model a static cache, which then decodes through ``generate``. ``kv_cache``
    other than bf16 (see :data:`..activations.KV_CACHES`) needs int4q's own decoder: UsageError where
    it cannot hold it."""
    reason = unsupported_reason(model, max_len)
    if kv_cache != "bf16":
        reason = reason or int8_cache_unsupported(model, kv_cache)
        if reason:
            raise UsageError(f"--kv-cache {kv_cache}: {reason}; use --kv-cache bf16")
    if reason is None:
        return FastDecoder(model, max(max_len, MIN_CACHE), kv_cache=kv_cache)
    if getattr(model, "_can_compile_fullgraph", False):
        log.info("decoding through the model's own forward over a static cache: %s", reason)
        return StaticDecoder(model, max_len)
    warn_once(f"decoding through transformers' generate (slower): {reason}, and transformers has no static "
               f"cache for {type(model).__name__}")
    return None


def failed_marker(artifact: Path) -> Path:
    """Where a step that did not compile (or did not match eager) says why: later runs with the
    same key decode eagerly instead of compiling it again."""
    return artifact.with_suffix(".failed")


def use_direct_kernels(decoder) -> None:
    for module in decoder.model.modules():
        if isinstance(module, Int4Linear):  # a static row count: call the kernel, not the opaque op
            module.use_custom_op = False


@torch.inference_mode()
def compile_step(decoder, artifact: Path | None) -> None:
    """Give the decoder its compiled single-token step: the saved one when it is the file int4q
    saved and it matches eager, else a fresh one (then saved, with its sha256); eager decoding
    after one warning when neither works. ``artifact`` None: no cache to use."""
    use_direct_kernels(decoder)
    if artifact in checked_steps:  # checked when this process loaded or compiled it
        decoder.compiled = checked_steps[artifact]
        return
    if artifact and failed_marker(artifact).is_file():
        log.info("decoding eagerly: this model's step did not compile here (%s)", failed_marker(artifact))
        return
    with inductor_cache() if artifact else contextlib.nullcontext():
        if artifact and _load_saved(decoder, artifact):
            return
        log.warning("compiling the decode step for this model and machine (about %.0f s, once)",
                    expected_compile_seconds(decoder.layer_count))
        try:
            decoder.compiled = _aot_compile(decoder)
            check_against_eager(decoder)
        except Exception as e:
            decoder.compiled = None
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            warn_once(f"torch.compile failed ({reason}); decoding eagerly")
            if artifact:
                with contextlib.suppress(OSError):
                    failed_marker(artifact).write_text(reason + "\n")
            return
        if artifact:
            checked_steps[artifact] = decoder.compiled
            _save_step(decoder.compiled, artifact)


def adopt_step(decoder, step, artifact: Path) -> bool:
    """Whether a step read from ``artifact`` matches eager (checked on a probe decoder, so that
    ``decoder`` keeps its cache); then this process's other decoders get it too."""
    probe = decoder.probe()
    probe.compiled = step
    try:
        check_against_eager(probe)
    except Exception as e:
        log.info("the saved step %s is unusable (%s)", artifact, e)
        return False
    checked_steps[artifact] = step
    return True


def _load_saved(decoder, artifact: Path) -> bool:
    """Whether the saved step was loaded: only a file whose sha256 int4q recorded, checked against eager."""
    if not artifact.is_file():
        return False
    if not matches_digest(artifact):  # never unpickle a file int4q did not write as it is
        log.info("recompiling: %s is not the step int4q saved (its sha256 differs or was never recorded)", artifact)
        return False
    try:
        decoder.compiled = load_step(artifact, decoder)
        check_against_eager(decoder)
    except Exception as e:  # a stale or mismatched file only costs a fresh compile
        log.info("recompiling: the saved step %s is unusable (%s)", artifact, e)
        decoder.compiled = None
        return False
    checked_steps[artifact] = decoder.compiled
    return True


def _aot_compile(decoder):
    """Trace and compile the decoder's single-token step once for its model (every position)."""
    prepare_compile()
    decoder.prepare_tracing()  # only tracing reads its marks: a saved step already holds their effect
    compiled = torch.compile(decoder.step_function, fullgraph=True, dynamic=False,
                             options={**INDUCTOR_OPTIONS, **decoder.compile_options})
    example = decoder.step_arguments(torch.zeros(1, 1, dtype=torch.long), 2, for_tracing=True)
    step = compiled.aot_compile((example, {}))
    decoder.reset()
    step.disable_guard_check()
    return step


def load_step(artifact: Path, decoder):
    """The step saved in ``artifact`` for a decoder of ``decoder``'s kind."""
    with open(artifact, "rb") as f:
        step = torch.compiler.load_compiled_function(f, f_globals=vars(sys.modules[decoder.step_function.__module__]))
    step.disable_guard_check()
    return step


def _save_step(step, artifact: Path) -> None:
    try:
        artifact.parent.mkdir(parents=True, exist_ok=True)
        step.save_compiled_function(str(artifact))
        record_digest(artifact)
    except (OSError, RuntimeError) as e:
        log.info("cannot save the compiled step to %s: %s", artifact, e)


def inductor_cache():
    """Inductor's generated code and libraries under the int4q cache while the step is compiled
    or loaded: the default under /tmp does not outlive a reboot, and a saved step whose C++ is
    gone is rebuilt (about 90 s for SmolLM2)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    except ImportError:
        return contextlib.nullcontext()
    return temporary_cache_dir(str(trusted_cache_dir("inductor")))
