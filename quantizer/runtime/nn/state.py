"""A runtime module as plain data and back: its class (one of :data:`KINDS`), its settings (the
JSON-valued attributes) and its tensors, so that a module can be saved with safetensors and JSON
and rebuilt without the model it came from, and without unpickling anything."""

from __future__ import annotations

import torch

from .int4 import Int4Linear, Int4Lookup
from .int8 import Int8Linear, Int8Lookup

KINDS = {cls.__name__: cls for cls in (Int4Linear, Int4Lookup, Int8Linear, Int8Lookup, torch.nn.Linear,
                                       torch.nn.Embedding)}
"""The classes a state may name: exactly these (a subclass may compute more than its state says)."""


class NotSaveable(Exception):
    """The module is not one of :data:`KINDS`; the message names its class."""


def _plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, int) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def module_state(module: torch.nn.Module, tensors: dict[str, torch.Tensor], prefix: str) -> dict:
    """The JSON part of ``module``'s state; its tensors go into ``tensors`` under ``prefix``
    (a tensor already there, shared with another module, is named once). NotSaveable where the
    module's class is not one of :data:`KINDS`."""
    kind = type(module).__name__
    if KINDS.get(kind) is not type(module):
        raise NotSaveable(f"a {kind} is not one of the modules a snapshot holds")
    names = {_identity(t): n for n, t in tensors.items()}
    entries = {}
    for group in ("_buffers", "_parameters"):
        entries[group] = {}
        for name, tensor in getattr(module, group).items():
            if tensor is not None and _identity(tensor) not in names:
                names[_identity(tensor)] = f"{prefix}.{name}"
                tensors[f"{prefix}.{name}"] = tensor.detach()
            entries[group][name] = None if tensor is None else names[_identity(tensor)]
    settings = {k: v for k, v in vars(module).items() if not k.startswith("_") and _plain(v)}
    return {"kind": kind, "settings": settings, **entries}


def settable(cls: type, module: torch.nn.Module, key: str) -> bool:
    """Whether a state may set ``key`` on a fresh ``module`` of ``cls``: a public name that is no
    method, property or torch.nn.Module internal."""
    return (key.isidentifier() and not key.startswith("_") and not hasattr(cls, key)
            and (key not in vars(module) or key == "training"))


def _identity(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype


def rebuilt_module(state: dict, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The module :func:`module_state` described, over ``tensors``; ValueError where the state
    names another class or a tensor that is not there."""
    cls = KINDS.get(state.get("kind"))
    if cls is None:
        raise ValueError(f"a snapshot names module class {state.get('kind')!r}")
    module = cls.__new__(cls)
    torch.nn.Module.__init__(module)
    tensor_names = {*state["_buffers"], *state["_parameters"]}
    bad = [k for k, v in state["settings"].items()
           if not settable(cls, module, k) or k in tensor_names or not _plain(v)]
    if bad:
        raise ValueError(f"a snapshot's {state['kind']} sets {bad[0]!r}, which is not one of its settings")
    for key, value in state["settings"].items():
        module.__dict__[key] = tuple(value) if isinstance(value, list) else value
    missing = [k for k in (*state["_buffers"].values(), *state["_parameters"].values()) if k and k not in tensors]
    if missing:
        raise ValueError(f"a snapshot's {state['kind']} lacks tensor {missing[0]}")
    for name, key in state["_buffers"].items():
        module._buffers[name] = None if key is None else tensors[key]
    for name, key in state["_parameters"].items():
        module._parameters[name] = None if key is None else torch.nn.Parameter(tensors[key], requires_grad=False)
    return module.eval()
