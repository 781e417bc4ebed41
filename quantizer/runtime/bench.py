"""llama-bench style measurements of a loaded model: prefill tok/s (pp), decode tok/s (tg) and
resident memory. Pure measurement: returns numbers, prints nothing."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from ..memory import proc_status_mb, release_free_memory
from .decode.generation import greedy_token

BF16_KV_ARM = "bf16kv"
"""The arm that decodes the int4 model over a bf16 KV cache beside an int8 one (``--compare-kv``)."""


@dataclass
class ArmResult:
    """One model's measurements; tok/s lists hold one entry per rep."""

    name: str
    load_rss_anon_mb: float = 0.0
    pp: list[float] = field(default_factory=list)
    tg: list[float] = field(default_factory=list)
    path: str = ""
    open_seconds: float = 0.0

    def summary(self) -> dict:
        return {
            "name": self.name,
            "decode_path": self.path,
            "open_seconds": round(self.open_seconds, 2),
            "rss_anon_after_load_mb": round(self.load_rss_anon_mb, 1),
            "pp_best": round(max(self.pp), 2) if self.pp else None,
            "pp_median": round(statistics.median(self.pp), 2) if self.pp else None,
            "tg_best": round(max(self.tg), 2) if self.tg else None,
            "tg_median": round(statistics.median(self.tg), 2) if self.tg else None,
            "pp_reps": [round(v, 2) for v in self.pp],
            "tg_reps": [round(v, 2) for v in self.tg],
        }


def _token_ids(model, n: int, seed: int = 0) -> torch.Tensor:
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (1, n), generator=gen)


@torch.inference_mode()
def prefill_tokens_per_s(model, n_tokens: int, decoder=None) -> float:
    """One forward over n_tokens into a fresh KV cache, logits for the last position only;
    through ``decoder`` (a FastDecoder) when given, else transformers' forward."""
    from transformers import DynamicCache

    ids = _token_ids(model, n_tokens)
    start = time.perf_counter()
    if decoder is not None:
        decoder.reset()
        decoder.forward(ids)
    else:
        model(input_ids=ids, cache=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
    return n_tokens / (time.perf_counter() - start)


@torch.inference_mode()
def decode_tokens_per_s(model, n_tokens: int, decoder=None, depth: int = 0) -> float:
    """Greedy single-token steps after a prompt of ``depth`` tokens (1 at least), as llama-bench's
    ``-d``: the steps attend over that much context; the prompt's forward is not timed."""
    from transformers import DynamicCache

    ids = _token_ids(model, max(depth, 1))
    if decoder is not None:
        decoder.reset()
        step = decoder.forward
    else:
        cache = DynamicCache(config=model.config)
        step = lambda t: model(input_ids=t, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]  # noqa: E731
    logits = step(ids)
    start = time.perf_counter()
    for _ in range(n_tokens):
        logits = step(greedy_token(logits))
    return n_tokens / (time.perf_counter() - start)


def load_measured(load, path, name: str) -> tuple[torch.nn.Module, ArmResult]:
    """Load with ``load(path)`` and record the growth of anonymous resident memory it caused."""
    release_free_memory()
    before = proc_status_mb("RssAnon")
    model = load(path)
    release_free_memory()
    return model, ArmResult(name, proc_status_mb("RssAnon") - before)


def run_bench(arms: dict[str, torch.nn.Module], results: dict[str, ArmResult], prompt_tokens: int,
              gen_tokens: int, reps: int, progress=None, compile: bool = True, depth: int = 0,
              kv_caches: dict[str, str] | None = None) -> None:
    """Open each arm's decoder (the path ``int4q generate`` takes, compiled when ``compile``, over
    the KV cache ``kv_caches`` names for it, bf16 where it names none), warm it up, then run
    ``reps`` rounds with the arms interleaved within each round; decode after ``depth`` tokens of
    context."""
    from .decode.opening import open_decoder

    decoders = {}
    for name, model in arms.items():
        started = time.perf_counter()
        decoders[name] = open_decoder(model, max(prompt_tokens, depth, 1) + gen_tokens + 1, compile=compile,
                                      kv_cache=(kv_caches or {}).get(name, "bf16"))
        results[name].open_seconds = time.perf_counter() - started
        results[name].path = describe_path(decoders[name])
        prefill_tokens_per_s(model, min(prompt_tokens, 32) or 1, decoders[name])
        decode_tokens_per_s(model, 4, decoders[name])
    for rep in range(reps):
        for name, model in arms.items():
            if prompt_tokens:
                results[name].pp.append(prefill_tokens_per_s(model, prompt_tokens, decoders[name]))
            if gen_tokens:
                results[name].tg.append(decode_tokens_per_s(model, gen_tokens, decoders[name], depth))
            if progress:
                progress(rep, name, results[name])


def describe_path(decoder) -> str:
    """Which decode path an arm runs: native, compiled, eager (fast decoder) or transformers."""
    if decoder is None:
        return "transformers"
    return "native" if decoder.native else "compiled" if decoder.compiled else "eager"


def bench_models(model_dir, baseline, prompt_tokens: int, gen_tokens: int, reps: int, compile: bool = True,
                 progress=None, compare_exact: bool = False, depth: int = 0, kv_cache: str = "bf16",
                 compare_kv: bool = False) -> dict:
    """Load the int4 model (with the process's activation setting; also with exact activations
    when ``compare_exact``, and the bf16 ``baseline``), measure them interleaved (decode after
    ``depth`` tokens of context), and return the report: machine, lengths, each arm's summary,
    ratios and the process's peak RSS. The int4 arm decodes over a ``kv_cache`` KV cache; with
    ``compare_kv``, an arm ``bf16kv`` (the same model over a bf16 cache) runs beside it."""
    import functools
    import platform

    from .activations import EXACT, current
    from .decode.generation import check_positions
    from .loader import import_architecture, load_model

    import_architecture(model_dir)
    arms, results = {}, {}
    plan = [("int4", model_dir, None)] + ([("exact", model_dir, EXACT)] if compare_exact else [])
    for name, path, activations in plan + ([("baseline", baseline, None)] if baseline else []):
        arms[name], results[name] = load_measured(functools.partial(load_model, activations=activations), path, name)
        longest = f"--depth {depth}" if depth > prompt_tokens else f"--prompt-tokens {prompt_tokens}"
        check_positions(arms[name].config, max(prompt_tokens, depth) + gen_tokens,
                        f"{longest} and --gen-tokens {gen_tokens}")
    if compare_kv:
        arms[BF16_KV_ARM], results[BF16_KV_ARM] = arms["int4"], ArmResult(BF16_KV_ARM, results["int4"].load_rss_anon_mb)
    run_bench(arms, results, prompt_tokens, gen_tokens, reps, progress=progress, compile=compile, depth=depth,
              kv_caches={"int4": kv_cache})
    report = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens, "depth": depth, "reps": reps, "activations": current().encode(),
        "arms": {name: r.summary() for name, r in results.items()},
        "peak_rss_mb": round(proc_status_mb("VmHWM"), 1),
    }
    report["kv_cache"] = kv_cache
    for other in ("baseline", "exact", BF16_KV_ARM):
        if other in report["arms"]:
            report[f"ratios_int4_over_{other}"] = _ratios(report["arms"]["int4"], report["arms"][other])
    return report


def _ratios(a: dict, b: dict) -> dict:
    """Arm ``a``'s medians and resident memory over arm ``b``'s (None for a phase not measured)."""
    ratios = {
        "tg_median": a["tg_median"] / b["tg_median"] if b["tg_median"] else None,
        "pp_median": a["pp_median"] / b["pp_median"] if b["pp_median"] else None,
        "rss_anon_after_load": a["rss_anon_after_load_mb"] / b["rss_anon_after_load_mb"],
    }
    return {k: round(v, 3) if v is not None else None for k, v in ratios.items()}
