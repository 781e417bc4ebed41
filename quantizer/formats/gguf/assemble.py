"""One .gguf file from a source folder and int4q's blocks, written by llama.cpp's own converter.

The converter runs over the bf16 source as ``convert_hf_to_gguf.py`` would: it writes every key,
the tokenizer and each kept tensor itself. For a quantized weight it is handed, instead of the
weight, index tensors of its shape (see RowMap); whatever it does to them (Llama's q/k row
permutation, splits, stacks) says which source row each output row is, and the output gets
int4q's blocks of those rows, gathered as the file is written. A transform that is not a
reordering of whole rows is refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
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


def _tags(count: int, seed: int = 0) -> torch.Tensor:
    """``count`` distinct random integers below 2**52 as fp64: sums, means or shifts of them are
    almost never one of them, so a transform that mixes or changes rows shows."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        tags = torch.randint(1, 2**52, (count,), generator=gen, dtype=torch.int64)
        if torch.unique(tags).numel() == count:
            return tags.to(torch.float64)


class RowMap:
    """Which (source, row) each output row of a transformed weight came from.

    Instead of a weight, the converter is handed two index tensors of its shape, both broadcast
    views that take no memory until a transform copies them: ``tagged`` holds each row's tag in
    every column, ``positions`` each column's number in every row. A transform that only moves
    whole rows leaves every output row one tag wide and 0..K-1 along; anything else shows in one
    of the two."""

    def __init__(self, weights: dict[str, QuantizedWeight]):
        self.weights = weights
        self.first_rows, rows = {}, 0
        for name, w in weights.items():
            self.first_rows[name] = rows
            rows += w.shape[0]
        tags = _tags(rows)
        self.sorted_tags, self.tag_rows = torch.sort(tags)
        self.row_tags = tags

    def _source_layout(self, name: str, index: torch.Tensor) -> torch.Tensor:
        return index.t() if self.weights[name].transposed else index

    def tagged(self, name: str) -> torch.Tensor:
        """[N, K] (the source's layout): row n's tag in every column."""
        n, k = self.weights[name].shape
        first = self.first_rows[name]
        return self._source_layout(name, self.row_tags[first:first + n, None].expand(n, k))

    def positions(self, name: str) -> torch.Tensor:
        """[N, K] (the source's layout): k in every row."""
        n, k = self.weights[name].shape
        return self._source_layout(name, torch.arange(k, dtype=torch.float64)[None, :].expand(n, k))

    def rows(self, out_name: str, tagged: torch.Tensor, positions: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Runs of output rows as (source name, its row numbers), in output order, from what the
        converter made of :meth:`tagged` and :meth:`positions`."""
        k = tagged.shape[-1]
        tags, columns = tagged.reshape(-1, k), positions.reshape(-1, k)
        if tagged.shape != positions.shape or not (_rows_constant(tags) and _rows_are(columns, torch.arange(k))):
            raise _not_rows(out_name, "changes the columns or values of")
        first = tags[:, 0].contiguous()
        at = torch.searchsorted(self.sorted_tags, first).clamp_(max=len(self.sorted_tags) - 1)
        if not bool((self.sorted_tags[at] == first).all()):
            raise _not_rows(out_name, "changes the values of")
        global_rows = self.tag_rows[at]
        names = list(self.first_rows)
        owner = torch.searchsorted(torch.tensor([self.first_rows[n] for n in names]), global_rows, right=True) - 1
        cuts = [0, *((owner[1:] != owner[:-1]).nonzero().flatten() + 1).tolist(), len(owner)]
        runs = []
        for start, end in zip(cuts, cuts[1:]):
            name = names[int(owner[start])]
            if self.weights[name].shape[1] != k:
                raise _not_rows(out_name, "reshapes")
            runs.append((name, global_rows[start:end] - self.first_rows[name]))
        return runs


def _not_rows(out_name: str, what: str) -> InputError:
    return InputError(f"llama.cpp's converter {what} the weight it writes as {out_name}; int4q can only place "
                      "its blocks on whole rows: --ignore that module")


ROWS_PER_CHECK = 4096


def _rows_constant(rows: torch.Tensor) -> bool:
    """Whether each row of a 2-D tensor holds one value (at once for a broadcast view)."""
    if rows.stride(-1) == 0:
        return True
    return all(bool((rows[i:i + ROWS_PER_CHECK] == rows[i:i + ROWS_PER_CHECK, :1]).all())
               for i in range(0, rows.shape[0], ROWS_PER_CHECK))


def _rows_are(rows: torch.Tensor, row: torch.Tensor) -> bool:
    """Whether every row of a 2-D tensor equals ``row`` (at once for a broadcast view)."""
    if rows.shape[0] <= 1 or rows.stride(0) == 0:
        return bool((rows[:1] == row).all())
    return all(bool((rows[i:i + ROWS_PER_CHECK] == row).all()) for i in range(0, rows.shape[0], ROWS_PER_CHECK))


class PlacedBlocks:
    """The blocks of one GGUF tensor, gathered from int4q's rows only when the writer writes it,
    so no more than one source weight's blocks are in memory at a time. Quacks as the numpy
    array the gguf writer expects (shape, dtype, nbytes, tofile)."""

    def __init__(self, runs, kind: BlockType, shape: tuple[int, ...], weights: dict[str, QuantizedWeight]):
        self.runs, self.weights = runs, weights
        self.shape = (*shape[:-1], kind.row_bytes(shape[-1]))
        self.dtype = np.dtype(np.uint8)
        self.nbytes = math.prod(self.shape)

    def tofile(self, f) -> None:
        loaded = blocks = None
        for src, rows in self.runs:
            if src != loaded:
                blocks = None  # freed before the next source's blocks are read
                blocks, loaded = self.weights[src].load(), src
            whole = len(rows) == len(blocks) and bool((rows == torch.arange(len(rows))).all())
            (blocks if whole else blocks[rows]).numpy().tofile(f)  # no copy of a weight written as it is


def _hooked(base_cls, row_map: RowMap, placed: dict, columns_twin):
    """The converter's class, handing index tensors for int4q's weights and recording their rows;
    ``columns_twin``, a second converter of the source, transforms the positions in step (so a
    converter that gathers several weights before writing them sees each sequence once)."""

    class Int4qPlacement(base_cls):
        model_arch = base_cls.model_arch

        def modify_tensors(self, data_torch, name, bid):
            if name not in row_map.weights:
                yield from super().modify_tensors(data_torch, name, bid)
                return
            twin = list(columns_twin.modify_tensors(row_map.positions(name), name, bid))
            tagged = list(super().modify_tensors(row_map.tagged(name), name, bid))
            if [n for n, _ in twin] != [n for n, _ in tagged]:
                raise InputError(f"llama.cpp's converter writes {name} together with tensors int4q keeps; int4q "
                                 "can only place its blocks on whole rows of its own weights: --ignore that module")
            for (new_name, mapped), (_, positions) in zip(tagged, twin):
                runs = row_map.rows(new_name, mapped, positions)
                kinds = {row_map.weights[src].kind for src, _ in runs}
                if len(kinds) != 1:
                    raise InputError(f"llama.cpp's converter joins modules of different precisions into {new_name}; "
                                     "give them the same bits with --override")
                placed[new_name] = (runs, kinds.pop(), tuple(mapped.shape))
                yield new_name, torch.zeros((1,) * mapped.dim())

    Int4qPlacement.__name__ = base_cls.__name__
    return Int4qPlacement


def write_gguf(source_dir: Path, config: dict, weights: dict[str, QuantizedWeight], out_file: Path,
               file_type: str, int4q_config: dict, written: Callable[[int, int], None] | None = None) -> list[str]:
    """Write ``out_file`` from ``source_dir`` with ``weights`` (source tensor name -> blocks; a head
    absent from the source is added under its own name). Returns the GGUF tensor names that hold
    int4q's blocks. ``file_type``: the LlamaFileType member for ``general.file_type``;
    ``written(done, total)``: tensor bytes written so far, told before the first and after each."""
    _, gguf = load()
    placed: dict = {}
    twin = converter_for(source_dir, config)
    model = converter_for(source_dir, config, out_file, _hooked(converter_class(config), RowMap(weights), placed, twin))
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
            return add_tensor(name, PlacedBlocks(runs, kind, shape, weights),
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
    if written is not None:
        _report_writes(writer, written)
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return sorted(placed)


class _Reported:
    """A tensor the gguf writer writes, telling ``written`` the running byte count after it is written."""

    def __init__(self, tensor, count: list[int], total: int, written: Callable[[int, int], None]):
        self.tensor, self.count, self.total, self.written = tensor, count, total, written
        self.shape, self.dtype, self.nbytes = tensor.shape, tensor.dtype, tensor.nbytes

    def tofile(self, f) -> None:
        self.tensor.tofile(f)
        self.count[0] += self.nbytes
        self.written(self.count[0], self.total)


def _report_writes(writer, written: Callable[[int, int], None]) -> None:
    infos = [ti for tensors in writer.tensors for ti in tensors.values()]
    count, total = [0], sum(ti.nbytes for ti in infos)
    written(0, total)
    for ti in infos:
        ti.tensor = _Reported(ti.tensor, count, total, written)


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
