"""llama.cpp's importance-matrix file from a calibrated run's input statistics, so that
``llama-quantize --imatrix FILE`` can reuse int4q's calibration.

The file is the GGUF one ``llama-imatrix`` writes: ``general.type`` "imatrix", the calibration
text in ``imatrix.datasets``, its windows as ``imatrix.chunk_count`` x ``imatrix.chunk_size``, and
per GGUF weight ``<name>.in_sum2`` (the sum of x² per input column, F32 [K]) and ``<name>.counts``
(the input rows summed, F32 [1]). The names are the ones llama.cpp's converter gives the source's
weights; a weight the converter stacks with others (experts) is left out.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .converter import has_key, load
from .names import GgufNames

CALIBRATION_KEY = "int4q.calibration"  # the run's calibration record, JSON; marks the file as int4q's
Statistic = tuple[torch.Tensor, int]  # (column mean squares [K] fp32, input rows)


def write_imatrix(path: Path, names: GgufNames, statistics: dict[str, Statistic], dataset: str, chunks: int,
                  chunk_size: int, calibration: dict) -> None:
    """Write the imatrix file at ``path`` (replacing it): every named module that has a
    statistic, under each of its GGUF names, sorted as llama-imatrix sorts them."""
    _, gguf = load()
    entries: dict[str, Statistic] = {}
    for module, gguf_names in names.names.items():
        if module in statistics:
            entries.update(dict.fromkeys(gguf_names, statistics[module]))
    writer = gguf.GGUFWriter(path, names.arch)
    writer.add_type(gguf.GGUFType.IMATRIX)
    writer.add_array("imatrix.datasets", [dataset])
    writer.add_uint32("imatrix.chunk_count", chunks)
    writer.add_uint32("imatrix.chunk_size", chunk_size)
    writer.add_string(CALIBRATION_KEY, json.dumps(calibration, sort_keys=True))
    for name in sorted(entries):
        mean, rows = entries[name]
        writer.add_tensor(f"{name}.in_sum2", (mean.to(torch.float64) * rows).to(torch.float32).numpy())
        writer.add_tensor(f"{name}.counts", torch.tensor([float(rows)], dtype=torch.float32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


def is_int4q_imatrix(path: Path) -> bool:
    """True for an imatrix file int4q wrote."""
    return has_key(path, CALIBRATION_KEY)
