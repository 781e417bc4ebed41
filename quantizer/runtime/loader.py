"""Build any transformers causal LM from a checkpoint folder and load its weights, swapping the
quantized linears and vocabulary table for int4 modules. Also loads plain bf16 checkpoints
through the same path, so the two can be compared like against like."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..checkpoint import CheckpointReader, read_config
from ..config import QuantizationConfig
from ..errors import InputError, UnsupportedError
from ..formats import cpu_int4, format_of_config
from ..memory import release_free_memory
from ..structure import build_empty_model, tie_word_embeddings
from .fusion import fuse_projections
from .modules import Int4Linear, quantize_embedding_module, set_module, tied_head

log = logging.getLogger(__name__)
FORMAT = cpu_int4.FORMAT


def read_quantization_config(config: dict) -> QuantizationConfig | None:
    """The checkpoint's QuantizationConfig, None for an unquantized one; UnsupportedError otherwise."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if format_of_config(qc) is not FORMAT:
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        raise UnsupportedError(f"this runtime runs {FORMAT.name} checkpoints, not quant_method {method!r}")
    return QuantizationConfig.from_dict(qc)


def _quantized_modules(reader: CheckpointReader) -> list[str]:
    marker = "." + FORMAT.marker
    return sorted(n.removesuffix(marker) for n in reader.infos if n.endswith(marker))


def load_model(path: Path, threads: int | None = None, fuse: bool = True) -> torch.nn.Module:
    """Load a cpu_int4 (or plain) checkpoint folder as a transformers model ready for ``generate``.

    Activations are bf16 end to end: unquantized float tensors are cast to bf16. With ``fuse``,
    int4 linears that share an input run as one kernel call (see :mod:`.fusion`).
    """
    if threads:
        torch.set_num_threads(threads)
    path = Path(path)
    config = read_config(path)
    qc = read_quantization_config(config)
    reader = CheckpointReader(path)
    model = build_empty_model(config)
    modules = dict(model.named_modules())
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    emb_name = next(n for n, m in modules.items() if m is emb)
    tied = tie_word_embeddings(config) and head is not None
    quantized = _quantized_modules(reader)
    if quantized and qc is None:
        raise InputError(f"{path}: has packed weights but no quantization_config")
    if qc:
        linear_kwargs = dict(threshold=qc.dequant_threshold, prefill_dequant=qc.prefill_dequant,
                             direct_dequant=qc.direct_dequant, use_custom_op=qc.use_custom_op)
    for name in quantized:
        module = modules.get(name)
        group_size = qc.scheme_for(name).group_size
        tensors = FORMAT.read_module(reader, name, qc.scheme_for(name))
        if module is emb:
            if not qc.quantize_embedding:
                raise InputError(f"{name} is quantized but quantization_config.quantize_embedding is false")
            quantize_embedding_module(emb, *tensors, group_size, with_kernel_layout=tied)
        elif type(module) is torch.nn.Linear:
            bias = reader.get(f"{name}.bias") if f"{name}.bias" in reader.infos else None
            if (module.out_features, module.in_features) != (tensors[0].shape[0], tensors[0].shape[1] * 2):
                raise InputError(f"{name}: packed shape {list(tensors[0].shape)} does not fit "
                                 f"[{module.out_features}, {module.in_features}]")
            set_module(model, name, Int4Linear.from_row_major(*tensors, group_size, bias=bias, **linear_kwargs))
        else:
            raise UnsupportedError(f"{name} is quantized but is a {type(module).__name__}, not a linear or embedding")
    head_name = next((n for n, m in modules.items() if m is head), None)
    if tied and emb_name in quantized:
        set_module(model, head_name, tied_head(emb, **linear_kwargs))
    quantized_set = set(quantized)
    for name, info in reader.infos.items():
        module_name, _, attr = name.rpartition(".")
        if module_name in quantized_set and (attr in cpu_int4.SUFFIXES or attr == "bias"):
            continue
        _set_tensor(model, name, reader.get(name))
    if tied and emb_name not in quantized_set:
        head.weight = emb.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise InputError(f"{path}: checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. {missing[0]}")
    if fuse:
        fuse_projections(model)
    release_free_memory()
    return model


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


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise InputError(f"{path}: cannot load a tokenizer ({str(e).splitlines()[0]})") from None
