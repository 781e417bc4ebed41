"""``--target-bpw``: each quantized module's GGUF block type chosen to fit a size budget with the
least measured error. Every weight is read once and rounded to the nearest on each candidate
type (:data:`CANDIDATES`, after llama-quantize's fallbacks for its rows); a type's loss is the
weight's relative squared error ``|W - Q|^2 / |W|^2``, so every tensor counts alike whatever its
size; :func:`.allocation.allocate` then spends the bytes where they save the most loss."""

from __future__ import annotations

import torch

from ..errors import InputError
from ..methods.grid import ROW_CHUNK
from ..methods.rtn import quantize_rtn
from ..schema.scheme import ModuleScheme
from .allocation import Choice, allocate

CANDIDATES = (ModuleScheme(4, 32, True), ModuleScheme(4, 32, False), ModuleScheme(5, 32, False),
              ModuleScheme(6, 16, True), ModuleScheme(8))
"""In a sized GGUF: IQ4_XS (4.25 bits), Q4_K (4.5), Q5_K (5.5), Q6_K (6.56) and Q8_0 (8.5), or
their fallbacks where 256 does not divide a row (IQ4_NL, Q5_0, Q5_1, Q8_0)."""
SIZE_TARGET = "size_target"  # the quantization_config.calibration entry that records the choice


def relative_error(weight: torch.Tensor, scheme: ModuleScheme, storage) -> float:
    """|W - Q|^2 / |W|^2 of round-to-nearest on ``scheme`` as ``storage`` holds it, by row chunks."""
    err = norm = 0.0
    for start in range(0, weight.shape[0], ROW_CHUNK):
        rows = weight[start:start + ROW_CHUNK].to(torch.float32)
        q, _ = quantize_rtn(rows, scheme, storage=storage)
        err += float((rows - q.dequantize()).square().sum(dtype=torch.float64))
        norm += float(rows.square().sum(dtype=torch.float64))
    return err / norm if norm else 0.0


def type_options(shape: tuple[int, int], fmt) -> list[tuple[tuple, int]]:
    """The distinct block types a [N, K] weight can take in the sized format ``fmt``: per type,
    ((the scheme that stores it, its fallback note, the block type's name), its bytes)."""
    n, k = shape
    seen, out = set(), []
    for candidate in CANDIDATES:
        scheme, note = fmt.fallback(candidate, k)
        kind = None if scheme.kept else fmt.block_type(scheme, k)
        if kind is not None and kind.name not in seen:
            seen.add(kind.name)
            out.append(((scheme, note, kind.name), n * kind.row_bytes(k)))
    return out


def fit_to_size(target_bpw: float, shapes: dict[str, tuple[int, int]], weights, fmt) -> tuple[dict, dict, dict]:
    """Each module's scheme for ``target_bpw`` bits per weight over the modules of ``shapes``
    (module -> [N, K]), measured on ``weights`` (module -> its [N, K] weight, read when called):
    (module -> scheme, module -> fallback note, the record of the choice for quantization_config).
    InputError, before any weight is read, where the target is outside what the types can reach."""
    if not shapes:
        raise InputError("--target-bpw has no module to choose a type for: every module is kept")
    options = {m: type_options(shape, fmt) for m, shape in shapes.items()}
    params = sum(n * k for n, k in shapes.values())
    smallest = sum(min(b for _, b in opts) for opts in options.values()) * 8 / params
    largest = sum(max(b for _, b in opts) for opts in options.values()) * 8 / params
    if not smallest <= target_bpw <= largest:
        raise InputError(f"--target-bpw {target_bpw:g} is outside what this model's types can reach: "
                         f"{smallest:.3f} to {largest:.3f} bits per weight")
    choices = {}
    for m, opts in options.items():
        weight = weights(m)
        choices[m] = [Choice(o, nbytes, relative_error(weight, o[0], fmt.block_type(o[0], shapes[m][1]).storage))
                      for o, nbytes in opts]
    chosen = allocate(choices, int(target_bpw * params / 8))
    schemes = {m: c.option[0] for m, c in chosen.items()}
    notes = {m: c.option[1] for m, c in chosen.items() if c.option[1]}
    planned = sum(c.nbytes for c in chosen.values()) * 8 / params
    types: dict[str, int] = {}
    for c in chosen.values():
        types[c.option[2]] = types.get(c.option[2], 0) + 1
    record = {"target_bpw": target_bpw, "planned_bpw": round(planned, 4),
              "relative_error": round(sum(c.loss for c in chosen.values()), 6), "types": dict(sorted(types.items()))}
    return schemes, notes, record
