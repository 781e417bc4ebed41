"""transformers' SDPA attention over only the positions a static KV cache has written.

Over a static cache transformers attends to every position, the unwritten ones masked; over its
dynamic cache (what ``generate`` uses by default) to exactly the written ones, unmasked. The two
sum in different orders and now and then part at a near-tie. :data:`NAME`, registered with
transformers' attention and mask interfaces, is its SDPA attention, except where a forward is
given ``int4q_positions`` (a tensor whose length is the number of positions written, this
forward's included): then it attends over those positions only, unmasked, as over the dynamic
cache. That is exact for a prompt from position 0 and for single tokens, where no sliding window
is shorter than the sequence.
"""

from __future__ import annotations

import logging

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

log = logging.getLogger(__name__)

NAME = "int4q_exact_length_sdpa"
_counts = {"calls": 0, "told": 0}  # eager calls of the attention, and those given int4q_positions


def exact_length_sdpa(module, query, key, value, attention_mask, *args, int4q_positions=None, **kwargs):
    """transformers' ``sdpa_attention_forward``; with ``int4q_positions``, over the first
    ``len(int4q_positions)`` keys and values without a mask."""
    if not torch.compiler.is_compiling():
        _counts["calls"] += 1
        _counts["told"] += int4q_positions is not None
    if int4q_positions is not None:
        length = int4q_positions.shape[0]
        key, value, attention_mask = key[:, :, :length], value[:, :, :length], None
    return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        AttentionMaskInterface,
    )

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, exact_length_sdpa)
        AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def attends_over_exact_length(model: torch.nn.Module, run) -> bool:
    """Switch ``model``'s SDPA attention to :data:`NAME` if ``run()`` (an eager forward that passes
    ``int4q_positions``) then gives it ``int4q_positions`` in every attention call; else leave
    it as it was. Returns whether it attends so. A model that does not run transformers' SDPA
    through its attention interface is left as it is."""
    if model.config._attn_implementation == NAME:
        return True
    can_set = getattr(model, "_can_set_attn_implementation", None)  # transformers 5's
    if model.config._attn_implementation != "sdpa" or not (can_set and can_set()):
        return False
    _register()
    model.set_attn_implementation(NAME)
    before = dict(_counts)
    try:
        with torch.inference_mode():
            run()
        calls, told = (_counts[k] - before[k] for k in ("calls", "told"))
        reason = None if calls and calls == told else f"{told} of {calls} attention calls were given the length"
    except Exception as e:  # a model whose attention takes other arguments (a position bias, say)
        reason = f"{type(e).__name__}: {e}"
    if reason:
        log.info("attending over the whole static cache, masked: %s", reason)
        model.set_attn_implementation("sdpa")
    return reason is None
