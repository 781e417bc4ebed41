"""Build any transformers causal LM from a checkpoint folder and load its weights, swapping the
quantized linears and vocabulary table for int4 modules. Also loads plain bf16 checkpoints
through the same path, so the two can be compared like against like."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ..errors import InputError, UnsupportedError
from ..formats import cpu_int4, format_of_config
from ..io.aux_files import allowed_roots, leaves
from ..io.checkpoint import CheckpointReader, read_config
from ..io.structure import (
    build_empty_model,
    check_against_checkpoint,
    is_linear,
    linear_dims,
    tie_word_embeddings,
)
from ..memory import release_free_memory
from ..schema.config import QuantizationConfig
from .activations import EXACT, Activations
from .activations import current as current_activations
from .nn.fusion import fuse_projections
from .nn.int4 import Int4Linear, Int4Lookup, quantize_embedding_module, tied_head
from .nn.int8 import Int8Linear, Int8Lookup, int8_embedding_module, int8_tied_head
from .nn.placement import onto_huge_pages
from .nn.swap import set_module

log = logging.getLogger(__name__)
FORMAT = cpu_int4.FORMAT
DECODE_ROWS = 32
"""Rows up to which the vocabulary head (and, under vLLM, every linear) multiplies its packed
weight directly, through the decode kernels; the checkpoint's dequant_threshold where larger.
Dequantizing a whole head for a few rows (batched decode) costs more than those rows through
the decode kernels (docs/benchmarks/vs-llamacpp.md, "Batched decode")."""


QUANTIZED_MODULES = (Int4Linear, Int4Lookup, Int8Linear, Int8Lookup)
"""The runtime's modules that hold quantized weights (moved onto huge pages after loading)."""


def read_quantization_config(config: dict) -> QuantizationConfig | None:
    """The checkpoint's QuantizationConfig, None for an unquantized one; UnsupportedError otherwise."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if format_of_config(qc) is not FORMAT:
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        raise UnsupportedError(f"this runtime runs {FORMAT.name} checkpoints, not quant_method {method!r}")
    return QuantizationConfig.from_dict(qc)


def quantized_module_names(reader: CheckpointReader) -> list[str]:
    """The modules the checkpoint holds packed tensors for."""
    marker = "." + FORMAT.marker
    return sorted(n.removesuffix(marker) for n in reader.infos if n.endswith(marker))


def load_model(path: Path, threads: int | None = None, fuse: bool = True,
               activations: Activations | None = None, base_model_ok: bool = False) -> torch.nn.Module:
    """Load a cpu_int4 (or plain) checkpoint folder as a transformers model ready for ``generate``;
    a base model (no head, see :func:`..io.structure.is_base_model`) only with ``base_model_ok``
    (verify compares its hidden states), else InputError.

    Activations are bf16 between layers: unquantized float tensors are cast to bf16. The int4
    linears multiply them as ``activations`` says (default: the process's setting, see
    :mod:`.activations`). With ``fuse``, int4 linears that share an input run as one kernel call
    (see :mod:`.fusion`).
    """
    if threads:
        torch.set_num_threads(threads)
    path = Path(path)
    config = read_config(path)
    qc = read_quantization_config(config)
    reader = CheckpointReader(path)
    check_against_checkpoint(config, {n: i.shape for n, i in reader.infos.items()})
    model = build_empty_model(config)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None and not base_model_ok:
        arch = (config.get("architectures") or ["this architecture"])[0]
        raise InputError(f"{path} is a base model ({arch}, no head), and int4q's runtime runs causal LMs; load it "
                         "with transformers' AutoModel, or quantize it with --format gguf for llama.cpp")
    _load_generation_config(model, path)
    tied = tie_word_embeddings(config) and head is not None
    quantized_set = install_quantized_modules(model, reader, qc, tied, activations)
    for name, info in reader.infos.items():
        if not is_quantized_tensor(name, quantized_set):
            _set_tensor(model, name, reader.get(name))
    if tied and not isinstance(emb, (Int4Lookup, Int8Lookup)):
        head.weight = emb.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise InputError(f"{path}: checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. {missing[0]}")
    if fuse:
        fuse_projections(model)
    onto_huge_pages(m for m in model.modules() if isinstance(m, QUANTIZED_MODULES))
    release_free_memory()
    return model


def _load_generation_config(model: torch.nn.Module, path: Path) -> None:
    """The folder's generation_config.json (its end-of-sequence ids: Gemma-3 lists two), where it
    has one inside the folder; unreadable ones are left out with a warning."""
    from transformers import GenerationConfig

    file = path / "generation_config.json"
    if not file.is_file() or (file.is_symlink() and leaves(file, allowed_roots(path))):
        return
    try:
        model.generation_config = GenerationConfig.from_dict(json.loads(file.read_text()))
    except (ValueError, TypeError) as e:
        log.warning("ignoring %s: %s", file, e)


def install_quantized_modules(model: torch.nn.Module, reader: CheckpointReader, qc: QuantizationConfig | None,
                              tied: bool, activations: Activations | None = None) -> set[str]:
    """Put int4/int8 modules, built from ``reader``'s tensors, in place of the quantized linears
    and table of ``model`` (its other parameters may still be on the meta device); a ``tied``
    head shares the quantized table; int4 linears multiply as ``activations`` says (default: the
    process's setting), except the vocabulary head (:func:`head_options`), always exact: its error
    lands on the logits unfiltered, and generation runs it on one row per token. Returns the
    quantized modules' names."""
    activations = activations or current_activations()
    modules = dict(model.named_modules())
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    emb_name = next(n for n, m in modules.items() if m is emb)
    quantized = quantized_module_names(reader)
    for name in quantized:
        module = modules.get(name)
        _install(model, name, module, emb, reader, qc, tied, activations, head=module is head)
    if tied and emb_name in quantized:
        head_name = next(n for n, m in modules.items() if m is head)
        bits = 8 if isinstance(emb, Int8Lookup) else 4
        share = int8_tied_head if bits == 8 else tied_head
        set_module(model, head_name, share(emb, **head_options(qc, bits)))
    return set(quantized)


def is_quantized_tensor(name: str, quantized: set[str]) -> bool:
    """True for a checkpoint tensor that :func:`install_quantized_modules` already consumed."""
    module_name, _, attr = name.rpartition(".")
    return module_name in quantized and (attr in cpu_int4.SUFFIXES or attr == "bias")


def kernel_options(qc: QuantizationConfig, bits: int, activations: Activations) -> dict:
    """The int4/int8 module options a checkpoint's config and an activation choice give."""
    options = dict(threshold=qc.dequant_threshold, prefill_dequant=qc.prefill_dequant)
    if bits == 4:
        options.update(direct_dequant=qc.direct_dequant, use_custom_op=qc.use_custom_op,
                       int8_decode=activations.decode == "int8", int8_prefill=activations.prefill == "int8")
    return options


def with_decode_rows(options: dict) -> dict:
    """:func:`kernel_options` with up to :data:`DECODE_ROWS` rows through the decode kernels."""
    return {**options, "threshold": max(options["threshold"], DECODE_ROWS)}


def head_options(qc: QuantizationConfig, bits: int) -> dict:
    """The vocabulary head's module options: exact activations, :func:`with_decode_rows`."""
    return with_decode_rows(kernel_options(qc, bits, EXACT))


def _install(model, name: str, module, emb, reader: CheckpointReader, qc: QuantizationConfig, tied: bool,
             activations: Activations, head: bool = False) -> None:
    """Put the quantized module ``name`` in place of the model's linear or embedding (``head``: the
    vocabulary head, see :func:`head_options`)."""
    if qc is None:
        raise InputError(f"{name} has packed weights but config.json has no quantization_config")
    scheme = qc.scheme_for(name)
    tensors = FORMAT.read_module(reader, name, scheme)
    if module is emb:
        if not qc.quantize_embedding:
            raise InputError(f"{name} is quantized but quantization_config.quantize_embedding is false")
        if scheme.bits == 8:
            int8_embedding_module(emb, *tensors)
        else:
            quantize_embedding_module(emb, *tensors, scheme.group_size, with_kernel_layout=tied)
        return
    if module is None or not is_linear(module):
        kind = type(module).__name__ if module is not None else "no module of the model"
        raise UnsupportedError(f"{name} is quantized but is {kind}, not a linear or embedding")
    bias = reader.get(f"{name}.bias") if f"{name}.bias" in reader.infos else None
    k = tensors[0].shape[1] * (1 if scheme.bits == 8 else 2)
    if linear_dims(module) != (tensors[0].shape[0], k):
        raise InputError(f"{name}: quantized shape [{tensors[0].shape[0]}, {k}] does not fit "
                         f"{list(linear_dims(module))} ([out, in])")
    options = head_options(qc, scheme.bits) if head else kernel_options(qc, scheme.bits, activations)
    if scheme.bits == 8:
        set_module(model, name, Int8Linear(*tensors, bias=bias, **options))
    else:
        set_module(model, name, Int4Linear.from_row_major(*tensors, scheme.group_size, bias=bias, **options))


def import_architecture(path: Path) -> None:
    """Build (and drop) the empty architecture once, so that one-time imports and allocations
    are not charged to the first model whose memory is measured."""
    build_empty_model(read_config(Path(path)))
    release_free_memory()


def _set_tensor(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(module_name) if module_name else model
    except AttributeError:
        log.info("ignoring checkpoint tensor %s: no such module", name)
        return
    if tensor.is_floating_point():
        tensor = tensor.to(torch.bfloat16)
    if attr in module._parameters:
        old = module._parameters[attr]
        if old is not None and tuple(old.shape) != tuple(tensor.shape):
            raise InputError(f"{name}: shape {list(tensor.shape)} in the checkpoint, {list(old.shape)} in the model")
        module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
    elif attr in module._buffers:
        module._buffers[attr] = tensor
    else:
        log.info("ignoring checkpoint tensor %s: not a parameter of %s", name, type(module).__name__)
