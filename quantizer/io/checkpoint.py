"""Checkpoint input: config.json and tensors read one at a time from safetensors shards. Nothing
here knows about quantization."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InputError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".msgpack", ".h5", *PICKLE_SUFFIXES)

_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what it is, read from the shard header without loading data."""

    name: str
    file: Path
    dtype: torch.dtype | str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    length: int  # bytes

    @property
    def nbytes(self) -> int:
        return self.length


def read_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise InputError(f"{model_dir}: no config.json, so this is not a Hugging Face model folder")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise InputError(f"{path}: holds a JSON {type(config).__name__}, not an object of model settings")
    return config


def _read_header(path: Path) -> tuple[int, dict]:
    """Parse a safetensors header and check it as the safetensors library does: a JSON object
    without repeated keys, each tensor's dtype, shape and offsets well-formed, the tensors'
    byte ranges non-negative, non-overlapping and inside the file.

    Returns (offset of the data section, header dict)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise InputError(f"{path.name}: truncated safetensors file ({size} bytes)")
            (hlen,) = struct.unpack("<Q", raw)
            if hlen > min(size - 8, 100_000_000):
                raise InputError(f"{path.name}: corrupt safetensors header (length {hlen}, file {size} bytes)")
            header = json.loads(f.read(hlen), object_pairs_hook=_refuse_repeated_keys)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise InputError(f"{path.name}: corrupt safetensors header") from None
    except ValueError as e:
        raise InputError(f"{path.name}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path.name}: corrupt safetensors header (a JSON {type(header).__name__}, not an object)")
    end = _check_ranges(path, {k: v for k, v in header.items() if k != "__metadata__"})
    if 8 + hlen + end > size:
        raise InputError(f"{path.name}: truncated: header promises {8 + hlen + end} bytes, file has {size}")
    return 8 + hlen, header


def _refuse_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    repeated = next((k for k in keys if keys.count(k) > 1), None)
    if repeated is not None:
        raise ValueError(f"{repeated!r} appears twice")
    return dict(pairs)


def _is_index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_ranges(path: Path, entries: dict) -> int:
    """Every entry's form, and byte ranges that do not overlap; returns where the last one ends."""
    ranges = []
    for name, meta in entries.items():
        offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
        shape = meta.get("shape") if isinstance(meta, dict) else None
        if (not isinstance(meta.get("dtype") if isinstance(meta, dict) else None, str)
                or not isinstance(shape, list) or not all(map(_is_index, shape))
                or not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_index, offsets))
                or offsets[0] > offsets[1]):
            raise InputError(f"{path.name}: corrupt header entry for {name} (it needs a dtype, a shape of "
                             "non-negative integers and data_offsets [start, end] with 0 <= start <= end)")
        ranges.append((offsets[0], offsets[1], name))
    ranges.sort()
    for (_, end, first), (start, _, second) in zip(ranges, ranges[1:]):
        if start < end:
            raise InputError(f"{path.name}: corrupt header: the bytes of {first} and {second} overlap")
    return max((end for _, end, _ in ranges), default=0)


class CheckpointReader:
    """The tensors of a safetensors checkpoint (one file or an index), read one at a time."""

    def __init__(self, model_dir: Path):
        self.dir = Path(model_dir)
        self.files, weight_map = _weight_files(self.dir)
        self.infos: dict[str, TensorInfo] = {}
        for file in self.files:
            base, header = _read_header(file)
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                if name in self.infos:
                    raise InputError(f"tensor {name} appears in both {self.infos[name].file.name} and {file.name}")
                try:
                    dtype = _DTYPES.get(meta["dtype"], meta["dtype"])
                    start, end = meta["data_offsets"]
                    shape = tuple(int(d) for d in meta["shape"])
                except (KeyError, TypeError, ValueError):
                    raise InputError(f"{file.name}: corrupt header entry for {name}") from None
                numel = math.prod(shape)
                if isinstance(dtype, torch.dtype) and numel * dtype.itemsize != end - start:
                    raise InputError(f"{file.name}: tensor {name} has {end - start} bytes for shape {list(shape)}")
                self.infos[name] = TensorInfo(name, file, dtype, shape, base + start, end - start)
        for name, file in (weight_map or {}).items():
            if name not in self.infos or self.infos[name].file.name != file:
                raise InputError(f"{INDEX_NAME} places {name} in {file}, which does not hold it; "
                                 "regenerate the index from the shards")

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self.infos.values())

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor into its own memory (no mmap, so only what is held stays resident)."""
        info = self.infos[name]
        if not isinstance(info.dtype, torch.dtype):
            raise InputError(f"tensor {name} has dtype {info.dtype}, which int4q cannot read")
        buf = bytearray(info.length)
        try:
            with open(info.file, "rb") as f:
                f.seek(info.offset)
                got = f.readinto(buf)
        except OSError as e:
            raise InputError(f"{info.file.name}: cannot read tensor {name} ({e.strerror})") from None
        if got != info.length:
            raise InputError(f"{info.file.name}: truncated while reading {name}")
        if not buf:
            return torch.empty(info.shape, dtype=info.dtype)
        return torch.frombuffer(buf, dtype=info.dtype).reshape(info.shape)


def _weight_files(model_dir: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint, and its index's weight_map when it has one."""
    index = model_dir / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise InputError(f"{index}: not a valid safetensors index (no weight_map)") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise InputError(f"{index.name} names {len(missing)} missing shard(s): {', '.join(missing[:3])}")
        return [model_dir / f for f in files], weight_map
    single = model_dir / SINGLE_NAME
    if single.is_file():
        return [single], None
    found = sorted(model_dir.glob("*.safetensors"))
    if len(found) == 1:
        return found, None
    if len(found) > 1:
        raise InputError(f"{model_dir}: {len(found)} safetensors files but no {INDEX_NAME}")
    pickles = [p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles:
        raise InputError(
            f"{model_dir}: only pickle weights ({', '.join(pickles[:3])}); int4q never unpickles, "
            "convert them to safetensors with a tool you trust"
        )
    raise InputError(f"{model_dir}: no safetensors weights found")


def write_json(path: Path, obj: dict) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, allow_nan=False) + "\n")
