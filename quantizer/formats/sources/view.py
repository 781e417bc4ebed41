"""A quantized checkpoint seen as the float checkpoint it stands for: each quantized module's
packed tensors become one ``<module>.weight`` (fp32, the source's dequantized values), every other
tensor is as stored. Reads like :class:`~quantizer.io.checkpoint.CheckpointReader`, one tensor at
a time, and also gives each module's grid (:meth:`QuantizedCheckpoint.grid`)."""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import InputError
from ...io.checkpoint import CheckpointReader, TensorInfo
from ...methods.transfer import SourceGrid
from .schemes import SourceScheme
from .unpack import GRIDS, PARTS, weight_shape

DEQUANT_ROWS = 1 << 22  # elements per chunk of a dequantized weight: bounds the fp64 transient


class QuantizedCheckpoint:
    """``infos``, ``total_bytes`` and ``get(name)`` as a float checkpoint's reader; ``grid(name)``
    for each ``<module>.weight`` that stands for a quantized module."""

    def __init__(self, model_dir: Path, config: dict, scheme: SourceScheme):
        self.scheme = scheme
        self._last: tuple[str | None, SourceGrid | None] = (None, None)
        self.raw = CheckpointReader(model_dir)
        self.files = self.raw.files
        self.eight_bit = _eight_bit_modules(config, scheme)
        raw = self.raw.infos
        marker = f".{scheme.marker}"
        self.modules = sorted(n.removesuffix(marker) for n in raw if n.endswith(marker))
        if not self.modules:
            raise InputError(f"{model_dir}: config.json says {scheme.desc}, but no tensor ends in {marker}")
        consumed, self.infos = set(), {}
        for module in self.modules:
            parts = [f"{module}.{p}" for p in PARTS[scheme.method] if f"{module}.{p}" in raw]
            consumed.update(parts)
            first = raw[f"{module}{marker}"]
            shape = self._shape(module)
            self.infos[f"{module}.weight"] = TensorInfo(f"{module}.weight", first.file, torch.float32, shape,
                                                        first.offset, sum(raw[p].length for p in parts))
        clash = sorted(n for n in raw if n in self.infos)
        if clash:
            raise InputError(f"{model_dir}: {clash[0]} is stored both quantized and as a float tensor")
        self.infos.update({n: i for n, i in raw.items() if n not in consumed})
        self.consumed = frozenset(consumed)

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self.infos.values())

    def _part(self, module: str):
        def get(suffix: str) -> torch.Tensor | None:
            name = f"{module}.{suffix}"
            return self.raw.get(name) if name in self.raw.infos else None
        return get

    def _shape(self, module: str) -> tuple[int, int]:
        if module in self.eight_bit:
            return tuple(self.raw.infos[f"{module}.weight_packed"].shape)
        return weight_shape(self.raw.infos, self._part(module), module, self.scheme)

    def grid(self, name: str) -> SourceGrid | None:
        """The grid of the quantized module whose weight is ``name``; None for a stored tensor and
        for an 8-bit cpu_int4 module."""
        module = name.removesuffix(".weight")
        if name not in self.infos or name in self.raw.infos or module in self.eight_bit:
            return None
        if self._last[0] == name:  # a run reads a module's weight, then asks for its grid
            return self._last[1]
        grid = GRIDS[self.scheme.method](self._part(module), module, self.scheme)
        if tuple(grid.codes.shape) != self.infos[name].shape:
            raise InputError(f"{module}: its packed codes are {list(grid.codes.shape)}, not the "
                             f"{list(self.infos[name].shape)} its other tensors give")
        self._last = (name, grid)
        return grid

    def get(self, name: str) -> torch.Tensor:
        """A stored tensor as stored; a quantized module's weight [N, K] as fp32 values."""
        if name in self.raw.infos:
            return self.raw.get(name)
        module = name.removesuffix(".weight")
        if module in self.eight_bit:
            get = self._part(module)
            codes, scale = get("weight_packed").to(torch.float32), get("weight_scale").to(torch.float32)
            return (codes.reshape(codes.shape[0], scale.shape[1], -1) * scale.unsqueeze(-1)).reshape(codes.shape)
        return dequantize(self.grid(name))


def dequantize(grid: SourceGrid) -> torch.Tensor:
    """The grid's weight [N, K] fp32, in row chunks."""
    n, k = grid.codes.shape
    step = max(1, DEQUANT_ROWS // max(k, 1))
    return torch.cat([grid.rows(slice(r, r + step)).dequantize() for r in range(0, n, step)]) if n else \
        torch.empty(0, k)


def _eight_bit_modules(config: dict, scheme: SourceScheme) -> frozenset[str]:
    """The modules a cpu_int4 source stores in 8 bits (one int8 code per weight)."""
    if scheme.method != "cpu_int4":
        return frozenset()
    from ...schema.config import QuantizationConfig

    q = QuantizationConfig.from_dict(config["quantization_config"])
    return frozenset(m for m in q.modules if q.scheme_for(m).bits == 8)


def float_config(config: dict) -> dict:
    """config.json of the float checkpoint a quantized one stands for."""
    out = dict(config)
    out.pop("quantization_config", None)
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = {k: v for k, v in out["text_config"].items() if k != "quantization_config"}
    return out
