"""The GGUF names llama.cpp's converter gives a source's weights, found without reading them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .converter import converter_for


@dataclass(frozen=True)
class GgufNames:
    """The GGUF architecture name, module -> the GGUF weights that take its input, and the
    modules whose weights the converter stacks, reshapes or does not write (left out)."""

    arch: str
    names: dict[str, list[str]]
    left_out: list[str]


def gguf_names(model_dir: Path, config: dict, shapes: dict[str, tuple[int, ...]]) -> GgufNames:
    """The GGUF names of the modules whose source weight (``<module>.weight``) has the given
    shape. Nothing is read: the converter transforms shape-only tensors."""
    model = converter_for(model_dir, config)
    names: dict[str, list[str]] = {}
    left_out: list[str] = []
    waiting: list[str] = []  # modules the converter holds back until it fuses them with the next
    for module, shape in shapes.items():
        name = f"{module}.weight"
        bid = next((int(part) for part in name.split(".") if part.isdecimal()), None)
        try:
            made = list(model.modify_tensors(torch.empty(shape, device="meta"), name, bid))
        except (RuntimeError, NotImplementedError, ValueError, TypeError, KeyError, IndexError):
            left_out.append(module)  # a transform that needs the values, not only the shape
            continue
        waiting.append(module)
        if not made:
            continue
        same_input = len({shapes[m][-1] for m in waiting}) == 1
        if same_input and all(t.dim() == 2 and t.shape[-1] == shape[-1] for _, t in made):
            names.update({m: [n for n, _ in made] for m in waiting})
        else:
            left_out.extend(waiting)
        waiting = []
    return GgufNames(model.gguf_writer.arch, names, left_out + waiting)
