"""End-to-end fidelity of a quantized model against its source, in the spirit of llama.cpp's
``llama-perplexity --kl-divergence``: teacher-forced KL divergence, top-1 agreement and
perplexity over windows of text, and greedy exact match over fixed prompts; for a base model (no
head, no logits), its last hidden states and their mean-pooled embedding."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import InputError

GREEDY_PROMPTS = (
    ("plain", "The capital of France is"),
    ("plain", "def fibonacci(n):"),
    ("plain", "In mathematics, a prime number is"),
    ("plain", "The three laws of thermodynamics state that"),
    ("chat", "What is the capital of Japan?"),
    ("chat", "Give me three tips for staying healthy."),
    ("chat", "Explain what a hash table is in one sentence."),
    ("chat", "Write a haiku about autumn."),
)


@dataclass
class FidelityResult:
    """Teacher-forced numbers over the scored tokens, and greedy agreement."""

    tokens_scored: int = 0
    windows: int = 0
    kld_mean: float = 0.0
    kld_p999: float = 0.0
    kld_max: float = 0.0
    top1_agreement: float = 0.0
    ppl_reference: float = 0.0
    ppl_quantized: float = 0.0
    greedy_matches: int = 0
    greedy_total: int = 0
    greedy_details: list = field(default_factory=list)

    @property
    def ppl_ratio(self) -> float:
        return self.ppl_quantized / self.ppl_reference if self.ppl_reference else float("nan")

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items()}
        d["ppl_ratio"] = self.ppl_ratio
        return d


def token_windows(tokenizer, text: str, ctx: int, max_windows: int) -> list[torch.Tensor]:
    """Consecutive non-overlapping windows [1, ctx] of the tokenised text."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    count = min(len(ids) // ctx, max_windows)
    if count == 0:
        raise InputError(f"the evaluation text has {len(ids)} tokens, fewer than one window of {ctx}")
    return [ids[i * ctx:(i + 1) * ctx].unsqueeze(0) for i in range(count)]


@torch.inference_mode()
def teacher_forced(reference, quantized, windows: list[torch.Tensor], progress=None) -> FidelityResult:
    """Score the second half of each window (the first half is context, as llama-perplexity does);
    ``progress(done, total)`` after each window."""
    klds, agree, nll_ref, nll_q = [], 0, 0.0, 0.0
    for i, ids in enumerate(windows):
        start = ids.shape[1] // 2
        lp_ref = torch.log_softmax(reference(input_ids=ids).logits[0, start - 1:-1].float(), -1)
        lp_q = torch.log_softmax(quantized(input_ids=ids).logits[0, start - 1:-1].float(), -1)
        target = ids[0, start:]
        klds.append((lp_ref.exp() * (lp_ref - lp_q)).sum(-1).clamp(min=0))
        agree += (lp_ref.argmax(-1) == lp_q.argmax(-1)).sum().item()
        nll_ref -= lp_ref.gather(-1, target[:, None]).sum().item()
        nll_q -= lp_q.gather(-1, target[:, None]).sum().item()
        if progress:
            progress(i + 1, len(windows))
    kld = torch.cat(klds)
    n = kld.numel()
    return FidelityResult(
        tokens_scored=n, windows=len(windows), kld_mean=kld.mean().item(),
        kld_p999=torch.quantile(kld, 0.999).item(), kld_max=kld.max().item(), top1_agreement=agree / n,
        ppl_reference=math.exp(nll_ref / n), ppl_quantized=math.exp(nll_q / n),
    )


@dataclass
class HiddenStateResult:
    """A base model's last hidden states, quantized against the reference: per token, the cosine
    similarity and the relative error |h_q - h_r| / |h_r|; per window, the cosine of the mean-pooled
    embeddings (as embedding models pool)."""

    tokens: int
    windows: int
    cosine_mean: float
    cosine_min: float
    relative_error_mean: float
    pooled_cosine_min: float

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@torch.inference_mode()
def hidden_state_agreement(reference, quantized, windows: list[torch.Tensor], progress=None) -> HiddenStateResult:
    """:class:`HiddenStateResult` over every token of ``windows``; ``progress(done, total)`` after each."""
    cosines, errors, pooled = [], [], []
    for i, ids in enumerate(windows):
        ref = reference(input_ids=ids).last_hidden_state[0].double()
        got = quantized(input_ids=ids).last_hidden_state[0].double()
        cosines.append(torch.nn.functional.cosine_similarity(got, ref, dim=-1))
        errors.append((got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-30))
        pooled.append(torch.nn.functional.cosine_similarity(got.mean(0), ref.mean(0), dim=0))
        if progress:
            progress(i + 1, len(windows))
    cosine, error = torch.cat(cosines), torch.cat(errors)
    return HiddenStateResult(cosine.numel(), len(windows), cosine.mean().item(), cosine.min().item(),
                             error.mean().item(), torch.stack(pooled).min().item())


def greedy_agreement(reference, quantized, tokenizer, max_new_tokens: int, result: FidelityResult,
                     progress=None) -> None:
    """Fill result.greedy_*: does the quantized model reproduce the reference's greedy text exactly?"""
    from ..runtime.decode.generation import encode_prompt, greedy_ids

    has_chat = bool(getattr(tokenizer, "chat_template", None))
    prompts = [(kind, p) for kind, p in GREEDY_PROMPTS if kind == "plain" or has_chat]
    for i, (kind, prompt) in enumerate(prompts):
        ids = encode_prompt(tokenizer, prompt, chat=kind == "chat")
        ref = greedy_ids(reference, ids, max_new_tokens)
        got = greedy_ids(quantized, ids, max_new_tokens)
        same = ref.shape == got.shape and torch.equal(ref, got)
        result.greedy_matches += int(same)
        result.greedy_details.append({
            "kind": kind, "prompt": prompt, "match": same,
            "reference": tokenizer.decode(ref[0], skip_special_tokens=True),
            "quantized": tokenizer.decode(got[0], skip_special_tokens=True),
        })
        if progress:
            progress(i + 1, len(prompts))
    result.greedy_total = len(prompts)
