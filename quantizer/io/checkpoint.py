"""Checkpoint input: config.json, tensors read one at a time from safetensors shards, and the
tokenizer files copied beside an output. Nothing here knows about quantization."""

from __future__ import annotations

import json
import math
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InputError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".msgpack", ".h5", *PICKLE_SUFFIXES)
NOT_COPIED = {"config.json", "README.md", ".gitattributes", "quantization_report.json", "verify_report.json"}

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
    """Parse a safetensors header and check the file holds every byte it promises.

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
            header = json.loads(f.read(hlen))
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InputError(f"{path.name}: corrupt safetensors header") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + hlen + end > size:
        raise InputError(f"{path.name}: truncated: header promises {8 + hlen + end} bytes, file has {size}")
    return 8 + hlen, header


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


def copy_aux_files(src: Path, dst: Path) -> list[str]:
    """Copy tokenizer, generation-config and chat-template files (everything but weights,
    config.json, hidden files and the source's model card). Returns the names copied."""
    copied = []
    for p in sorted(Path(src).iterdir()):
        if not p.is_file() or p.name in NOT_COPIED or p.name.startswith(".") or p.name.endswith(".index.json"):
            continue
        if p.suffix in WEIGHT_SUFFIXES:
            continue
        shutil.copy2(p, Path(dst) / p.name)
        copied.append(p.name)
    return copied


def write_json(path: Path, obj: dict) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, allow_nan=False) + "\n")
