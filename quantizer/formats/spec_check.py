"""The structural check the 4-bit-only exports share: a module's tensors are present, with the
dtypes and shapes the format's ``tensor_specs`` plans for the weight they imply."""

from __future__ import annotations

from typing import Callable

from ..schema.scheme import ModuleScheme


def export_problems(fmt, module: str, infos: dict, scheme: ModuleScheme, suffixes: tuple[str, ...],
                    weight_shape: Callable[[tuple[int, ...]], tuple[int, int]]) -> list[str]:
    """What is wrong with one module's tensors (name -> TensorInfo); ``weight_shape`` maps the
    marker tensor's shape to the [N, K] weight it holds."""
    if scheme.bits not in fmt.bits:
        return [f"{module}: the {fmt.title} export holds 4-bit modules only, not {scheme.bits}-bit"]
    missing = [f"{module}.{s}" for s in suffixes if f"{module}.{s}" not in infos]
    if missing:
        return [f"{missing[0]}: missing"]
    shape = weight_shape(tuple(infos[f"{module}.{fmt.marker}"].shape))
    want = {spec.name: spec for spec in fmt.tensor_specs(module, shape, scheme)}
    return [f"{name}: {infos[name].dtype} {list(infos[name].shape)}, expected {spec.dtype} {list(spec.shape)}"
            for name, spec in want.items() if (infos[name].dtype, tuple(infos[name].shape)) != (spec.dtype, spec.shape)]
