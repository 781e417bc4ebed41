"""Putting modules into a model's tree and taking them out: the int4/int8 modules back to plain
bf16 ones, for comparisons through ordinary kernels."""

from __future__ import annotations

import torch

from .fusion import Int4Group, Int4Slice
from .int4 import Int4Linear, Int4Lookup
from .int8 import Int8Linear, Int8Lookup


def dequantize_modules(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every int4 and int8 module of ``model`` in place by its bf16 equivalent (nn.Linear
    with the dequantized weight, the original embedding class with the dequantized table). A head
    tied to the table stays tied. The result computes the same function through ordinary kernels."""
    _unfuse(model)
    tables: dict[int, torch.nn.Parameter] = {}
    for module in list(model.modules()):
        if isinstance(module, (Int4Lookup, Int8Lookup)):
            weight = torch.nn.Parameter(module.dequantized_weight(), requires_grad=False)
            if module.table_key is not None:
                tables[id(module.table_key)] = weight
            module.drop_quantized()
            module.__class__ = module._quant_original_class
            module.weight = weight
    for name, module in list(model.named_modules()):
        if isinstance(module, (Int4Linear, Int8Linear)):
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                     device="meta")
            weight = tables.get(id(module.table_key))
            if weight is None:
                weight = torch.nn.Parameter(module.dequantized_weight(), requires_grad=False)
            linear.weight = weight
            if module.bias is not None:
                linear.bias = torch.nn.Parameter(module.bias, requires_grad=False)
            set_module(model, name, linear)
    return model


def _unfuse(model: torch.nn.Module) -> None:
    """Replace fused groups' slices by bf16 linears and drop the groups."""
    for name, module in list(model.named_modules()):
        if isinstance(module, Int4Slice):
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                     device="meta")
            linear.weight = torch.nn.Parameter(module.dequantized_weight(), requires_grad=False)
            if module.bias is not None:
                linear.bias = torch.nn.Parameter(module.bias.clone(), requires_grad=False)
            set_module(model, name, linear)
    for name, module in list(model.named_modules()):
        if isinstance(module, Int4Group):
            parent, _, child = name.rpartition(".")
            delattr(model.get_submodule(parent) if parent else model, child)


def set_module(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    """Put ``new`` at the dotted path ``name`` of ``model``."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
