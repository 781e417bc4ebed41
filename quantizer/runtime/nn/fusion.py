"""Fewer, larger kernel calls: sibling int4 linears that read the same input (q/k/v, gate/up)
become one :class:`Int4Group` over the concatenated output channels.

Each original module is replaced by an :class:`Int4Slice` of the shared group, so the model's
own forward code still calls ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)``; the group computes
once per input and hands each member its output. Decode makes one kernel call for the group:
tinygemm computes each 64-channel block on its own, so a member's bits are its unfused layer's.
Prefill dequantizes the group's weight once but multiplies each member's rows separately: oneDNN's
blocking, hence its rounding, can depend on the number of output channels.
"""

from __future__ import annotations

import torch

from ...formats.packing import TINYGEMM_N_BLOCK, codes_from_int4pack, pack_nibbles
from .gemm import prefill_linear
from .int4 import Int4Linear, with_bias

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Child names that read the same input in the transformers architectures that have them."""


class Int4Group(torch.nn.Module):
    """A fused Int4Linear whose members' outputs are computed together, once per input tensor."""

    def __init__(self, linear: Int4Linear, sizes: list[int]):
        super().__init__()
        self.linear = linear
        self.sizes = sizes
        self._key = None
        self._outs = None
        self._pending = 0

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each member's output for ``x`` [..., K], as its unfused layer computes it."""
        weight = self.linear.prefill_weight(x.numel() // x.shape[-1])
        if weight is None:
            return list(self.linear(x).split(self.sizes, dim=-1))
        x2, bias = x.reshape(-1, x.shape[-1]).to(torch.bfloat16), self.linear.bias
        biases = [None] * len(self.sizes) if bias is None else bias.split(self.sizes)
        return [with_bias(prefill_linear(x2, rows), b, x.shape[:-1])
                for rows, b in zip(weight.split(self.sizes), biases)]

    def shared(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Member ``index``'s output for ``x``; the members after the first reuse it (eager only)."""
        if torch.compiler.is_compiling():
            return self(x)[index]
        key = (x, None if x.is_inference() else x._version)  # inference tensors have no version counter
        if self._pending and self._key[0] is x and self._key[1] == key[1]:
            outs = self._outs
            self._pending -= 1
        else:
            outs = self(x)
            self._pending = len(self.sizes) - 1
        # Released once every member has read it, so no activation outlives the step.
        self._key, self._outs = (key, outs) if self._pending else (None, None)
        return outs[index]


class Int4Slice(torch.nn.Module):
    """Member ``index`` of an :class:`Int4Group`, output channels [start, stop) of the fused layer;
    stands where the original linear was."""

    def __init__(self, group: Int4Group, index: int):
        super().__init__()
        object.__setattr__(self, "group", group)  # not a child: the parent owns the group
        self.index = index
        self.start = sum(group.sizes[:index])
        self.stop = self.start + group.sizes[index]
        self.in_features = group.linear.in_features
        self.out_features = self.stop - self.start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.shared(x, self.index)

    def dequantized_weight(self) -> torch.Tensor:
        return self.group.linear.dequantized_weight()[self.start : self.stop]

    @property
    def bias(self) -> torch.Tensor | None:
        bias = self.group.linear.bias
        return None if bias is None else bias[self.start : self.stop]

    def extra_repr(self) -> str:
        return f"channels [{self.start}, {self.stop}) of a fused group"


def row_major_tensors(linear: Int4Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed [N, K/2] uint8, scale [N, G], zero [N, G]) of a layer, from whichever copy it holds."""
    if linear.packed is not None:
        return linear.packed, linear.scale, linear.zero
    return pack_nibbles(codes_from_int4pack(linear.int4pack)), linear.sz[..., 0].t(), linear.sz[..., 1].t()


def fuse_linears(members: list[Int4Linear]) -> Int4Linear:
    """One Int4Linear computing ``cat([m(x) for m in members], -1)``; members must share K and group."""
    first = members[0]
    if any(m.in_features != first.in_features or m.group_size != first.group_size for m in members):
        raise ValueError("fused linears need the same input size and group size")
    biases = [m.bias if m.bias is not None else torch.zeros(m.out_features, dtype=torch.bfloat16) for m in members]
    bias = torch.cat(biases) if any(m.bias is not None for m in members) else None
    kwargs = dict(threshold=first.threshold, prefill_dequant=first.prefill_dequant,
                  direct_dequant=first.direct, use_custom_op=first.use_custom_op, bias=bias,
                  int8_decode=first.int8_decode, int8_prefill=first.int8_prefill)
    whole_blocks = all(m.out_features % TINYGEMM_N_BLOCK == 0 for m in members)
    row_major = None
    if not whole_blocks or any(m.packed is not None for m in members):
        parts = [row_major_tensors(m) for m in members]
        row_major = tuple(torch.cat([p[i] for p in parts]).contiguous() for i in range(3))
    if whole_blocks:  # the kernel layout is whole 64-channel blocks: stacking them is exact
        int4pack = torch.cat([m.int4pack for m in members])
        sz = torch.cat([m.sz for m in members], dim=1)
        return Int4Linear(int4pack, sz, first.group_size, row_major=row_major, **kwargs)
    return Int4Linear.from_row_major(*row_major, first.group_size, **kwargs)


def fuse_projections(model: torch.nn.Module) -> int:
    """Fuse every sibling set of :data:`SIBLINGS` that are all Int4Linear with one K and group size.

    Returns the number of groups made. The model computes the same function afterwards.
    """
    made = 0
    for parent in list(model.modules()):
        for names in SIBLINGS:
            members = [getattr(parent, n, None) for n in names]
            if not all(type(m) is Int4Linear for m in members):
                continue
            if len({(m.in_features, m.group_size, m.threshold, m.prefill_dequant, m.int8_decode, m.int8_prefill)
                    for m in members}) != 1:
                continue
            group = Int4Group(fuse_linears(members), [m.out_features for m in members])
            parent.add_module("_".join(names) + "_fused", group)
            for index, name in enumerate(names):
                setattr(parent, name, Int4Slice(group, index))
            made += 1
    return made
