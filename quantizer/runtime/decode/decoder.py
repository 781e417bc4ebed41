"""Greedy decoding without transformers' per-step machinery.

A preallocated KV cache, logits for the last position only, and each decoder layer split into
two halves around attention (norm + projections + rotary; output projection + norm + MLP).
Prefill runs the halves eagerly (its GEMMs dominate). A single-token step is also available as
one function of tensors, :func:`decode_step`, which ``torch.compile`` turns into one graph for
the whole model: the position is a tensor and the caches come in as views whose length is marked
dynamic, so the graph holds for every position and every cache size.

Covers decoder layers shaped like Llama's (:data:`FAST_MODEL_TYPES`: separate or fused q/k/v and
gate/up projections, a rotary embedding over whole heads or their first part);
:func:`unsupported_reason` says why another model decodes through its own forward instead
(:mod:`.static`).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from ...errors import InputError
from ...native.causal_attention import causal_attention, has_causal_attention
from ..activations import KV_CACHES
from ..kernels.attention import has_attend_one
from ..kernels.dequant import shared_weight_buffer
from ..kernels.gemv import has_mean_square
from ..kernels.kv_int8 import KEY_DIMS, Int8Cache, has_int8_cache, store_and_attend
from ..nn.fusion import Int4Slice

MIN_CACHE = 4
"""Positions every decoder's cache has at least: the eager check runs a 3-token prompt and a step."""

FAST_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
"""Model types whose decoder stack is exactly: embed, layers of the shape below, norm, head."""

LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
ATTN_CHILDREN = {"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "q_norm", "k_norm", "rotary_emb"}
DYNAMIC_ROPE = ("dynamic", "longrope")  # inv_freq depends on the sequence length


def unsupported_reason(model: torch.nn.Module, max_len: int) -> str | None:
    """None when :class:`FastDecoder` reproduces ``model``'s forward over ``max_len`` tokens, else why not."""
    config = model.config.get_text_config()
    if config.model_type not in FAST_MODEL_TYPES:
        return f"model type {config.model_type!r} is not one of {', '.join(FAST_MODEL_TYPES)}"
    base = model.get_decoder()
    if not all(hasattr(base, a) for a in ("layers", "norm", "rotary_emb")):
        return "the decoder has no layers/norm/rotary_emb"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") in DYNAMIC_ROPE:
        return f"rope type {rope.get('rope_type')!r} changes with the sequence length"
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and max_len > window:
        return f"{max_len} tokens exceed the sliding window of {window}"
    for layer in base.layers:
        difference = _other_parts(layer)
        if difference:
            return f"decoder layer {type(layer).__name__} has other parts ({difference})"
    attn = base.layers[0].self_attn
    with torch.no_grad():
        rotary_dim = base.rotary_emb(torch.zeros(1), torch.arange(1)[None])[0].shape[-1]
    if not applies_the_same_rope(sys.modules[type(attn).__module__], attn.head_dim, rotary_dim):
        return "its apply_rotary_pos_emb is not Llama's"
    return None


def _other_parts(layer: torch.nn.Module) -> str:
    """The layer's children beyond :data:`LAYER_CHILDREN` and :data:`ATTN_CHILDREN` (dropouts are
    the identity in inference), or "missing" when it lacks one of them; "" when it has neither."""
    def named(module):
        return {n for n, m in module.named_children() if not isinstance(m, torch.nn.Dropout)}

    children = named(layer)
    attn = named(layer.self_attn) if hasattr(layer, "self_attn") else set()
    extra = (children - LAYER_CHILDREN) | (attn - ATTN_CHILDREN - {n for n in attn if n.endswith("_fused")})
    if extra:
        return ", ".join(sorted(extra))
    has_projections = {"q_proj", "k_proj", "v_proj"} <= attn or "qkv_proj" in attn
    return "" if LAYER_CHILDREN <= children and has_projections and "o_proj" in attn else "missing"


def _projections(attn, x):
    """q, k, v of ``x``, from separate, grouped (:class:`Int4Slice`) or fused (``qkv_proj``) linears."""
    if hasattr(attn, "qkv_proj"):
        q_size = attn.config.num_attention_heads * attn.head_dim
        kv_size = attn.config.num_key_value_heads * attn.head_dim
        qkv = attn.qkv_proj(x)
        return qkv[..., :q_size], qkv[..., q_size : q_size + kv_size], qkv[..., q_size + kv_size :]
    q = attn.q_proj
    if isinstance(q, Int4Slice) and q.group is attn.k_proj.group is attn.v_proj.group:
        return q.group(x)
    return q(x), attn.k_proj(x), attn.v_proj(x)


def _mlp(mlp, x):
    gate = getattr(mlp, "gate_proj", None)
    if isinstance(gate, Int4Slice) and gate.group is mlp.up_proj.group:
        g, u = gate.group(x)
        return mlp.down_proj(mlp.act_fn(g) * u)
    return mlp(x)


def rms_norm(module, h):
    """``module(h)``. While torch.compile traces, a norm marked ``exact_mean_square`` (a Llama-style
    RMSNorm, see :func:`llama_rms_norm`) computes its variance with one opaque operator instead:
    Inductor's own reduction sums in another order, and an fp32 sum rounded differently now and
    then flips a bf16 output and, rarely, a greedy token."""
    if getattr(module, "exact_mean_square", False) and torch.compiler.is_compiling():
        return llama_rms_norm(module, h, torch.ops.int4q_native.mean_square)
    return module(h)


def llama_rms_norm(module, h, mean_square):
    """LlamaRMSNorm's forward with ``mean_square(x)`` for ``x.pow(2).mean(-1, keepdim=True)``."""
    x = h.to(torch.float32)
    x = x * torch.rsqrt(mean_square(x) + module.variance_epsilon)
    return module.weight * x.to(h.dtype)


def is_llama_rms_norm(module) -> bool:
    """Whether ``module``'s forward is LlamaRMSNorm's (:func:`llama_rms_norm`), bit for bit on a
    seeded input."""
    weight = getattr(module, "weight", None)
    if weight is None or not hasattr(module, "variance_epsilon") or weight.dim() != 1:
        return False
    gen = torch.Generator().manual_seed(0)
    h = (torch.randn(1, 3, weight.numel(), generator=gen) * 3).to(torch.bfloat16)
    with torch.inference_mode():
        return torch.equal(module(h), llama_rms_norm(module, h, lambda x: x.pow(2).mean(-1, keepdim=True)))


def mark_exact_norms(layers, norm) -> int:
    """Mark the norms that are LlamaRMSNorm (:func:`is_llama_rms_norm`) to take their variance from
    the opaque ``int4q_native.mean_square`` when compiled (see :func:`rms_norm`); only where
    int4q's operators are loaded. Returns how many were marked."""
    if not has_mean_square():
        return 0
    marked = 0
    for module in (*layers.modules(), norm):
        if getattr(module, "weight", None) is not None and hasattr(module, "variance_epsilon"):
            module.exact_mean_square = is_llama_rms_norm(module)
            marked += module.exact_mean_square
    return marked


class StepMismatch(Exception):
    """A compiled or native step's logits differ from the eager step's."""


def check_against_eager(decoder, attribute: str = "compiled") -> None:
    """Raise StepMismatch unless one step through the decoder's ``attribute`` (``compiled`` or
    ``native``) picks the eager step's token with logits within bf16 rounding of it. Where the fast
    path also takes the prompt (``rows`` > 1), eager takes it one token at a time, so that both
    attend as single-token steps do. Leaves the decoder reset."""
    prompt, token = torch.tensor([[1, 2, 3]]), torch.tensor([[4]])
    fast_step = getattr(decoder, attribute)
    eager_prompt = prompt.split(1, dim=1) if getattr(fast_step, "rows", 1) > 1 else (prompt,)
    try:
        results = []
        for step in (fast_step, None):
            setattr(decoder, attribute, step)
            decoder.reset()
            for part in (prompt,) if step is not None else eager_prompt:
                decoder.forward(part)
            results.append(decoder.forward(token).float())
    finally:
        setattr(decoder, attribute, fast_step)
        decoder.reset()
    fast, eager = results
    worst = (fast - eager).abs().max().item()
    if not torch.equal(fast.argmax(-1), eager.argmax(-1)) or worst > 0.02 * eager.abs().max().item() + 1e-3:
        raise StepMismatch(f"the {attribute} step's logits differ from eager by up to {worst:.3g}")


class SteppedDecoder:
    """What both decoders share: ``forward(ids)`` appends ``ids`` [1, T] and returns the last
    position's logits [1, V]: up to ``native.rows`` tokens through ``native`` (``native(ids,
    position)``, see :mod:`.native_step`) where that is set; else a single token through
    ``compiled`` (a compiled step of ``step_function``) where there is one, asking ``pending`` for
    it first; else :meth:`eager_forward`. Subclasses set ``model``, ``max_len``, ``position``,
    ``compiled``, ``pending`` and ``step_arguments``."""

    native = None

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start, t = self.position, ids.shape[1]
        if start + t > self.max_len:
            raise InputError(f"{start + t} tokens exceed this decoder's cache of {self.max_len}")
        if self.native is not None and t <= self.native.rows:
            logits = self.native(ids, start)
            self.position += t
            return logits
        if t == 1 and self.pending is not None:
            self.compiled = self.pending.poll() or self.compiled
            self.pending = None if self.pending.finished else self.pending
        if t != 1 or not start or self.compiled is None:
            return self.eager_forward(ids)
        logits = self.compiled(*self.step_arguments(ids, start))
        self.position += 1
        return logits

    def eager_forward(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The last dimension's halves (a, b) as (-b, a)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(q, k, cos, sin):
    """Llama's rotary position embedding of q and k [1, H, T, hd] by cos and sin [1, T, rd]: the
    first rd (<= hd) of each head's dimensions rotate, the rest pass unchanged."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary = cos.shape[-1]
    if rotary == q.shape[-1]:
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    return tuple(torch.cat([x[..., :rotary] * cos + rotate_half(x[..., :rotary]) * sin, x[..., rotary:]], dim=-1)
                 for x in (q, k))


def applies_the_same_rope(modeling, head_dim: int = 8, rotary_dim: int = 8) -> bool:
    """Whether the modeling module's ``apply_rotary_pos_emb`` gives :func:`apply_rope`'s result,
    bit for bit, on a seeded sample of heads of ``head_dim`` with ``rotary_dim`` rotating."""
    theirs = getattr(modeling, "apply_rotary_pos_emb", None)
    if not callable(theirs):
        return False
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 3, head_dim, generator=gen).bfloat16() for _ in range(2))
    cos, sin = (torch.randn(1, 3, rotary_dim, generator=gen).bfloat16() for _ in range(2))
    try:
        got = theirs(q, k, cos, sin)
    except RuntimeError:  # a function that rotates whole heads cannot take a partial cos/sin
        return False
    return all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, apply_rope(q, k, cos, sin)))


def attention_inputs(layer, h, cos, sin):
    """h [1, T, D] -> rotated q [1, H, T, hd], k and v [1, Hkv, T, hd]."""
    attn = layer.self_attn
    x = rms_norm(layer.input_layernorm, h)
    shape = (*h.shape[:-1], -1, attn.head_dim)
    q, k, v = (t.view(shape) for t in _projections(attn, x))
    if hasattr(attn, "q_norm"):
        q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
    q, k = apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, v.transpose(1, 2)


def attention_output_and_mlp(layer, h, attended):
    """The residual stream after the attention output projection and the MLP."""
    h = h + layer.self_attn.o_proj(attended)
    return h + _mlp(layer.mlp, rms_norm(layer.post_attention_layernorm, h))


def attend(q, k, v, start: int, scale: float) -> torch.Tensor:
    """Causal attention of T queries at positions start.. over keys 0..start+T-1 -> [1, T, H*hd]."""
    t = q.shape[2]
    mask, causal = None, False
    if t > 1 and start == 0:
        causal = True
    elif t > 1:
        mask = torch.arange(start + t).unsqueeze(0) <= (start + torch.arange(t)).unsqueeze(1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).reshape(1, t, -1)


def attend_in_fp32(q, k, v, start: int, scale: float) -> torch.Tensor:
    """:func:`attend` with one query (T = 1) computed in fp32 from the bf16 cache, the result
    rounded to bf16 once (int4q's operator where it is loaded, else PyTorch's attention on the
    widened cache); a prompt from position 0 through int4q's causal-attention operator where it
    loads (fp32 sums too, each weight carried in 16 bits), other queries through :func:`attend`.
    Not bit-identical to it (bf16 attention rounds its probabilities to bf16), and several times
    faster where the CPU has no bf16 dot products (docs/runtime.md, CPUs without AVX-512)."""
    if q.shape[2] != 1:
        if start == 0 and k.shape[2] == q.shape[2] and has_causal_attention():
            return causal_attention(q, k, v, scale).reshape(1, q.shape[2], -1)
        return attend(q, k, v, start, scale)
    if has_attend_one():
        return torch.ops.int4q_native.attend_one(q, k, v, scale)
    return attend_widened(q, k, v, start, scale)


def attend_widened(q, k, v, start: int, scale: float) -> torch.Tensor:
    """:func:`attend` on q, k and v widened to fp32, the result rounded to bf16 once (PyTorch's
    attention, where :func:`attend_in_fp32` has no operator)."""
    return attend(q.float(), k.float(), v.float(), start, scale).to(q.dtype)


def single_query_attention(model: torch.nn.Module):
    """The single-token step's attention for ``model``: :func:`attend_in_fp32` when its int4
    linears decode with int8 activations (a choice that already leaves bit-identity with
    transformers' forward), else :func:`attend`."""
    return attend_in_fp32 if any(getattr(m, "int8_decode", False) for m in model.modules()) else attend


def decode_step(layers, embed, norm, head, token, position, keys, values, cos_table, sin_table, scale,
                attention=attend):
    """Logits [1, V] after ``token`` [1, 1] at ``position`` ([1] long). ``keys``/``values`` are
    the caches' views of positions 0..position; the token's K/V go into their last slot;
    ``attention``: :func:`attend` or :func:`attend_in_fp32`."""
    h = embed(token).to(torch.bfloat16)
    cos, sin = cos_table.index_select(1, position), sin_table.index_select(1, position)
    length = keys[0].shape[2]
    for layer, layer_keys, layer_values in zip(layers, keys, values):
        # one traced size for every view's length (else each view gets a size argument of its own, made per call)
        torch._check(layer_keys.shape[2] == length)
        torch._check(layer_values.shape[2] == length)
        q, k, v = attention_inputs(layer, h, cos, sin)
        layer_keys[:, :, -1:].copy_(k)
        layer_values[:, :, -1:].copy_(v)
        h = attention_output_and_mlp(layer, h, attention(q, layer_keys, layer_values, layer_keys.shape[2] - 1, scale))
    return head(rms_norm(norm, h))[:, 0]


def int8_cache_unsupported(model: torch.nn.Module, kv_cache: str, sequences: int = 1) -> str | None:
    """None where a :class:`FastDecoder` of ``model`` can hold ``kv_cache`` (one of :data:`KV_CACHES`),
    else why not: an int8 cache needs int8 decode activations, int4q's library, a head dimension
    that is a multiple of 32 and one sequence."""
    if kv_cache not in KV_CACHES:
        return f"the KV cache must be one of {', '.join(KV_CACHES)}, not {kv_cache!r}"
    if kv_cache == "bf16":
        return None
    if single_query_attention(model) is not attend_in_fp32:
        return "an int8 KV cache needs int8 decode activations (--decode int8) and a cpu_int4 checkpoint"
    if model.get_decoder().layers[0].self_attn.head_dim % KEY_DIMS:
        return f"an int8 KV cache needs a head dimension that is a multiple of {KEY_DIMS}"
    if sequences != 1:
        return "an int8 KV cache holds one sequence"
    if not has_int8_cache():
        return "an int8 KV cache needs int4q's native library, which is not loaded here (see the log)"
    return None


class FastDecoder(SteppedDecoder):
    """One sequence's forward passes with a KV cache of ``max_len`` positions: the decoder for
    the model types of :func:`unsupported_reason` (see :class:`.static.StaticDecoder` for the rest).

    ``forward(ids)`` appends ``ids`` [1, T] and returns the last position's logits [1, V].
    ``compiled``, when set, is a compiled :func:`decode_step` used for single-token steps;
    ``pending``, when set, is asked for it before each single-token step. With ``sequences`` > 1
    its caches hold that many sequences (first dimension) for a batched decoder, which points
    the one-sequence paths at one of them at a time.
    """

    step_function = staticmethod(decode_step)
    compile_options: dict = {}

    def __init__(self, model: torch.nn.Module, max_len: int, sequences: int = 1, kv_cache: str = "bf16"):
        reason = unsupported_reason(model, max_len) or int8_cache_unsupported(model, kv_cache, sequences)
        if reason:
            raise InputError(f"the fast decoder cannot run this model: {reason}")
        base = model.get_decoder()
        config = model.config.get_text_config()
        self.layers = base.layers
        self.norm, self.embed, self.head = base.norm, model.get_input_embeddings(), model.get_output_embeddings()
        attn = self.layers[0].self_attn
        self.scale = attn.scaling
        kv_shape = (sequences, config.num_key_value_heads, max_len, attn.head_dim)
        int8 = kv_cache == "int8"
        self.keys = [torch.zeros(kv_shape, dtype=torch.bfloat16) for _ in self.layers] if not int8 else []
        self.values = [torch.zeros(kv_shape, dtype=torch.bfloat16) for _ in self.layers] if not int8 else []
        self.int8_caches = [Int8Cache.empty(*kv_shape[1:]) for _ in self.layers] if int8 else []
        with torch.inference_mode():
            self.cos, self.sin = base.rotary_emb(torch.zeros(1, dtype=torch.bfloat16), torch.arange(max_len)[None])
        for t in (self.cos, self.sin):  # one compiled graph serves every cache length
            torch._dynamo.mark_dynamic(t, 1)
        self.attention = single_query_attention(model)
        self.variant = "" if self.attention is attend else "fp32-attention"
        self.model = model
        self.layer_count = len(self.layers)
        self.max_len = max_len
        self.position = 0
        self.compiled = None
        self.pending = None  # a compiled step on its way (see .background.PendingStep)

    def step_arguments(self, token: torch.Tensor, start: int, for_tracing: bool = False) -> tuple:
        """:func:`decode_step`'s arguments for ``token`` [1, 1] at position ``start`` (> 0): the
        caches as views over positions 0..start. ``for_tracing`` marks the views' length dynamic
        for torch.compile, so one graph serves every position (lengths 0 and 1 would be
        specialised, hence ``start`` > 0)."""
        keys = [k[:, :, : start + 1] for k in self.keys]
        values = [v[:, :, : start + 1] for v in self.values]
        if for_tracing:
            for t in (*keys, *values):
                torch._dynamo.mark_dynamic(t, 2)
        return (self.layers, self.embed, self.norm, self.head, token, torch.tensor([start]), keys, values,
                self.cos, self.sin, self.scale, self.attention)

    def cache_tensors(self) -> list[list[torch.Tensor]]:
        """Each layer's cache as the native plan takes it: keys and values, or an int8 cache's four
        tensors."""
        if self.int8_caches:
            return [c.tensors() for c in self.int8_caches]
        return [[k, v] for k, v in zip(self.keys, self.values)]

    def probe(self) -> "FastDecoder":
        """A decoder of its own for checking a step (every cache length shares the graph)."""
        return FastDecoder(self.model, MIN_CACHE)

    def prepare_tracing(self) -> None:
        """The norms marked (see :func:`mark_exact_norms`) and a cache longer than one position,
        so that the traced length stays dynamic."""
        mark_exact_norms(self.layers, self.norm)
        self.reset()
        self.forward(torch.zeros(1, 2, dtype=torch.long))

    def reset(self) -> None:
        self.position = 0

    def eager_forward(self, ids: torch.Tensor) -> torch.Tensor:
        start, t = self.position, ids.shape[1]
        h = self.embed(ids).to(torch.bfloat16)
        cos, sin = self.cos[:, start : start + t], self.sin[:, start : start + t]
        end = start + t
        with shared_weight_buffer():
            if self.int8_caches:
                for layer, cache in zip(self.layers, self.int8_caches):
                    q, k, v = attention_inputs(layer, h, cos, sin)
                    h = attention_output_and_mlp(layer, h, store_and_attend(cache, q, k, v, start, self.scale,
                                                                            self.attention, attend))
            for layer, keys, values in zip(self.layers, self.keys, self.values):
                q, k, v = attention_inputs(layer, h, cos, sin)
                keys[:, :, start:end] = k
                values[:, :, start:end] = v
                h = attention_output_and_mlp(layer, h, self.attention(q, keys[:, :, :end], values[:, :, :end],
                                                                      start, self.scale))
        self.position = end
        return self.head(self.norm(h[:, -1:]))[:, 0]
