"""One quantized module of a producer's checkpoint as a :class:`~quantizer.methods.transfer.SourceGrid`.

``get(suffix)`` reads the module's tensor ``<module>.<suffix>`` (None where the checkpoint has
none). Layouts, for a weight [N, K] in G groups (``z``: the integer zero point, ``w = (q - z) * s``):

    GPTQ   qweight int32 [K/8, N] (code of row 8i+j at bits 4j), qzeros int32 [G, N/8] (z - 1 for
           the v1 packing, z for v2), scales [G, N], g_idx int32 [K] (each column's group)
    AWQ    qweight int32 [K, N/8], qzeros int32 [G, N/8], both in AWQ's order (channel 8i+ORDER[j]
           at bits 4j), scales [G, N]
    compressed-tensors pack-quantized: weight_packed int32 [N, ceil(K/8)] (along K), weight_shape
           [2], weight_scale [N, G], weight_zero_point int32 [ceil(N/8), G] (along N; absent when
           symmetric: z = 8); codes and zero points stored with 8 added
    cpu_int4  weight_packed uint8 [N, K/2], weight_scale and weight_zero bf16 [N, G] (int4q's grid)
"""

from __future__ import annotations

from typing import Callable

import torch

from ...errors import InputError
from ...methods.codes import MID
from ...methods.transfer import SourceGrid, integer_zero
from ..awq import unpack_awq
from ..gptq_v1 import unpack_int32
from ..packing import unpack_nibbles
from .schemes import SourceScheme

Getter = Callable[[str], "torch.Tensor | None"]
PARTS = {  # the tensors of a quantized module, which the float view replaces by one weight
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"),
    "cpu_int4": ("weight_packed", "weight_scale", "weight_zero"),
}


def _need(get: Getter, module: str, suffix: str) -> torch.Tensor:
    t = get(suffix)
    if t is None:
        raise InputError(f"{module}.{suffix} is missing, which a quantized module of this checkpoint needs")
    return t


def _columns_groups(module: str, k: int, groups: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    """Each column's group [K] int64: the stored g_idx, else runs of K / G columns."""
    if g_idx is None:
        if k % groups:
            raise InputError(f"{module}: {k} columns do not split into its {groups} groups")
        return torch.arange(k) // (k // groups)
    g = g_idx.to(torch.int64).reshape(-1)
    if g.numel() != k or (k and (int(g.min()) < 0 or int(g.max()) >= groups)):
        raise InputError(f"{module}.g_idx does not give each of its {k} columns one of its {groups} groups")
    return g


def _grid(module: str, codes: torch.Tensor, scale: torch.Tensor, points: torch.Tensor,
          g_idx: torch.Tensor | None) -> SourceGrid:
    """codes [N, K]; scale and integer zero points [N, G]."""
    n, k = codes.shape
    if scale.shape != points.shape or scale.shape[0] != n:
        raise InputError(f"{module}: its scales {list(scale.shape)} and zero points {list(points.shape)} do not fit "
                         f"a [{n}, {k}] weight")
    scale = scale.to(torch.float64)
    group = _columns_groups(module, k, scale.shape[1], g_idx)
    return SourceGrid(codes.to(torch.uint8), scale, integer_zero(points, scale), group)


def gptq_grid(get: Getter, module: str, scheme: SourceScheme) -> SourceGrid:
    qweight, qzeros, scales = (_need(get, module, s) for s in PARTS["gptq"][:3])
    codes = unpack_int32(qweight.t().contiguous())  # [N, K]
    points = unpack_int32(qzeros)[:, :codes.shape[0]] + scheme.zero_offset  # [G, N]
    g_idx = get("g_idx")
    return _grid(module, codes, scales.t(), points.t(), g_idx)


def awq_grid(get: Getter, module: str, scheme: SourceScheme) -> SourceGrid:
    qweight, qzeros, scales = (_need(get, module, s) for s in PARTS["awq"])
    return _grid(module, unpack_awq(qweight).t(), scales.t(), unpack_awq(qzeros).t(), None)


def compressed_grid(get: Getter, module: str, scheme: SourceScheme) -> SourceGrid:
    packed, scale = _need(get, module, "weight_packed"), _need(get, module, "weight_scale")
    n, k = (int(v) for v in _need(get, module, "weight_shape").reshape(-1).tolist())
    codes = unpack_int32(packed)[:n, :k]
    stored = get("weight_zero_point")
    if stored is None or scheme.symmetric:
        points = torch.full(scale.shape, MID, dtype=torch.int64)
    else:
        points = unpack_int32(stored.t().contiguous())[:, :n].t()  # [N, G]
    return _grid(module, codes, scale.reshape(n, -1), points, None)


def cpu_int4_grid(get: Getter, module: str, scheme: SourceScheme) -> SourceGrid:
    packed, scale, zero = (_need(get, module, s) for s in PARTS["cpu_int4"])
    codes = unpack_nibbles(packed)
    return SourceGrid(codes, scale.to(torch.float64), zero.to(torch.float64),
                      _columns_groups(module, codes.shape[1], scale.shape[1], None))


GRIDS = {"gptq": gptq_grid, "awq": awq_grid, "compressed-tensors": compressed_grid, "cpu_int4": cpu_int4_grid}


def weight_shape(infos: dict, get: Getter, module: str, scheme: SourceScheme) -> tuple[int, int]:
    """The [N, K] of a quantized module, from its tensors' headers (compressed-tensors: its
    ``weight_shape``)."""
    marker = infos[f"{module}.{scheme.marker}"].shape
    if scheme.method == "gptq":
        return marker[1], marker[0] * 8
    if scheme.method == "awq":
        return marker[1] * 8, marker[0]
    if scheme.method == "compressed-tensors":
        n, k = (int(v) for v in _need(get, module, "weight_shape").reshape(-1).tolist())
        return n, k
    return marker[0], marker[1] * 2
