"""The AWQ (GEMM) checkpoint format: asymmetric 4-bit grids with integer zero points, which vLLM's
CPU backend runs through its W4A16 kernel (it maps no asymmetric GPTQ config).

Per linear ``<name>`` with weight [N, K] and G = K / group groups, packed along N in AWQ's order
(the code of output channel 8i + ORDER[j] at bits 4j of word i):

    qweight int32 [K, N / 8]   codes
    qzeros  int32 [G, N / 8]   zero points z
    scales  fp16  [G, N]

    w[n, k] = (q[n, k] - z[g, n]) * scale[g, n]     (int4q's grid with zero = (8 - z) * scale)
"""

from __future__ import annotations

import torch

from ..io.shards import TensorSpec
from ..methods.grid import GroupQuantized
from ..schema.scheme import ModuleScheme
from .gptq_v1 import GptqV1Format, pack_int32, unpack_int32, zero_points
from .spec_check import export_problems

ORDER = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
UNORDER = torch.argsort(ORDER)
SUFFIXES = ("qweight", "qzeros", "scales")


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, 8m] ints 0..15 (columns = output channels) -> [R, m] int32 in AWQ's order."""
    r, n = values.shape
    return pack_int32(values.reshape(r, n // 8, 8)[..., ORDER].reshape(r, n))


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_awq: [R, m] int32 -> [R, 8m] int64."""
    r, m = packed.shape
    return unpack_int32(packed).reshape(r, m, 8)[..., UNORDER].reshape(r, 8 * m)


def awq_tensors(module: str, gq: GroupQuantized) -> dict[str, torch.Tensor]:
    """The three AWQ tensors of one linear."""
    return {
        f"{module}.qweight": pack_awq(gq.codes.t().contiguous()),
        f"{module}.qzeros": pack_awq(zero_points(gq).t().contiguous()),
        f"{module}.scales": gq.scale.t().contiguous().to(torch.float16),
    }


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] fp32 that an AWQ loader computes from the three tensors."""
    codes, zeros = unpack_awq(qweight), unpack_awq(qzeros)  # [K, N], [G, N]
    group = codes.shape[0] // zeros.shape[0]
    g = torch.arange(codes.shape[0]) // group
    return ((codes - zeros[g]).to(torch.float32) * scales[g].to(torch.float32)).t().contiguous()


class AwqFormat(GptqV1Format):
    """The GPTQ export's grids and limits, in AWQ's tensors and config."""

    name = quant_method = "awq"
    title, description = "AWQ", "AWQ GEMM (qweight/qzeros/scales, asymmetric)"
    default_symmetric = False
    read_by = "vLLM (CPU: its W4A16 kernel) and AWQ loaders"

    def tensor_specs(self, module: str, shape: tuple[int, ...], scheme: ModuleScheme) -> list[TensorSpec]:
        n, k = shape
        groups = k // scheme.group_size
        return [TensorSpec(f"{module}.qweight", torch.int32, (k, n // 8)),
                TensorSpec(f"{module}.qzeros", torch.int32, (groups, n // 8)),
                TensorSpec(f"{module}.scales", torch.float16, (groups, n))]

    def tensors(self, module: str, gq: GroupQuantized, scheme: ModuleScheme) -> dict[str, torch.Tensor]:
        return awq_tensors(module, gq)

    def quantization_config(self, qconfig, head_quantized: bool) -> dict:
        return {"quant_method": "awq", "bits": 4, "group_size": qconfig.group_size, "zero_point": True,
                "version": "gemm", "lm_head": head_quantized, "modules_to_not_convert": list(qconfig.ignore)}

    def module_problems(self, module: str, infos: dict, scheme: ModuleScheme) -> list[str]:
        return export_problems(self, module, infos, scheme, SUFFIXES, lambda qweight: (8 * qweight[1], qweight[0]))


FORMAT = AwqFormat()
