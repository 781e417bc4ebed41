"""The cpu_int4 format, the one int4q's runtime runs. Per 4-bit module ``<name>`` with a
[N, K] weight at group size g:

    <name>.weight_packed  uint8 [N, K / 2]  byte j = code[2j] | code[2j + 1] << 4
    <name>.weight_scale   bf16  [N, K / g]
    <name>.weight_zero    bf16  [N, K / g]  w = (q - 8) * scale + zero

and per 8-bit module (its ``quantization_config.modules`` entry says ``bits: 8``):

    <name>.weight_packed  int8  [N, K]      one code per byte
    <name>.weight_scale   bf16  [N, 1]      w = q * scale
"""

from __future__ import annotations

import torch

from ..errors import InputError
from ..io.shards import TensorSpec
from ..methods.grid import BF16, ChannelQuantized, GroupQuantized, Storage
from ..schema.scheme import GROUP_SIZES, ModuleScheme
from .packing import PACK_N_ALIGN, pack_nibbles

SUFFIXES = ("weight_packed", "weight_scale", "weight_zero")


class CpuInt4Format:
    name = quant_method = title = "cpu_int4"
    quantizes_embedding, marker = True, "weight_packed"
    default_symmetric, head_kept_by_default = False, False
    bits = (4, 8)
    single_file, group_sizes, out_dim_multiple = False, GROUP_SIZES, PACK_N_ALIGN
    one_group_size = False
    description = "cpu_int4 (uint8 nibbles, bf16 scale and zero per group)"
    read_by = "int4q's runtime and vLLM's cpu_int4 reader"

    head_bits = None

    def grid_storage(self, scheme: ModuleScheme, k: int) -> Storage:
        return BF16

    def tensor_specs(self, module: str, shape: tuple[int, ...], scheme: ModuleScheme) -> list[TensorSpec]:
        n, k = shape
        if scheme.bits == 8:
            return [TensorSpec(f"{module}.weight_packed", torch.int8, (n, k)),
                    TensorSpec(f"{module}.weight_scale", torch.bfloat16, (n, 1))]
        groups = (n, k // scheme.group_size)
        return [TensorSpec(f"{module}.weight_packed", torch.uint8, (n, k // 2)),
                TensorSpec(f"{module}.weight_scale", torch.bfloat16, groups),
                TensorSpec(f"{module}.weight_zero", torch.bfloat16, groups)]

    def tensors(self, module: str, quantized: GroupQuantized | ChannelQuantized,
                scheme: ModuleScheme) -> dict[str, torch.Tensor]:
        if isinstance(quantized, ChannelQuantized):
            values = (quantized.codes, quantized.scale)
        else:
            values = (pack_nibbles(quantized.codes), quantized.scale, quantized.zero)
        return {f"{module}.{suffix}": t for suffix, t in zip(SUFFIXES, values)}

    def fit_schemes(self, schemes: dict[str, ModuleScheme], k_dims: dict[str, int], source=None,
                    calibrated: bool = False) -> dict[str, str]:
        return {}

    def quantization_config(self, qconfig, head_quantized: bool) -> dict:
        return qconfig.to_dict()

    def module_problems(self, module: str, infos: dict, scheme: ModuleScheme) -> list[str]:
        if scheme.bits not in self.bits:
            return [f"{module}: quantization_config gives it {scheme.bits} bits; {self.name} tensors hold 4 or 8"]
        names = [f"{module}.{s}" for s in _suffixes(scheme)]
        missing = [n for n in names if n not in infos]
        if missing:
            return [f"{missing[0]}: missing"]
        packed = infos[names[0]]
        if len(packed.shape) != 2:
            return [f"{packed.name}: expected a 2-D tensor, got shape {list(packed.shape)}"]
        n, cols = packed.shape
        k = cols if scheme.bits == 8 else 2 * cols
        if scheme.bits == 4 and k % scheme.group_size:
            return [f"{names[1]}: shape {list(infos[names[1]].shape)} does not match group_size {scheme.group_size} "
                    f"for K={k} (expected K divisible by the group)"]
        want = {s.name: s for s in self.tensor_specs(module, (n, k), scheme)}
        return [_mismatch(infos[name], spec, scheme) for name, spec in want.items()
                if (infos[name].dtype, tuple(infos[name].shape)) != (spec.dtype, spec.shape)]

    def read_module(self, reader, module: str, scheme: ModuleScheme) -> tuple[torch.Tensor, ...]:
        """(packed, scale, zero) of a 4-bit module, (codes, scale) of an 8-bit one; InputError
        naming the first problem."""
        problems = self.module_problems(module, reader.infos, scheme)
        if problems:
            raise InputError(problems[0])
        return tuple(reader.get(f"{module}.{s}") for s in _suffixes(scheme))


def _suffixes(scheme: ModuleScheme) -> tuple[str, ...]:
    """An 8-bit module has no zero."""
    return SUFFIXES[:2] if scheme.bits == 8 else SUFFIXES


def _mismatch(info, spec: TensorSpec, scheme: ModuleScheme) -> str:
    if info.dtype != spec.dtype:
        return f"{info.name}: dtype {info.dtype}, expected {spec.dtype} for a {scheme.bits}-bit module"
    what = f"group_size {scheme.group_size}" if scheme.bits == 4 else "one scale per channel"
    return f"{info.name}: shape {list(info.shape)} does not match {what} (expected {list(spec.shape)})"


FORMAT = CpuInt4Format()
