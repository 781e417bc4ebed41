"""Choosing and compiling the decode path.

:func:`open_decoder` returns a :class:`FastDecoder` whose single-token steps run one
ahead-of-time compiled graph (``torch.compile(...).aot_compile``; Inductor told to round like
eager, so greedy tokens stay identical), or None when the model needs transformers' own
``generate``.

The compiled step is saved per model, int4q runtime source, torch and transformers version,
thread count and machine under the int4q cache folder, with the C++ Inductor built for it, so
a later run loads it without tracing or compiling anything. Its guards are not evaluated per
token (that check cost as much as a fifth of a step): the cache key stands for them, and each
step, saved or fresh, must match an eager step before it is used. Where compilation fails,
decoding continues eagerly after one warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from pathlib import Path

import torch

from ..cache import (
    UntrustedCache,
    machine_identity,
    matches_digest,
    record_digest,
    runtime_source_digest,
    trusted_cache_dir,
)
from ..native.gemv import has_gemv
from ..nn.int4 import Int4Linear
from . import decoder as decoder_module
from .decoder import FastDecoder, decode_step, llama_rms_norm, unsupported_reason

log = logging.getLogger(__name__)

INDUCTOR_OPTIONS = {
    # Round every intermediate to bf16 where eager does.
    "emulate_precision_casts": True,
    # The graph's kernel calls from generated C++ rather than Python: per-call overhead is what
    # a small model's decode step is made of.
    "cpp_wrapper": True,
}
MIN_CACHE = 4
"""Positions every decoder's cache has at least: the eager check runs a 3-token prompt and a step."""

_warned: set[str] = set()
_steps: dict[Path, object] = {}  # checked compiled steps by artifact, shared by decoders of one model


class StepMismatch(Exception):
    """A compiled step's logits differ from the eager step's."""


def compiled_dir() -> Path:
    """Where compiled decode steps are saved (Inductor's code for them: beside, in ``inductor``)."""
    return trusted_cache_dir() / "compiled"


def artifact_path(model: torch.nn.Module) -> Path:
    """Where this model's compiled decode step is kept: keyed by everything its graph depends on."""
    import transformers

    key = {"torch": torch.__version__, "transformers": transformers.__version__,
           "threads": torch.get_num_threads(), "config": model.config.to_dict(), "modules": repr(model),
           "machine": machine_identity(), "native_gemv": has_gemv(),
           "sources": runtime_source_digest()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return compiled_dir() / f"{digest}.aot"


def mark_exact_norms(decoder: FastDecoder) -> int:
    """Mark the norms whose forward is LlamaRMSNorm's (checked on a seeded input) to take their
    variance from the opaque ``int4q_native.mean_square`` when compiled (see :func:`.decoder.rms_norm`);
    only where int4q's operators are loaded. Returns how many were marked."""
    if not has_gemv():
        return 0
    marked, gen = 0, torch.Generator().manual_seed(0)
    for module in (*decoder.layers.modules(), decoder.norm):
        weight = getattr(module, "weight", None)
        if weight is None or not hasattr(module, "variance_epsilon") or weight.dim() != 1:
            continue
        h = (torch.randn(1, 3, weight.numel(), generator=gen) * 3).to(torch.bfloat16)
        with torch.inference_mode():
            same = torch.equal(module(h), llama_rms_norm(module, h, lambda x: x.pow(2).mean(-1, keepdim=True)))
        module.exact_mean_square = same
        marked += same
    return marked


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def open_decoder(model: torch.nn.Module, max_len: int, compile: bool = True,
                 source: Path | None = None) -> FastDecoder | None:
    """A ready FastDecoder for sequences of up to ``max_len`` tokens, or None (with one warning)
    when ``model`` must use transformers' generate. With ``compile``, the compiled step: with the
    checkpoint folder ``source``, taken between tokens once read or compiled in the background
    (see :mod:`.background`), so decoding starts at once; without, read or compiled now."""
    reason = unsupported_reason(model, max_len)
    if reason:
        _warn_once(f"decoding through transformers' generate (slower): {reason}")
        return None
    decoder = FastDecoder(model, max(max_len, MIN_CACHE))
    if not compile:
        return decoder
    try:
        artifact = artifact_path(model)
    except UntrustedCache as e:
        _warn_once(f"{e}; compiling the decode step without loading or saving it there")
        artifact = None
    if source is None or artifact is None or artifact in _steps:
        compile_step(decoder, artifact)
    else:
        _step_in_background(decoder, artifact, source)
    return decoder


def _step_in_background(decoder: FastDecoder, artifact: Path, source: Path) -> None:
    from .background import PendingStep, expected_compile_seconds, saved_step_ready, start_worker

    _use_direct_kernels(decoder)
    worker = None
    if not saved_step_ready(artifact):
        worker = start_worker(source, artifact)
        if worker is None:
            compile_step(decoder, artifact)
            return
        _warn_once(f"decoding eagerly while the decode step compiles in the background (about "
                   f"{expected_compile_seconds(len(decoder.layers)):.0f} s, once for this model and machine; "
                   "`int4q compile` does it ahead); this run switches to it when it is ready")
    decoder.pending = PendingStep(decoder.model, artifact, source, worker)


def _use_direct_kernels(decoder: FastDecoder) -> None:
    for module in (*decoder.layers.modules(), decoder.head):
        if isinstance(module, Int4Linear):  # a static row count: call the kernel, not the opaque op
            module.use_custom_op = False


@torch.inference_mode()
def compile_step(decoder: FastDecoder, artifact: Path | None) -> None:
    """Give the decoder its compiled single-token step: the saved one when it is the file int4q
    saved and it matches eager, else a fresh one (then saved, with its sha256); eager decoding
    after one warning when neither works. ``artifact`` None: no cache to use."""
    _use_direct_kernels(decoder)
    if artifact in _steps:  # checked when this process loaded or compiled it
        decoder.compiled = _steps[artifact]
        return
    with inductor_cache() if artifact else contextlib.nullcontext():
        if artifact and _load_saved(decoder, artifact):
            return
        from .background import expected_compile_seconds

        log.warning("compiling the decode step for this model and machine (about %.0f s, once)",
                    expected_compile_seconds(len(decoder.layers)))
        try:
            decoder.compiled = _aot_compile(decoder)
            _check_against_eager(decoder)
        except Exception as e:
            decoder.compiled = None
            _warn_once(f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                       "decoding eagerly")
            return
        if artifact:
            _steps[artifact] = decoder.compiled
            _save_step(decoder.compiled, artifact)


def adopt_step(model: torch.nn.Module, step, artifact: Path) -> bool:
    """Whether a step read from ``artifact`` matches eager (checked on a decoder of its own, so a
    running one keeps its cache); then this process's other decoders get it too."""
    probe = FastDecoder(model, MIN_CACHE)
    probe.compiled = step
    try:
        _check_against_eager(probe)
    except Exception as e:
        log.info("the saved step %s is unusable (%s)", artifact, e)
        return False
    _steps[artifact] = step
    return True


def _load_saved(decoder: FastDecoder, artifact: Path) -> bool:
    """Whether the saved step was loaded: only a file whose sha256 int4q recorded, checked against eager."""
    if not artifact.is_file():
        return False
    if not matches_digest(artifact):  # never unpickle a file int4q did not write as it is
        log.info("recompiling: %s is not the step int4q saved (its sha256 differs or was never recorded)", artifact)
        return False
    try:
        decoder.compiled = load_step(artifact)
        _check_against_eager(decoder)
    except Exception as e:  # a stale or mismatched file only costs a fresh compile
        log.info("recompiling: the saved step %s is unusable (%s)", artifact, e)
        decoder.compiled = None
        return False
    _steps[artifact] = decoder.compiled
    return True


def _aot_compile(decoder: FastDecoder):
    """Trace and compile :func:`decode_step` once for this decoder's model (every position)."""
    mark_exact_norms(decoder)  # only tracing reads the marks: a saved step already holds their effect
    decoder.reset()
    decoder.forward(torch.zeros(1, 2, dtype=torch.long))  # a cache of length > 1: the length stays dynamic
    compiled = torch.compile(decode_step, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS)
    example = decoder.step_arguments(torch.zeros(1, 1, dtype=torch.long), 2, for_tracing=True)
    step = compiled.aot_compile((example, {}))
    decoder.reset()
    step.disable_guard_check()
    return step


def load_step(artifact: Path):
    with open(artifact, "rb") as f:
        step = torch.compiler.load_compiled_function(f, f_globals=vars(decoder_module))
    step.disable_guard_check()
    return step


def _save_step(step, artifact: Path) -> None:
    try:
        artifact.parent.mkdir(parents=True, exist_ok=True)
        step.save_compiled_function(str(artifact))
        record_digest(artifact)
    except (OSError, RuntimeError) as e:
        log.info("cannot save the compiled step to %s: %s", artifact, e)


def _check_against_eager(decoder: FastDecoder) -> None:
    """Raise StepMismatch unless one compiled step picks the eager step's token with logits
    within bf16 rounding of it. Leaves the decoder reset."""
    prompt, token = torch.tensor([[1, 2, 3]]), torch.tensor([[4]])
    compiled = decoder.compiled
    try:
        results = []
        for step in (compiled, None):
            decoder.compiled = step
            decoder.reset()
            decoder.forward(prompt)
            results.append(decoder.forward(token).float())
    finally:
        decoder.compiled = compiled
        decoder.reset()
    fast, eager = results
    worst = (fast - eager).abs().max().item()
    if not torch.equal(fast.argmax(-1), eager.argmax(-1)) or worst > 0.02 * eager.abs().max().item() + 1e-3:
        raise StepMismatch(f"the compiled step's logits differ from eager by up to {worst:.3g}")


def inductor_cache():
    """Inductor's generated code and libraries under the int4q cache while the step is compiled
    or loaded: the default under /tmp does not outlive a reboot, and a saved step whose C++ is
    gone is rebuilt (about 90 s for SmolLM2)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    except ImportError:
        return contextlib.nullcontext()
    return temporary_cache_dir(str(trusted_cache_dir() / "inductor"))
