"""The GPTQ checkpoint format (v1, ``checkpoint_format: gptq``), read by vLLM's W4A8 CPU path
and GPTQ loaders.

Per linear ``<name>`` with weight [N, K] and G = K / group groups:

    qweight int32 [K / 8, N]  8 codes along K, code of row k = 8i + j at bits 4j of qweight[i]
    qzeros  int32 [G, N / 8]  (zero point - 1) of channels n = 8i + j at bits 4j of qzeros[g, i]
    scales  fp16  [G, N]
    g_idx   int32 [K]         k // group (static groups: desc_act false)

    w[n, k] = (q[n, k] - (stored zero + 1)) * scale[g, n]
"""

from __future__ import annotations

import torch

from ..io.shards import TensorSpec
from ..methods.grid import INTEGER_ZERO, MID, GroupQuantized, Storage
from ..schema.scheme import GROUP_SIZES, ModuleScheme
from .packing import PACK_N_ALIGN
from .spec_check import export_problems

SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)


def pack_int32(values: torch.Tensor) -> torch.Tensor:
    """[..., 8m] ints in 0..15 -> [..., m] int32, element j of each 8 at bits 4j (two's complement)."""
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, 8)
    packed = (v << SHIFTS).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int32: [..., m] int32 -> [..., 8m] int64 in 0..15."""
    p = packed.to(torch.int64) & 0xFFFFFFFF
    return ((p.unsqueeze(-1) >> SHIFTS) & 0xF).reshape(*packed.shape[:-1], -1)


def zero_points(gq: GroupQuantized) -> torch.Tensor:
    """Integer zero points z [N, G] of a weight quantized on INTEGER_ZERO storage: zero = (8 - z) * scale."""
    s, zf = gq.scale.to(torch.float32), gq.zero.to(torch.float32)
    z = torch.where(s == 0, torch.full_like(s, float(MID)), MID - zf / torch.where(s == 0, 1.0, s))
    zi = torch.round(z)
    if not torch.equal(zi, z) or zi.min() < 1 or zi.max() > 15:
        raise ValueError("zero points are not integers in [1, 15]; quantize with storage=INTEGER_ZERO")
    return zi.to(torch.int64)


def gptq_tensors(module: str, gq: GroupQuantized) -> dict[str, torch.Tensor]:
    """The four GPTQ-format tensors of one linear."""
    k = gq.codes.shape[1]
    group = gq.group_size
    return {
        f"{module}.qweight": pack_int32(gq.codes).t().contiguous(),
        f"{module}.qzeros": pack_int32((zero_points(gq) - 1).t().contiguous()),
        f"{module}.scales": gq.scale.t().contiguous().to(torch.float16),
        f"{module}.g_idx": (torch.arange(k) // group).to(torch.int32),
    }


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] fp32 that a GPTQ loader computes from the four tensors."""
    codes = unpack_int32(qweight.t().contiguous()).t()  # [K, N]
    zeros = unpack_int32(qzeros) + 1  # [G, N]
    g = g_idx.long()
    w = (codes - zeros[g]).to(torch.float32) * scales[g].to(torch.float32)
    return w.t().contiguous()


DEFAULT_DAMP = 0.01  # what the loaders' configs expect when no GPTQ solve set it (round-to-nearest)


def gptq_quantization_config(group_size: int, symmetric: bool, lm_head: bool = False,
                             damp: float = DEFAULT_DAMP) -> dict:
    """The config GPTQ loaders read: transformers/optimum and GPTQModel validate ``damp_percent``
    as a number in (0, 1) and ``lm_head`` says whether the head is stored quantized."""
    return {
        "quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": symmetric,
        "lm_head": lm_head, "checkpoint_format": "gptq", "true_sequential": True, "damp_percent": damp,
        "static_groups": False, "meta": {"quantizer": [f"int4q:{_version()}"]},
    }


def _version() -> str:
    from ..version import __version__

    return __version__


SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


class GptqV1Format:
    name = quant_method = "gptq"
    title, description = "GPTQ", "GPTQ v1 (qweight/qzeros/scales/g_idx)"
    quantizes_embedding, marker = False, "qweight"
    # GPTQModel loads an asymmetric v1 checkpoint only from its own quantizer; transformers'
    # GPTQ route (optimum) swaps only the linears under model.layers, so a quantized head would
    # be dropped there. The defaults open in every loader; --head-bits 4 is for vLLM, --asym for
    # transformers (vLLM 0.32 maps no asymmetric GPTQ config).
    default_symmetric, head_kept_by_default = True, True
    bits = (4,)
    single_file, group_sizes, out_dim_multiple = False, GROUP_SIZES, PACK_N_ALIGN
    one_group_size = True
    read_by = "vLLM and GPTQ loaders"

    head_bits = None

    def grid_storage(self, scheme: ModuleScheme, k: int) -> Storage:
        return INTEGER_ZERO

    def tensor_specs(self, module: str, shape: tuple[int, ...], scheme: ModuleScheme) -> list[TensorSpec]:
        n, k = shape
        groups = k // scheme.group_size
        return [TensorSpec(f"{module}.qweight", torch.int32, (k // 8, n)),
                TensorSpec(f"{module}.qzeros", torch.int32, (groups, n // 8)),
                TensorSpec(f"{module}.scales", torch.float16, (groups, n)),
                TensorSpec(f"{module}.g_idx", torch.int32, (k,))]

    def tensors(self, module: str, gq: GroupQuantized, scheme: ModuleScheme) -> dict[str, torch.Tensor]:
        return gptq_tensors(module, gq)

    def fit_schemes(self, schemes: dict[str, ModuleScheme], k_dims: dict[str, int], source=None,
                    calibrated: bool = False) -> dict[str, str]:
        return {}

    def quantization_config(self, qconfig, head_quantized: bool) -> dict:
        damp = (qconfig.calibration or {}).get("damp") or DEFAULT_DAMP
        return gptq_quantization_config(qconfig.group_size, qconfig.symmetric, head_quantized, damp)

    def module_problems(self, module: str, infos: dict, scheme: ModuleScheme) -> list[str]:
        return export_problems(self, module, infos, scheme, SUFFIXES, lambda qweight: (qweight[1], 8 * qweight[0]))


FORMAT = GptqV1Format()
