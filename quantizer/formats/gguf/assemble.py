"""One .gguf file from a source folder and int4q's blocks, written by llama.cpp's own converter.

The converter runs over the bf16 source as ``convert_hf_to_gguf.py`` would: it writes every key,
the tokenizer and each kept tensor itself. For a quantized weight it is handed, instead of the
weights, a tensor of element indices; whatever it does to that tensor (Llama's q/k row
permutation, splits, stacks) says which source row each output row is, and the output gets
int4q's blocks of those rows. A transform that is not a reordering of whole rows is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ...errors import InputError
from .blocks import BlockType
from .converter import converter_class, converter_for, load

INT4Q_CONFIG_KEY = "int4q.quantization_config"


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [N, K] stored as blocks: ``load()`` gives uint8 [N, kind.row_bytes(K)]. A
    ``transposed`` one is [K, N] in the source (transformers' Conv1D)."""

    shape: tuple[int, int]
    kind: BlockType
    load: Callable[[], torch.Tensor]
    transposed: bool = False


def element_index(base: int, shape: tuple[int, int]) -> torch.Tensor:
    """fp64 [N, K] holding base + n * K + k, exact for any model (below 2**53 elements)."""
    n, k = shape
    return torch.arange(base, base + n * k, dtype=torch.float64).reshape(n, k)


class RowMap:
    """Which (source, row) each output row of a transformed index tensor came from."""

    def __init__(self, weights: dict[str, QuantizedWeight]):
        self.weights = weights
        self.bases, base = {}, 0
        for name, w in weights.items():
            self.bases[name] = base
            base += w.shape[0] * w.shape[1]

    def index(self, name: str) -> torch.Tensor:
        """The index tensor in the source's layout of ``name``."""
        w = self.weights[name]
        index = element_index(self.bases[name], w.shape)
        return index.t() if w.transposed else index

    def rows(self, out_name: str, mapped: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Runs of output rows as (source name, its row numbers), in output order."""
        k = mapped.shape[-1]
        flat = mapped.reshape(-1, k)
        starts = flat[:, 0].contiguous()
        step = torch.arange(k, dtype=torch.float64)
        for chunk in range(0, flat.shape[0], 4096):
            if not bool((flat[chunk:chunk + 4096] - starts[chunk:chunk + 4096, None] == step).all()):
                raise InputError(f"llama.cpp's converter changes the columns or values of the weight it writes as "
                                 f"{out_name}; int4q can only place its blocks on whole rows: --ignore that module")
        names = list(self.bases)
        bases = torch.tensor([self.bases[n] for n in names], dtype=torch.float64)
        owner = torch.searchsorted(bases, starts, right=True) - 1
        cuts = [0, *((owner[1:] != owner[:-1]).nonzero().flatten() + 1).tolist(), len(owner)]
        runs = []
        for first, end in zip(cuts, cuts[1:]):
            name = names[int(owner[first])]
            local = starts[first:end] - self.bases[name]
            if self.weights[name].shape[1] != k or bool((local % k != 0).any()):
                raise InputError(f"llama.cpp's converter reshapes the weight it writes as {out_name}; int4q "
                                 "can only place its blocks on whole rows: --ignore that module")
            runs.append((name, (local // k).to(torch.int64)))
        return runs


def _hooked(base_cls, row_map: RowMap, placed: dict):
    """The converter's class, handing index tensors for int4q's weights and recording their rows."""

    class Int4qPlacement(base_cls):
        model_arch = base_cls.model_arch

        def modify_tensors(self, data_torch, name, bid):
            if name not in row_map.weights:
                yield from super().modify_tensors(data_torch, name, bid)
                return
            for new_name, mapped in super().modify_tensors(row_map.index(name), name, bid):
                runs = row_map.rows(new_name, mapped)
                kinds = {row_map.weights[src].kind for src, _ in runs}
                if len(kinds) != 1:
                    raise InputError(f"llama.cpp's converter joins modules of different precisions into {new_name}; "
                                     "give them the same bits with --override")
                placed[new_name] = (runs, kinds.pop(), tuple(mapped.shape))
                yield new_name, torch.zeros((1,) * mapped.dim())

    Int4qPlacement.__name__ = base_cls.__name__
    return Int4qPlacement


def _blocks(runs, kind: BlockType, shape: tuple[int, ...], weights: dict[str, QuantizedWeight]):
    data = torch.cat([weights[src].load()[rows] for src, rows in runs])
    return data.reshape(*shape[:-1], kind.row_bytes(shape[-1])).numpy()


def write_gguf(source_dir: Path, config: dict, weights: dict[str, QuantizedWeight], out_file: Path,
               file_type: str, int4q_config: dict) -> list[str]:
    """Write ``out_file`` from ``source_dir`` with ``weights`` (source tensor name -> blocks; a head
    absent from the source is added under its own name). Returns the GGUF tensor names that hold
    int4q's blocks. ``file_type``: the LlamaFileType member for ``general.file_type``."""
    _, gguf = load()
    placed: dict = {}
    model = converter_for(source_dir, config, out_file, _hooked(converter_class(config), RowMap(weights), placed))
    for name, w in weights.items():
        if name not in model.model_tensors:
            model.model_tensors[name] = lambda shape=w.shape: torch.zeros(shape, dtype=torch.bfloat16)
    writer = model.gguf_writer
    own_type = getattr(gguf.LlamaFileType, file_type)
    add_file_type, add_tensor = writer.add_file_type, writer.add_tensor
    writer.add_file_type = lambda ftype: add_file_type(own_type)

    def add_placed(name, tensor, *args, raw_dtype=None, **kwargs):
        if name in placed:
            runs, kind, shape = placed[name]
            return add_tensor(name, _blocks(runs, kind, shape, weights),
                              raw_dtype=getattr(gguf.GGMLQuantizationType, kind.name))
        return add_tensor(name, tensor, *args, raw_dtype=raw_dtype, **kwargs)

    writer.add_tensor = add_placed
    model.prepare_tensors()
    missing = sorted({src for src in weights} - {src for runs, _, _ in placed.values() for src, _ in runs})
    if missing:
        raise InputError(f"llama.cpp's converter writes no tensor for {missing[0]}; --ignore it, or keep the head "
                         "tied to the table (--untie-head is not for this architecture)")
    model.prepare_metadata(vocab_only=False)
    writer.add_string("general.quantized_by", "int4q")
    writer.add_string(INT4Q_CONFIG_KEY, json.dumps(int4q_config, sort_keys=True))
    writer.write_header_to_file(path=Path(out_file))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return sorted(placed)


@dataclass(frozen=True)
class ConvertedTensor:
    """A tensor as llama.cpp's converter writes it for the bf16 source: its GGML type, its numpy
    shape, and ``values()`` (fp32, that layout)."""

    type_name: str
    shape: tuple[int, ...]
    values: Callable[[], object]


def converted_source(source_dir: Path, config: dict) -> tuple[dict[str, ConvertedTensor], dict[str, object]]:
    """What convert_hf_to_gguf.py writes for ``source_dir``, nothing written: tensors by GGUF name
    (lazily read) and the metadata values by key."""
    _, gguf = load()
    model = converter_for(source_dir, config)
    tensors: dict[str, ConvertedTensor] = {}
    add_tensor = model.gguf_writer.add_tensor  # kept too: the metadata counts the parameters added

    def record(name, data, *args, raw_dtype=None, **kwargs):
        add_tensor(name, data, *args, raw_dtype=raw_dtype, **kwargs)
        kind = raw_dtype if raw_dtype is not None else gguf.GGMLQuantizationType.F32
        shape = tuple(gguf.quant_shape_from_byte_shape(data.shape, kind) if data.dtype == "uint8" else data.shape)

        def values(data=data, kind=kind):
            array = gguf.LazyNumpyTensor.to_eager(data) if isinstance(data, gguf.LazyBase) else data
            return gguf.quants.dequantize(array, kind)

        tensors[name] = ConvertedTensor(kind.name, shape, values)

    model.gguf_writer.add_tensor = record
    model.prepare_tensors()
    model.prepare_metadata(vocab_only=False)
    return tensors, {key: v.value for key, v in model.gguf_writer.kv_data[0].items()}
