"""The single-token step as one native call: ``torch.classes.int4q_native.DecodePlan``
(``csrc/decode_plan.cpp``) runs a :class:`.decoder.FastDecoder`'s whole decoder stack, from the
embedded token to the final norm, where every layer is what that plan computes: Llama's RMSNorms,
fused q/k/v and gate/up linears that multiply int8 activations through ``w4a8_mm`` (the kernel
layout, AVX-512 VNNI) or ``w4a8_rows`` (row-major copies, AVX2), as eager does, a SiLU MLP, and the
fp32 single-query attention of ``attend_one`` (``attend_one_int8`` over an int8 KV cache). The
embedding and the head stay the model's own modules (any kind of table or head).

Nothing is traced or compiled, so such a model decodes at full speed from its first token. The plan
rounds where the eager int8 step rounds and is checked against it before use, like a compiled step;
models it does not cover take the compiled step. Where the linears' prefill rows are int8 too, a
prompt of up to :data:`PROMPT_ROWS` tokens goes through the plan in one call, which gives what as many
single-token steps give, bit for bit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels.attention import has_attend_one
from ..kernels.w4a8_rows import ROWS_LIMIT
from ..nn.fusion import Int4Slice
from ..nn.int4 import Int4Linear, int8_operator
from .decoder import (
    FastDecoder,
    StepMismatch,
    attend_in_fp32,
    check_against_eager,
    is_llama_rms_norm,
)

log = logging.getLogger(__name__)

NO_TENSOR = torch.empty(0, dtype=torch.bfloat16)
"""An absent norm or bias, as the plan takes it."""

NORMS, LINEARS = 4, 4
LAYER_TENSORS = NORMS + 4 * LINEARS
"""Tensors per layer in :func:`layer_arguments`: the norms' weights, then (pack, sz, zero, bias) of
each linear (:func:`_linear_tensors`)."""

PROMPT_ROWS = 128
"""The longest prompt the plan takes in one call (where prefill is int8): its attention is one
query at a time, and past this length transformers' attention over the whole prompt is faster
(docs/runtime.md, "The native step")."""


class NotCovered(Exception):
    """The plan does not compute this model's step; the message says which part differs."""


def _w4a8_linear(linear) -> Int4Linear:
    """The Int4Linear that a one-row input multiplies through ``w4a8_mm`` or ``w4a8_rows``, else
    NotCovered."""
    if type(linear) is not Int4Linear:
        raise NotCovered(f"a {type(linear).__name__} is not a 4-bit linear")
    operator = int8_operator(1, linear.threshold, linear.int8_decode, linear.int8_prefill, linear.int4pack,
                             linear.group_size, linear.packed)
    if operator not in ("w4a8_mm", "w4a8_rows"):
        raise NotCovered("a linear does not decode with int8 activations")
    return linear


def _fused(parent, fused_name: str, names: tuple[str, ...]) -> Int4Linear:
    """The one linear computing ``names`` in order: ``fused_name`` itself, or their shared group."""
    if hasattr(parent, fused_name):
        return _w4a8_linear(getattr(parent, fused_name))
    members = [getattr(parent, n, None) for n in names]
    group = getattr(members[0], "group", None)
    if not all(isinstance(m, Int4Slice) and m.group is group and m.index == i for i, m in enumerate(members)):
        raise NotCovered(f"{', '.join(names)} are not one fused group")
    return _w4a8_linear(group.linear)


def _linear_tensors(linear: Int4Linear) -> list[torch.Tensor]:
    """(pack, sz, zero, bias) as the plan takes them: the row-major tensors where the linear
    decodes from them (``w4a8_rows``), else the kernel layout and no zero."""
    bias = NO_TENSOR if linear.bias is None else linear.bias.contiguous()
    if linear.packed is not None:
        return [linear.packed.contiguous(), linear.scale.contiguous(), linear.zero.contiguous(), bias]
    return [linear.int4pack.contiguous(), linear.sz.contiguous(), NO_TENSOR, bias]


def _norm(module) -> tuple[torch.Tensor, float]:
    if module is None:
        return NO_TENSOR, 0.0
    if not is_llama_rms_norm(module):
        raise NotCovered(f"{type(module).__name__} is not Llama's RMSNorm")
    return module.weight.detach().to(torch.bfloat16).contiguous(), float(module.variance_epsilon)


def _silu_mlp(mlp) -> tuple[Int4Linear, Int4Linear]:
    """(gate_up, down) of a SiLU-gated MLP: Llama's gate/up/down or Phi-3's gate_up/down."""
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
    sample = (torch.randn(64, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    if act is None or not torch.equal(act(sample), F.silu(sample)):
        raise NotCovered("the MLP's activation is not SiLU")
    return _fused(mlp, "gate_up_proj", ("gate_proj", "up_proj")), _w4a8_linear(mlp.down_proj)


def layer_arguments(layer) -> tuple[list, list, list]:
    """``DecodePlan.add_layer``'s arguments for a decoder layer, less its caches:
    :data:`LAYER_TENSORS` tensors, 4 epsilons, 4 group sizes; NotCovered where the plan does not
    compute it."""
    attn = layer.self_attn
    norms = [_norm(layer.input_layernorm), _norm(getattr(attn, "q_norm", None)),
             _norm(getattr(attn, "k_norm", None)), _norm(layer.post_attention_layernorm)]
    linears = [_fused(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj")), _w4a8_linear(attn.o_proj),
               *_silu_mlp(layer.mlp)]
    tensors = [n[0] for n in norms] + [t for lin in linears for t in _linear_tensors(lin)]
    return tensors, [n[1] for n in norms], [lin.group_size for lin in linears]


@dataclass
class PlanSpec:
    """A DecodePlan apart from its caches and rotary tables: attention's shape and scale, the final
    norm, each layer's :func:`layer_arguments`, and ``rows``: how many tokens one call may take."""

    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    norm: torch.Tensor
    eps: float
    layers: list[tuple[list, list, list]]
    rows: int

    def kernels(self) -> set[str]:
        """The int8 operators the plan multiplies with: ``w4a8_rows`` for each linear given as
        row-major tensors (those with a zero), ``w4a8_mm`` for the others."""
        zeros = (tensors[NORMS + 4 * i + 2] for tensors, _, _ in self.layers for i in range(LINEARS))
        return {"w4a8_rows" if zero.numel() else "w4a8_mm" for zero in zeros}


def plan_spec(decoder: FastDecoder) -> PlanSpec:
    """The plan of ``decoder``'s stack (int4q's library is loaded once ``attend_one`` is);
    NotCovered says why there is none."""
    if decoder.attention is not attend_in_fp32 or not has_attend_one():
        raise NotCovered("its single-token attention is not attend_one's")
    attn, config = decoder.layers[0].self_attn, decoder.model.config.get_text_config()
    weight, eps = _norm(decoder.norm)
    rows = prompt_rows(decoder)
    return PlanSpec(config.num_attention_heads, config.num_key_value_heads, attn.head_dim, float(decoder.scale),
                    weight, eps, [layer_arguments(layer) for layer in decoder.layers], rows)


def make_plan(spec: PlanSpec, cos: torch.Tensor, sin: torch.Tensor, caches: list[list[torch.Tensor]]):
    """``torch.classes.int4q_native.DecodePlan`` of ``spec`` over rotary tables cos and sin bf16
    [1, positions, rotary] and each layer's cache: keys and values bf16 [sequences, kv_heads,
    positions, head_dim], or an int8 cache's tensors (:meth:`..kernels.kv_int8.Int8Cache.tensors`)."""
    plan = torch.classes.int4q_native.DecodePlan(spec.heads, spec.kv_heads, spec.head_dim, spec.norm.numel(),
                                                 spec.scale, cos.contiguous(), sin.contiguous(), spec.norm, spec.eps)
    for (tensors, eps, groups), cache in zip(spec.layers, caches):
        plan.add_layer([*tensors, *cache], eps, groups)
    return plan


def prompt_rows(decoder: FastDecoder) -> int:
    """The most tokens one plan call takes: where every int4 linear of the stack multiplies prefill
    rows with int8 activations too, as many as eager sends through the same kernels (up to
    :data:`PROMPT_ROWS`), so that the plan computes a prompt as eager does (up to attention); else 1."""
    linears = [m for m in decoder.layers.modules() if isinstance(m, Int4Linear)]
    if not all(m.int8_prefill for m in linears):
        return 1
    return min(PROMPT_ROWS, ROWS_LIMIT) if any(m.packed is not None for m in linears) else PROMPT_ROWS


class NativeStep:
    """``step(ids, position)`` -> logits [1, V] of the last of ``ids`` [1, T] (T <= ``rows``, at
    first ``spec.rows``): an embedding, the DecodePlan made from ``spec``, a head."""

    def __init__(self, spec: PlanSpec, plan, embed, head):
        self.spec, self.plan, self.embed, self.head, self.rows = spec, plan, embed, head, spec.rows

    @classmethod
    def of(cls, decoder: FastDecoder) -> "NativeStep":
        """The step of ``decoder``'s own modules over its caches; NotCovered where there is none."""
        spec = plan_spec(decoder)
        return cls(spec, make_plan(spec, decoder.cos, decoder.sin, decoder.cache_tensors()), decoder.embed,
                   decoder.head)

    def __call__(self, ids: torch.Tensor, position: int) -> torch.Tensor:
        h = self.embed(ids).to(torch.bfloat16)
        return self.head(self.plan.step(h.view(ids.shape[1], -1), position))[:, 0]


def native_step(decoder) -> NativeStep | None:
    """The decoder's native step, checked against its eager step; None (logged) where the plan
    does not cover its model (the library or the CPU's int8 kernel missing included) or the step
    differs from eager."""
    if not isinstance(decoder, FastDecoder):
        return None
    try:
        decoder.native = NativeStep.of(decoder)
        check_against_eager(decoder, "native")
        return decoder.native
    except NotCovered as e:
        decoder.native = None
        log.info("no native decode step: %s", e)
    except (StepMismatch, RuntimeError) as e:
        decoder.native = None
        log.warning("decoding without the native step (slower): %s", str(e).splitlines()[0] if str(e) else
                    type(e).__name__)
    return None
