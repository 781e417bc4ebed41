"""llama-bench style measurements of a loaded model: prefill tok/s (pp), decode tok/s (tg) and
resident memory. Pure measurement: returns numbers, prints nothing."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from ..checkpoint import proc_status_mb, release_free_memory


@dataclass
class ArmResult:
    """One model's measurements; tok/s lists hold one entry per rep."""

    name: str
    load_rss_anon_mb: float = 0.0
    pp: list[float] = field(default_factory=list)
    tg: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "name": self.name,
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
def prefill_tokens_per_s(model, n_tokens: int) -> float:
    """One forward over n_tokens (filling a fresh KV cache, logits for the last position only)."""
    from transformers import DynamicCache

    ids = _token_ids(model, n_tokens)
    start = time.perf_counter()
    model(input_ids=ids, cache=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
    return n_tokens / (time.perf_counter() - start)


@torch.inference_mode()
def decode_tokens_per_s(model, n_tokens: int) -> float:
    """Greedy single-token steps after a 1-token prompt; the prompt's forward is not timed."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = _token_ids(model, 1)
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    start = time.perf_counter()
    for _ in range(n_tokens):
        ids = out.logits[:, -1:].argmax(-1)
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return n_tokens / (time.perf_counter() - start)


def load_measured(load, path, name: str) -> tuple[torch.nn.Module, ArmResult]:
    """Load with ``load(path)`` and record the growth of anonymous resident memory it caused."""
    release_free_memory()
    before = proc_status_mb("RssAnon")
    model = load(path)
    release_free_memory()
    return model, ArmResult(name, proc_status_mb("RssAnon") - before)


def run_bench(arms: dict[str, torch.nn.Module], results: dict[str, ArmResult], prompt_tokens: int,
              gen_tokens: int, reps: int, progress=None) -> None:
    """Warm up each arm once, then ``reps`` rounds with the arms interleaved within each round."""
    for name, model in arms.items():
        prefill_tokens_per_s(model, min(prompt_tokens, 32))
        decode_tokens_per_s(model, 4)
    for rep in range(reps):
        for name, model in arms.items():
            if prompt_tokens:
                results[name].pp.append(prefill_tokens_per_s(model, prompt_tokens))
            if gen_tokens:
                results[name].tg.append(decode_tokens_per_s(model, gen_tokens))
            if progress:
                progress(rep, name, results[name])
