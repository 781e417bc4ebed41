"""Writing safetensors files: a streamed, capped set of shards with an index, single files, and
the shard size limit as the user writes it.

Headers are written first from the tensors' specs, so data goes straight to its place on disk.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InputError
from .checkpoint import _DTYPES, INDEX_NAME, SINGLE_NAME, _read_header

_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor the writer is told about before it arrives."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class ShardWriter:
    """Stream a planned list of tensors into shards of at most ``max_shard_bytes`` (a single
    tensor may exceed it).

    Every shard's header is written when the writer is made, from ``specs`` in order, so each
    :meth:`add` writes its tensor's bytes straight to their place on disk and nothing gathers in
    memory. :meth:`finish` checks that every planned tensor arrived, flushes the files to disk and
    reads each header back against the plan. Shards are named ``model-0000i-of-0000n.safetensors``
    with an index, or ``model.safetensors`` when one suffices.
    """

    def __init__(self, out_dir: Path, specs: list[TensorSpec], max_shard_bytes: int):
        self.dir = Path(out_dir)
        groups: list[list[TensorSpec]] = [[]]
        size = 0
        for spec in specs:
            if groups[-1] and size + spec.nbytes > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append(spec)
            size += spec.nbytes
        count = len(groups)
        names = [SINGLE_NAME] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
        self._place: dict[str, tuple[Path, int, TensorSpec]] = {}
        self._shards: list[tuple[Path, dict]] = []
        for name, group in zip(names, groups):
            path = self.dir / name
            header, base = _write_header(path, group)
            self._shards.append((path, header))
            for spec in group:
                self._place[spec.name] = (path, base + header[spec.name]["data_offsets"][0], spec)
        self._pending = set(self._place)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        path, offset, spec = self._place[name]
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(f"{name}: got {tensor.dtype} {list(tensor.shape)}, planned {spec.dtype} {list(spec.shape)}")
        with open(path, "r+b") as f:
            _write_tensor(f, offset, tensor)
        self._pending.discard(name)

    def finish(self) -> list[Path]:
        """Check completeness, fsync, compare the headers on disk with the plan, write the index;
        return the shard paths."""
        if self._pending:
            raise ValueError(f"{len(self._pending)} planned tensors were never written, e.g. {min(self._pending)}")
        for path, header in self._shards:
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            if _read_header(path)[1] != header:
                raise ValueError(f"{path.name}: the header on disk differs from what was planned")
        paths = [path for path, _ in self._shards]
        if len(paths) > 1:
            weight_map = {name: path.name for name, (path, _, _) in self._place.items()}
            total = sum(spec.nbytes for _, _, spec in self._place.values())
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return paths


def _write_header(path: Path, specs: list[TensorSpec]) -> tuple[dict, int]:
    """Create ``path`` with the safetensors header of ``specs`` and room for their data.
    Returns the header and the offset of the data section."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": _DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)
    return header, 8 + len(raw)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write a safetensors file straight from tensor memory (no serialized copy in RAM)."""
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    header, base = _write_header(path, specs)
    with open(path, "r+b") as f:
        for name, t in tensors.items():
            _write_tensor(f, base + header[name]["data_offsets"][0], t)


def _write_tensor(f, offset: int, tensor: torch.Tensor) -> None:
    if tensor.numel():
        f.seek(offset)
        f.write(memoryview(tensor.contiguous().view(torch.uint8).reshape(-1).numpy()))


def file_specs(path: Path) -> list[TensorSpec]:
    """The tensors a safetensors file holds, from its header, in data order."""
    header = _read_header(Path(path))[1]
    entries = sorted((v["data_offsets"][0], k, v) for k, v in header.items() if k != "__metadata__")
    return [TensorSpec(k, _DTYPES[v["dtype"]], tuple(v["shape"])) for _, k, v in entries]


def parse_size(text: str) -> int:
    """'2GB', '500MB', '64KiB', '1000' -> bytes."""
    t = text.strip().upper().replace(" ", "")
    units = {"KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "B": 1}
    for unit, mult in units.items():
        if t.endswith(unit):
            t, factor = t[: -len(unit)], mult
            break
    else:
        factor = 1
    try:
        value = float(t)
    except ValueError:
        raise InputError(f"cannot read size {text!r}; use e.g. 2GB, 500MB or 64KiB") from None
    if value <= 0:
        raise InputError(f"size must be positive, got {text!r}")
    return int(value * factor)
