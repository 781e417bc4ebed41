"""The 8-bit linear and the 8-bit vocabulary lookup: int8 codes [N, K] with one bf16 scale per
output channel. Decode (fewer rows than ``threshold``) runs ``_weight_int8pack_mm``; prefill
dequantizes to bf16 and multiplies through oneDNN (:mod:`.gemm`). A tied head shares the table's buffers."""

from __future__ import annotations

import torch

from ...methods.grid import ChannelQuantized
from .gemm import prefill_linear
from .int4 import takes_prefill_path

ALIGNMENT = 64
"""Bytes on whose boundary the codes start: ``_weight_int8pack_mm`` reads a weight for more than one
row with aligned loads, and one read from a checkpoint (16-byte aligned) crashed it."""


def _aligned(codes: torch.Tensor) -> torch.Tensor:
    return codes if codes.data_ptr() % ALIGNMENT == 0 else codes.clone()


def _dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] from codes [N, K] and scale [N]."""
    return ChannelQuantized(codes, scale.unsqueeze(1)).dequantize(torch.bfloat16)


def _int8_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, threshold: int,
                 prefill_dequant: bool) -> torch.Tensor:
    if takes_prefill_path(x.shape[0], threshold, prefill_dequant):
        return prefill_linear(x, _dequantize(codes, scale))
    return torch.ops.aten._weight_int8pack_mm(x.contiguous(), codes, scale)


@torch.library.custom_op("int4q::int8_linear", mutates_args=())
def int8_linear_op(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, threshold: int,
                   prefill_dequant: bool) -> torch.Tensor:
    """x [M, K] bf16 -> [M, N] bf16. Opaque to torch.compile, so the row-count branch is no guard."""
    return _int8_matmul(x, codes, scale, threshold, prefill_dequant)


@int8_linear_op.register_fake
def _(x, codes, scale, threshold, prefill_dequant):
    return x.new_empty((x.shape[0], codes.shape[0]))


class Int8Linear(torch.nn.Module):
    """y = x W^T (+ b) with W = codes * scale. Buffers: ``codes`` int8 [N, K], ``scale`` bf16 [N]."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, threshold: int = 2, prefill_dequant: bool = True,
                 bias=None):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.threshold, self.prefill_dequant = threshold, prefill_dequant
        self.register_buffer("codes", _aligned(codes), persistent=False)
        self.register_buffer("scale", scale.reshape(-1).to(torch.bfloat16), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.to(torch.bfloat16), persistent=False)

    @property
    def table_key(self) -> torch.Tensor:
        """The buffer a tied table shares with this head."""
        return self.codes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        args = (x2, self.codes, self.scale, self.threshold, self.prefill_dequant)
        out = int8_linear_op(*args) if torch.compiler.is_compiling() else _int8_matmul(*args)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return _dequantize(self.codes, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits=8"


class Int8Lookup(torch.nn.Embedding):
    """The lookup part of an embedding, from 8-bit rows; mixed into the original embedding class
    like the 4-bit lookup, so a class that scales its output (Gemma) still does."""

    def _int8_setup(self, codes: torch.Tensor, scale: torch.Tensor):
        self.table_shape = (self.num_embeddings, self.embedding_dim)
        del self._parameters["weight"]
        self.register_buffer("codes", _aligned(codes), persistent=False)
        self.register_buffer("scale", scale.reshape(-1).to(torch.bfloat16), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """Shape and dtype only (on the meta device): the table is never materialised."""
        return torch.empty(self.table_shape, dtype=torch.bfloat16, device="meta")

    @property
    def table_key(self) -> torch.Tensor:
        return self.codes

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        rows = _dequantize(self.codes.index_select(0, ids), self.scale.index_select(0, ids))
        return rows.reshape(*input_ids.shape, self.embedding_dim)

    def dequantized_weight(self) -> torch.Tensor:
        return _dequantize(self.codes, self.scale)

    def drop_quantized(self) -> None:
        for buf in ("codes", "scale"):
            delattr(self, buf)


def int8_embedding_module(module: torch.nn.Embedding, codes: torch.Tensor, scale: torch.Tensor) -> torch.nn.Embedding:
    """Turn ``module`` (nn.Embedding or a subclass) into an int8 lookup of the same class family."""
    cls = type(module)
    module.__class__ = Int8Lookup if cls is torch.nn.Embedding else type(f"Int8{cls.__name__}", (cls, Int8Lookup), {})
    module._int8_setup(codes, scale)
    module._quant_original_class = cls
    return module


def int8_tied_head(embedding: Int8Lookup, **kwargs) -> Int8Linear:
    """An Int8Linear over the table's own buffers (kwargs as Int8Linear)."""
    return Int8Linear(embedding.codes, embedding.scale, **kwargs)
