"""The int4 linear and the int4 vocabulary lookup.

Decode (fewer rows than ``dequant_threshold``) multiplies the packed weight directly (the kernels
of :mod:`..native.gemv_rows`); prefill dequantizes to bf16 (the native kernel of :mod:`.native`)
and multiplies through oneDNN (:mod:`.gemm`). With ``direct_dequant`` the prefill path decodes the
kernel's own layout, so no second copy of the weight is resident; a layer whose N does not tile the
64-channel block, or a CPU whose layout fails the probe (AVX2 without AVX-512), keeps a row-major
copy instead, which its decode then reads. Rows chosen for int8 activations (:mod:`..activations`)
go through :mod:`..native.w4a8` (the kernel layout, AVX-512 VNNI) or, decode rows only,
:mod:`..native.w4a8_rows` (the row-major copy, AVX2).
"""

from __future__ import annotations

import logging

import torch

from ...formats.packing import (
    TINYGEMM_N_BLOCK,
    kernel_layout_matches,
    scales_and_zeros,
    supports_direct_dequant,
    to_int4pack,
    unpack_nibbles,
)
from ...methods.grid import dequantize_codes
from ..kernels.dequant import dequantize_int4pack
from ..kernels.gemv_rows import decode_matmul
from ..kernels.w4a8 import w4a8_usable
from ..kernels.w4a8_rows import ROWS_LIMIT, w4a8_rows_usable
from .gemm import prefill_linear

log = logging.getLogger(__name__)
_warned_layout = False


@torch.library.custom_op("int4q::linear", mutates_args=())
def int4_linear_op(
    x: torch.Tensor, int4pack: torch.Tensor, sz: torch.Tensor, group_size: int, threshold: int, prefill_dequant: bool,
    direct: bool, packed: torch.Tensor | None, scale: torch.Tensor | None, zero: torch.Tensor | None,
    int8_decode: bool, int8_prefill: bool,
) -> torch.Tensor:
    """x [M, K] bf16 -> [M, N] bf16. Opaque to torch.compile, so the row-count branch is no guard."""
    return _int4_matmul(x, int4pack, sz, group_size, threshold, prefill_dequant, direct, packed, scale, zero,
                        int8_decode, int8_prefill)


@int4_linear_op.register_fake
def _(x, int4pack, sz, group_size, threshold, prefill_dequant, direct, packed, scale, zero, int8_decode,
      int8_prefill):
    return x.new_empty((x.shape[0], int4pack.shape[0]))


def takes_prefill_path(rows: int, threshold: int, prefill_dequant: bool) -> bool:
    """Whether a quantized linear multiplies ``rows`` rows by its dequantized bf16 weight (prefill)
    rather than through its decode kernel: from ``threshold`` rows on, where prefill_dequant is on."""
    return prefill_dequant and rows >= threshold


def int8_operator(rows: int, threshold: int, int8_decode: bool, int8_prefill: bool, int4pack: torch.Tensor,
                  group_size: int, packed: torch.Tensor | None) -> str | None:
    """The operator that multiplies ``rows`` rows with int8 activations, or None for the exact
    paths: decode (fewer rows than ``threshold``) or prefill, as chosen. A layer that keeps its
    row-major tensors (``packed``: the kernel layout is not int4q's on this CPU, or N does not tile
    it) takes ``w4a8_rows`` for up to its ``ROWS_LIMIT`` rows where it reads them; any other layer
    ``w4a8_mm`` where it reads the kernel layout on this machine."""
    if not (int8_decode if rows < threshold else int8_prefill):
        return None
    if packed is not None:
        return "w4a8_rows" if rows <= ROWS_LIMIT and w4a8_rows_usable(packed, group_size) else None
    return "w4a8_mm" if w4a8_usable(int4pack, group_size) else None


def _int4_matmul(x, int4pack, sz, group_size, threshold, prefill_dequant, direct, packed, scale, zero,
                 int8_decode, int8_prefill):
    int8 = int8_operator(x.shape[0], threshold, int8_decode, int8_prefill, int4pack, group_size, packed)
    if int8 == "w4a8_mm":
        return torch.ops.int4q_native.w4a8_mm(x, int4pack, sz, group_size)
    if int8 == "w4a8_rows":
        return torch.ops.int4q_native.w4a8_rows(x, packed, scale, zero, group_size)
    weight = None
    if takes_prefill_path(x.shape[0], threshold, prefill_dequant):
        weight = _prefill_weight(int4pack, sz, group_size, direct, packed, scale, zero)
    if weight is not None:
        return prefill_linear(x, weight)
    return decode_matmul(x, int4pack, sz, group_size, None if packed is None else (packed, scale, zero))


def with_bias(out: torch.Tensor, bias: torch.Tensor | None, lead_shape) -> torch.Tensor:
    """``out`` [M, N] plus ``bias`` [N] (a separate bf16 add, rounded as eager rounds it), shaped
    [*lead_shape, N]."""
    if bias is not None:
        out = out + bias
    return out.reshape(*lead_shape, out.shape[-1])


def _prefill_weight(int4pack, sz, group_size, direct, packed, scale, zero) -> torch.Tensor | None:
    """The bf16 weight [N, K] a prefill GEMM uses (transient: see :func:`.native.dequantize_int4pack`),
    or None when the layer keeps no copy to dequantize for prefill."""
    if direct:
        return dequantize_int4pack(int4pack, sz, group_size, transient=True)
    if packed is not None:
        return dequantize_codes(unpack_nibbles(packed), scale, zero)
    return None


def _layout_usable(n: int) -> bool:
    global _warned_layout
    if not supports_direct_dequant(n):
        return False
    if kernel_layout_matches(n):
        return True
    if not _warned_layout:
        log.warning("the tinygemm weight layout on this CPU is not the one int4q decodes; keeping row-major copies "
                    "beside it (decode and prefill read those)")
        _warned_layout = True
    return False


class Int4Linear(torch.nn.Module):
    """y = x W^T (+ b) with W stored as 4-bit codes in the tinygemm layout plus [G, N, 2] bf16 params.

    Buffers: ``int4pack`` uint8 [N, K/2], ``sz`` bf16 [G, N, 2]; ``packed``/``scale``/``zero``
    (row-major) only when the prefill path cannot decode the kernel layout. ``int8_decode`` and
    ``int8_prefill``: multiply those rows with int8 activations (see :mod:`..activations`).
    """

    def __init__(self, int4pack, sz, group_size: int, threshold: int = 2, prefill_dequant: bool = True,
                 direct_dequant: bool = True, use_custom_op: bool = True, bias=None, row_major=None,
                 int8_decode: bool = False, int8_prefill: bool = False):
        super().__init__()
        self.out_features, half = int4pack.shape
        self.in_features = half * 2
        self.group_size = group_size
        self.threshold, self.prefill_dequant = threshold, prefill_dequant
        self.use_custom_op = use_custom_op
        self.int8_decode, self.int8_prefill = int8_decode, int8_prefill
        self.register_buffer("int4pack", int4pack, persistent=False)
        self.register_buffer("sz", sz, persistent=False)
        self.direct = bool(prefill_dequant and direct_dequant and _layout_usable(self.out_features))
        keep_row_major = prefill_dequant and not self.direct
        if keep_row_major and row_major is None:
            raise ValueError("a row-major copy is needed for this layer's prefill path")
        packed, scale, zero = row_major if keep_row_major else (None, None, None)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("zero", zero, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.to(torch.bfloat16), persistent=False)

    @classmethod
    def from_row_major(cls, packed, scale, zero, group_size, **kwargs) -> "Int4Linear":
        """Build from checkpoint tensors (packed [N, K/2] uint8, scale/zero [N, G] bf16)."""
        return cls(to_int4pack(packed), scales_and_zeros(scale, zero), group_size,
                   row_major=(packed, scale, zero), **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        args = (x2, self.int4pack, self.sz, self.group_size, self.threshold, self.prefill_dequant, self.direct,
                self.packed, self.scale, self.zero, self.int8_decode, self.int8_prefill)
        if self.use_custom_op and torch.compiler.is_compiling():
            out = int4_linear_op(*args)
        else:  # eager: the op's dispatch would only add overhead
            out = _int4_matmul(*args)
        return with_bias(out, self.bias, shape[:-1])

    def prefill_weight(self, rows: int) -> torch.Tensor | None:
        """The transient bf16 weight [N, K] that :meth:`forward` multiplies ``rows`` rows by in eager
        mode, or None where those rows go through the decode kernel (or torch.compile traces)."""
        if not takes_prefill_path(rows, self.threshold, self.prefill_dequant) or (
                self.use_custom_op and torch.compiler.is_compiling()) or int8_operator(
                rows, self.threshold, self.int8_decode, self.int8_prefill, self.int4pack, self.group_size,
                self.packed) is not None:
            return None
        return _prefill_weight(self.int4pack, self.sz, self.group_size, self.direct, self.packed, self.scale,
                               self.zero)

    @property
    def table_key(self) -> torch.Tensor:
        """The buffer a tied table shares with this head."""
        return self.int4pack

    def dequantized_weight(self) -> torch.Tensor:
        """The bf16 weight [N, K] this layer computes with (for verification)."""
        return _dequantized_weight(self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"direct_dequant={self.direct}, int8_decode={self.int8_decode}, int8_prefill={self.int8_prefill}")


class Int4Lookup(torch.nn.Embedding):
    """The lookup part of an embedding, from 4-bit rows. Mixed into the original embedding class
    (see :func:`quantize_embedding_module`) so that whatever that class does around
    ``super().forward`` (Gemma scales by sqrt(hidden)) still happens.

    Rows come from the tinygemm layout when a tied head shares it (no second copy), else from
    row-major ``packed``/``scale``/``zero``.
    """

    def _int4_setup(self, int4pack, sz, row_major, group_size: int):
        self.group_size = group_size
        self.table_shape = (self.num_embeddings, self.embedding_dim)
        del self._parameters["weight"]
        self.register_buffer("int4pack", int4pack, persistent=False)
        self.register_buffer("sz", sz, persistent=False)
        packed, scale, zero = row_major if row_major is not None else (None, None, None)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("zero", zero, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """Shape and dtype only (on the meta device): the table is never materialised."""
        return torch.empty(self.table_shape, dtype=torch.bfloat16, device="meta")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        if self.packed is not None:
            codes = unpack_nibbles(self.packed.index_select(0, ids))
            scale, zero = self.scale.index_select(0, ids), self.zero.index_select(0, ids)
        else:
            codes = _rows_from_int4pack(self.int4pack, ids)
            scale, zero = self.sz[:, ids, 0].t(), self.sz[:, ids, 1].t()
        rows = dequantize_codes(codes, scale, zero)
        return rows.reshape(*input_ids.shape, self.embedding_dim)

    @property
    def table_key(self) -> torch.Tensor | None:
        return self.int4pack

    def dequantized_weight(self) -> torch.Tensor:
        """The bf16 table [N, K]."""
        return _dequantized_weight(self)

    def drop_quantized(self) -> None:
        for buf in ("int4pack", "sz", "packed", "scale", "zero"):
            delattr(self, buf)


def _dequantized_weight(module) -> torch.Tensor:
    """From the row-major copy when the module keeps one, else from the kernel layout."""
    if module.packed is not None:
        return dequantize_codes(unpack_nibbles(module.packed), module.scale, module.zero)
    return dequantize_int4pack(module.int4pack, module.sz, module.group_size)


def _rows_from_int4pack(int4pack: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Codes [T, K] of rows ``ids`` read from the kernel layout (N a multiple of 64)."""
    n, half = int4pack.shape
    runs = int4pack.view(n // TINYGEMM_N_BLOCK, half * 2, TINYGEMM_N_BLOCK // 2)
    within = ids % TINYGEMM_N_BLOCK
    bytes_ = runs[ids // TINYGEMM_N_BLOCK, :, within % (TINYGEMM_N_BLOCK // 2)]  # [T, K]
    return torch.where((within < TINYGEMM_N_BLOCK // 2).unsqueeze(1), bytes_ & 0x0F, bytes_ >> 4)


def quantize_embedding_module(module: torch.nn.Embedding, packed, scale, zero, group_size: int,
                              with_kernel_layout: bool) -> torch.nn.Embedding:
    """Turn ``module`` (nn.Embedding or a subclass) into an int4 lookup of the same class family.

    With ``with_kernel_layout`` (a tied head will share it) the table is held once, in the
    tinygemm layout, when this CPU's layout can be decoded row by row.
    """
    cls = type(module)
    original_class = cls
    if cls is torch.nn.Embedding:
        new_cls = Int4Lookup
    else:
        # MRO: cls -> Int4Lookup -> nn.Embedding, so cls.forward's super().forward() is our lookup.
        new_cls = type(f"Int4{cls.__name__}", (cls, Int4Lookup), {})
    module.__class__ = new_cls
    int4pack = sz = None
    row_major = (packed, scale, zero)
    if with_kernel_layout:
        int4pack, sz = to_int4pack(packed), scales_and_zeros(scale, zero)
        n = packed.shape[0]
        if n % TINYGEMM_N_BLOCK == 0 and _layout_usable(n):
            row_major = None
    module._int4_setup(int4pack, sz, row_major, group_size)
    module._quant_original_class = original_class
    return module


def tied_head(embedding: torch.nn.Module, **kwargs) -> Int4Linear:
    """An Int4Linear that shares the quantized table's kernel-layout tensors and group size
    (kwargs as Int4Linear)."""
    row_major = (embedding.packed, embedding.scale, embedding.zero) if embedding.packed is not None else None
    return Int4Linear(embedding.int4pack, embedding.sz, embedding.group_size, row_major=row_major, **kwargs)


