"""The calibration forward's attention through int4q's causal kernel
(:mod:`quantizer.native.causal_attention`), where a call is plain causal attention over
the whole window; transformers' SDPA attention for every other call.

:data:`NAME` is registered with transformers' attention and mask interfaces (its masks are
SDPA's, so a purely causal window comes without a mask). A call is plain causal when it has no
mask, is causal, has as many queries as keys, a positive scale, no dropout, no position bias, no
logit soft-cap, no attention sinks and no sliding window shorter than the window, and bf16
queries, keys and values of one even head dimension; any argument it does not know that is set
sends it to SDPA.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..native.causal_attention import causal_attention, has_causal_attention

NAME = "int4q_causal"
INERT = frozenset({"position_ids", "cache_position", "past_key_values", "past_key_value", "use_cache"})
"""Arguments a model may pass its attention function that do not change what it computes."""

calls = {"native": 0, "sdpa": 0}  # attention calls per path, for tests and benchmarks


def causal_or_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                   is_causal: bool | None = None, **kwargs):
    """transformers' attention function contract: (output [B, T, H, D], None)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if causal and attention_mask is None and not dropout and scale > 0 and _plain(query, key, value, kwargs) \
            and has_causal_attention():
        calls["native"] += 1
        return causal_attention(query, key, value, scale), None
    calls["sdpa"] += 1
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def use_causal_kernel(model: torch.nn.Module) -> bool:
    """Switch ``model`` from transformers' SDPA attention to :data:`NAME`, where it runs SDPA
    through transformers' attention interface and int4q's kernel works on this machine; returns
    whether it did. Any other model is left as it is."""
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if model.config._attn_implementation != "sdpa" or not (can_set and can_set()) or not has_causal_attention():
        return False
    _register()
    model.set_attn_implementation(NAME)
    return True


def _plain(query, key, value, kwargs) -> bool:
    positions = query.shape[2]
    window = kwargs.get("sliding_window")
    others_unset = all(v is None or v is False for name, v in kwargs.items()
                       if name not in INERT and name != "sliding_window")
    return (others_unset and (window is None or window >= positions)
            and query.dim() == key.dim() == value.dim() == 4
            and query.dtype == key.dtype == value.dtype == torch.bfloat16
            and query.device.type == "cpu" and key.shape == value.shape
            and key.shape[2] == positions and key.shape[0] == query.shape[0]
            and key.shape[-1] == query.shape[-1] and query.shape[-1] % 2 == 0
            and key.shape[1] > 0 and query.shape[1] % key.shape[1] == 0
            and not (query.requires_grad or key.requires_grad or value.requires_grad)
            and not torch.compiler.is_compiling())


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        AttentionMaskInterface,
    )

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, causal_or_sdpa)
        AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
