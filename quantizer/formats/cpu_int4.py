"""The cpu_int4 format, the one int4q's runtime runs. Per quantized module ``<name>`` with a
[N, K] weight at group size g:

    <name>.weight_packed  uint8 [N, K / 2]  byte j = code[2j] | code[2j + 1] << 4
    <name>.weight_scale   bf16  [N, K / g]
    <name>.weight_zero    bf16  [N, K / g]  w = (q - 8) * scale + zero
"""

from __future__ import annotations

import torch

from ..errors import InputError
from ..grid import GroupQuantized
from ..packing import pack_nibbles
from ..scheme import ModuleScheme
from ..shards import TensorSpec

SUFFIXES = ("weight_packed", "weight_scale", "weight_zero")


class CpuInt4Format:
    name = quant_method = title = "cpu_int4"
    integer_zero, quantizes_embedding, marker = False, True, "weight_packed"
    description = "cpu_int4 (uint8 nibbles, bf16 scale and zero per group)"
    read_by = "int4q's runtime and vLLM's cpu_int4 reader"

    def tensor_specs(self, module: str, shape: tuple[int, ...], scheme: ModuleScheme) -> list[TensorSpec]:
        n, k = shape
        groups = (n, k // scheme.group_size)
        return [TensorSpec(f"{module}.weight_packed", torch.uint8, (n, k // 2)),
                TensorSpec(f"{module}.weight_scale", torch.bfloat16, groups),
                TensorSpec(f"{module}.weight_zero", torch.bfloat16, groups)]

    def tensors(self, module: str, gq: GroupQuantized) -> dict[str, torch.Tensor]:
        values = (pack_nibbles(gq.codes), gq.scale, gq.zero)
        return {f"{module}.{suffix}": t for suffix, t in zip(SUFFIXES, values)}

    def quantization_config(self, qconfig) -> dict:
        return qconfig.to_dict()

    def module_problems(self, module: str, infos: dict, scheme: ModuleScheme) -> list[str]:
        if scheme.bits != 4:
            return [f"{module}: quantization_config gives it {scheme.bits} bits; {self.name} tensors hold 4"]
        missing = [f"{module}.{s}" for s in SUFFIXES if f"{module}.{s}" not in infos]
        if missing:
            return [f"{missing[0]}: missing"]
        packed, scale, zero = (infos[f"{module}.{s}"] for s in SUFFIXES)
        if packed.dtype != torch.uint8 or len(packed.shape) != 2:
            return [f"{packed.name}: expected a 2-D uint8 tensor, got {packed.dtype} {list(packed.shape)}"]
        n, half = packed.shape
        group = scheme.group_size
        want = (n, 2 * half // group) if (2 * half) % group == 0 else None
        problems = []
        for t in (scale, zero):
            if t.dtype != torch.bfloat16:
                problems.append(f"{t.name}: dtype {t.dtype}, expected bfloat16")
            if want is None or tuple(t.shape) != want:
                problems.append(f"{t.name}: shape {list(t.shape)} does not match group_size {group} for "
                                f"K={2 * half} (expected {list(want) if want else 'K divisible by the group'})")
        return problems

    def read_module(self, reader, module: str, scheme: ModuleScheme) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(packed, scale, zero) of one module; InputError naming the first problem."""
        problems = self.module_problems(module, reader.infos, scheme)
        if problems:
            raise InputError(problems[0])
        packed, scale, zero = (reader.get(f"{module}.{s}") for s in SUFFIXES)
        return packed, scale, zero


FORMAT = CpuInt4Format()
