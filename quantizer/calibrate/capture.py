"""What a decoder layer sees: forward hooks that capture the calibration windows' inputs to the
first layer and feed a linear's inputs to a statistic. Every capture stops its forward pass as
soon as it has what it needs."""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from ..io.structure import linear_dims
from .output_cache import OutputCache


class Accumulator(Protocol):
    def add(self, x: torch.Tensor) -> None:
        """Fold in a batch of one linear's inputs [..., K]."""

    def merge(self, sum_across: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Become the statistic over every process's inputs; ``sum_across`` sums a tensor in
        place over the processes."""

    def column_mean_square(self) -> tuple[torch.Tensor, int]:
        """(each input column's mean x² [K] fp32 on the CPU, the number of input rows it is over):
        a host-side record, written with the calibration state whatever device accumulated it."""


class _Stop(Exception):
    """Raised from a hook to end a forward pass once the wanted inputs are captured."""


def set_param(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    owner._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)


def release_parameters(module: torch.nn.Module) -> None:
    """Put ``module``'s parameters back on the meta device, keeping its buffers (Gemma's embedding
    scale, say), which a later pass through the module still reads."""
    for name, param in list(module.named_parameters()):
        set_param(module, name, param.to("meta"))


def hidden_of(out):
    return out[0] if isinstance(out, tuple) else out


class Replay(torch.nn.Module):
    """Stands in for a decoder layer: the first returns stored hidden states, the rest pass through."""

    def __init__(self, stored: torch.Tensor | None, as_tuple: bool, device: str = "cpu"):
        super().__init__()
        self.stored, self.as_tuple, self.index, self.device = stored, as_tuple, 0, device

    def forward(self, hidden_states, *args, **kwargs):
        out = hidden_states if self.stored is None else self.stored[self.index:self.index + 1].to(self.device)
        return (out,) if self.as_tuple else out


def capture_inputs(model, layers, windows: torch.Tensor, all_samples: bool, device: str = "cpu"):
    """Run the model's own forward (on ``device``) up to the first decoder layer. Returns (hidden
    states [S, T, H] on the CPU of every window, in the model's dtype, or None when not
    ``all_samples``; the layer's keyword arguments for one window, the same for every window of
    that length)."""
    captured: dict = {}

    def hook(module, args, kwargs):
        captured["hidden"] = args[0] if args else kwargs.pop("hidden_states")
        captured["kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise _Stop

    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    hidden = None
    try:
        count = windows.shape[0] if all_samples else 1
        for s in range(count):
            try:
                with torch.inference_mode():
                    model(input_ids=windows[s:s + 1].to(device), use_cache=False)
            except _Stop:
                pass
            if hidden is None:
                hidden = torch.empty(count, *captured["hidden"].shape[1:], dtype=captured["hidden"].dtype)
            hidden[s] = captured["hidden"][0]
    finally:
        handle.remove()
    return (hidden if all_samples else None), captured["kwargs"]


Keep = Callable[[int, torch.Tensor], None]  # (window, a linear's input of it)


def feed(target: torch.nn.Module, acc: Accumulator, run_window, count: int, cache: OutputCache | None = None,
         keep: Keep | None = None) -> None:
    """Call ``run_window(s)`` for each window s (``cache`` told which), giving ``target``'s input
    to ``acc`` (and to ``keep``) and stopping each forward as soon as it has."""
    window = [0]

    def hook(module, args):
        acc.add(args[0])
        if keep is not None:
            keep(window[0], args[0])
        raise _Stop

    handle = target.register_forward_pre_hook(hook)
    try:
        with torch.inference_mode():
            for s in range(count):
                window[0] = s
                if cache is not None:
                    cache.window = s
                try:
                    run_window(s)
                except _Stop:
                    pass
    finally:
        handle.remove()


def accumulate(layer, step: list[str], hidden: torch.Tensor, kwargs: dict, method, device: str = "cpu",
               cache: OutputCache | None = None, keep: Keep | None = None) -> Accumulator:
    """``method``'s statistic of the step's shared input over every window (``hidden`` on the
    CPU, the layer on ``device``; ``cache``: the layer's finished linears' outputs; ``keep``
    also gets each window's input)."""
    first = layer.get_submodule(step[0])
    acc = method.accumulator(linear_dims(first)[1], device)
    feed(first, acc, lambda s: layer(hidden[s:s + 1].to(device), **kwargs), hidden.shape[0], cache, keep)
    return acc


def head_statistic(model, layers, reader, hidden, windows, as_tuple, head_name, method,
                   device: str = "cpu", dtype: torch.dtype = torch.float32) -> Accumulator:
    """The statistic of the head's inputs (the final norm's outputs), through the model's own
    code (its parameters in ``dtype``, read for this pass and let go after it): the decoder
    layers are replaced by a replay of the final hidden states."""
    replay = Replay(hidden, as_tuple, device)
    originals = list(layers)
    for i in range(len(layers)):
        layers[i] = replay if i == 0 else Replay(None, as_tuple, device)
    head = model.get_output_embeddings()
    loaded = [name for name, p in model.named_parameters() if p.is_meta and not name.startswith(head_name + ".")]
    for name in loaded:
        set_param(model, name, reader.get(name).to(device, dtype))
    acc = method.accumulator(head.in_features, device)

    def run_window(s):
        replay.index = s
        model(input_ids=windows[s:s + 1].to(device), use_cache=False)

    try:
        feed(head, acc, run_window, windows.shape[0])
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer
        for name in loaded:  # a large vocabulary's table is not held while the head is solved
            set_param(model, name, model.get_parameter(name).to("meta"))
    return acc
