"""Decoding any causal LM transformers knows: the model's own forward over transformers' static
KV cache, so that one graph of a single-token step can be compiled for it (see
:mod:`.compiled`) as for :class:`.decoder.FastDecoder`.

The cache holds a fixed number of positions (a power of two, at least :data:`MIN_POSITIONS`),
so one compiled step serves every prompt up to that length; its layers (full or sliding
window alike: a sliding window is the mask's) are allocated by the first forward, the prompt's.
Where the model allows it (:mod:`.exact_length`) and no window is shorter than the cache,
attention runs over the written positions only, as over transformers' default dynamic cache.
"""

from __future__ import annotations

import inspect

import torch

from .decoder import SteppedDecoder
from .exact_length import attends_over_exact_length

MIN_POSITIONS = 256


def cache_positions(max_len: int) -> int:
    """The static cache length for sequences of up to ``max_len`` tokens."""
    return max(MIN_POSITIONS, 1 << (max(max_len, 1) - 1).bit_length())


def static_step(model, token, position, cache: dict, written=None):
    """Logits [1, V] after ``token`` [1, 1] at ``position`` ([1] long); its keys and values go
    into the static cache ``cache`` holds under the name the model's forward takes it by.
    ``written``: a tensor of position + 1 elements, for attention over that many positions
    (see :mod:`.exact_length`), or None."""
    extra = {} if written is None else {"int4q_positions": written}
    out = model(input_ids=token, cache_position=position, use_cache=True, logits_to_keep=1, **cache, **extra)
    return out.logits[:, -1]


def cache_argument(model: torch.nn.Module) -> str:
    """The name ``model``'s forward takes its KV cache by (transformers renamed it)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def no_guards(entries) -> list[bool]:
    """Keep none of a traced step's guards: like :class:`FastDecoder`'s, a compiled step is keyed
    by everything it depends on and checked against eager before use (and the guards on the
    model's config objects cannot be saved)."""
    return [False] * len(entries)


def _static_cache(config, positions: int):
    """transformers' static cache for ``config``, its sliding-window layers plain static ones of
    ``positions`` too: theirs keep the length in a Python int, which a compiled step would freeze
    at one position. The window then comes from the mask alone (transformers' sliding causal mask
    over absolute positions, made from tensors), the same attention; the cost is memory, every
    position held in every layer."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    cache = StaticCache(config=config, max_cache_len=positions)
    cache.layers = [StaticLayer(max_cache_len=positions) if layer.is_sliding else layer for layer in cache.layers]
    return cache


class StaticDecoder(SteppedDecoder):
    """One sequence's forward passes through ``model``'s own forward with a static cache of
    :func:`cache_positions` (``max_len``) positions; the interface of :class:`FastDecoder`."""

    step_function = staticmethod(static_step)
    compile_options = {"guard_filter_fn": no_guards}

    def __init__(self, model: torch.nn.Module, max_len: int):
        self.model = model
        self.max_len = cache_positions(max_len)
        self.layer_count = model.config.get_text_config().num_hidden_layers
        self.cache = _static_cache(model.config, self.max_len)
        self.cache_arguments = {cache_argument(model): self.cache}
        self.position = 0
        self.compiled = None
        self.pending = None
        self.written = torch.empty(self.max_len)  # its views' lengths: the positions attention reads
        window = getattr(model.config.get_text_config(), "sliding_window", None)
        self.exact_length = not window or self.max_len < window
        self.exact_length = self.exact_length and attends_over_exact_length(model, self._eager_run)
        self.variant = f"static{self.max_len}" + ("-exact" if self.exact_length else "")

    def _eager_run(self) -> None:
        self.reset()
        self.forward(torch.tensor([[1, 2, 3]]))
        self.forward(torch.tensor([[4]]))
        self.reset()

    def probe(self) -> "StaticDecoder":
        """A decoder of its own for checking a step (the same cache length, so the same graph)."""
        return StaticDecoder(self.model, self.max_len)

    def prepare_tracing(self) -> None:
        """A cache allocated by a prompt, as every single-token step finds it."""
        self.reset()
        self.forward(torch.zeros(1, 2, dtype=torch.long))

    def step_arguments(self, token: torch.Tensor, start: int, for_tracing: bool = False) -> tuple:
        """:func:`static_step`'s arguments; ``for_tracing`` marks the written length dynamic."""
        written = self.written[: start + 1] if self.exact_length else None
        if for_tracing and written is not None:
            torch._dynamo.mark_dynamic(written, 0)
        return self.model, token, torch.tensor([start]), self.cache_arguments, written

    @torch.inference_mode()
    def reset(self) -> None:
        self.cache.reset()
        self.position = 0

    def eager_forward(self, ids: torch.Tensor) -> torch.Tensor:
        start, t = self.position, ids.shape[1]
        exact = self.exact_length and (start == 0 or t == 1)
        extra = {"int4q_positions": self.written[: start + t]} if exact else {}
        out = self.model(input_ids=ids, cache_position=torch.arange(start, start + t), use_cache=True,
                         logits_to_keep=1, **self.cache_arguments, **extra)
        self.position = start + t
        return out.logits[:, -1]
