"""What one window's forward shows about a decoder layer: its quantized linears grouped into steps
of linears that share an input, in call order; when each module's output becomes final; which
modules return a linear's output as their own; and the window's values that
:mod:`.replay_inputs` checks against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .capture import hidden_of
from .output_cache import holds


@dataclass(frozen=True)
class Returned:
    """A module's output that is the output of its wanted linear ``linear``: that tensor itself
    (``arity`` None), or the first of a tuple of ``arity`` whose others are None."""

    linear: str
    arity: int | None

    def wrap(self, y: torch.Tensor):
        """The module's output given its linear's output ``y``."""
        return y if self.arity is None else (y, *[None] * (self.arity - 1))


@dataclass
class LayerTrace:
    """``steps``: the wanted linears' names by shared input, in call order. ``settles``: each
    module whose output may be kept once final -> the wanted linears that must be quantized
    first (those called before it returns). ``returns``: each of those modules whose output is
    a wanted linear's, unchanged. ``output``: the layer's hidden output for the window;
    ``inputs`` / ``outputs``: each wanted linear's."""

    steps: list[list[str]]
    settles: dict[str, frozenset[str]]
    returns: dict[str, Returned]
    output: torch.Tensor
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, object]


def trace_layer(layer: torch.nn.Module, x: torch.Tensor, kwargs: dict, wanted: set[str]) -> LayerTrace:
    """Run ``layer`` on one window ``x`` and record its :class:`LayerTrace`.

    A module may be kept (appears in ``settles``) where it is called once a forward and either
    holds a wanted linear, or holds none and returns one tensor no larger than the layer's input
    (a norm, say: recomputed by every pass, cheap to keep; an MLP's activation is several times
    larger and is called once more only)."""
    events: list[tuple[str, str]] = []  # ("enter" | "exit", module), in call order
    calls: list[tuple[str, torch.Tensor]] = []  # holding the inputs keeps them alive and distinct
    inputs: dict[str, torch.Tensor] = {}
    outputs: dict[str, object] = {}
    small: set[str] = set()  # modules whose output is one tensor no larger than the layer's input
    returned: dict[str, Returned] = {}

    def entered(module, args, name):
        events.append(("enter", name))
        if name in wanted and args:
            calls.append((name, args[0]))
            inputs.setdefault(name, args[0].clone())

    def exited(module, args, out, name):
        events.append(("exit", name))
        if name in wanted:
            outputs.setdefault(name, out)
        elif (found := _returned(out, outputs)) is not None:
            returned.setdefault(name, found)
        if isinstance(out, torch.Tensor) and out.numel() <= x.numel():
            small.add(name)

    hooks = []
    for name, module in layer.named_modules():
        if name:
            hooks.append(module.register_forward_pre_hook(lambda m, a, n=name: entered(m, a, n)))
            hooks.append(module.register_forward_hook(lambda m, a, out, n=name: exited(m, a, out, n)))
    try:
        with torch.inference_mode():
            out = layer(x, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    settles = _settles(events, wanted, small)
    returns = {name: r for name, r in returned.items()
               if name in settles and _recomputes(layer.get_submodule(r.linear), inputs[r.linear], outputs[r.linear])}
    return LayerTrace(_steps(calls), settles, returns, hidden_of(out), inputs, outputs)


def _returned(out, outputs: dict[str, object]) -> Returned | None:
    """Which wanted linear's output ``out`` is (by identity), as itself or as the first of a
    tuple whose others are None; None where it is none's."""
    if isinstance(out, torch.Tensor):
        first, arity = out, None
    elif isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) and all(o is None for o in out[1:]):
        first, arity = out[0], len(out)
    else:
        return None
    return next((Returned(name, arity) for name, o in outputs.items() if o is first), None)


def _recomputes(linear: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``linear`` on its traced input gives its traced output as the module returned it
    (a module that changed it in place does not return the linear's output)."""
    with torch.inference_mode():
        again = linear(x)
    return again.dtype == out.dtype and again.shape == out.shape and torch.equal(again, out)


def _steps(calls: list[tuple[str, torch.Tensor]]) -> list[list[str]]:
    """Linears that receive the very same input tensor (identity, not address: a freed input's
    address can be reused) in consecutive calls form one step."""
    steps: list[list[str]] = []
    last_input = None
    for name, inp in calls:
        if steps and inp is last_input and name not in steps[-1]:
            steps[-1].append(name)
        elif not any(name in s for s in steps):
            steps.append([name])
        last_input = inp
    return steps


def _settles(events: list[tuple[str, str]], wanted: set[str], small: set[str]) -> dict[str, frozenset[str]]:
    entered_linears: list[str] = []
    counts: dict[str, int] = {}
    settles: dict[str, frozenset[str]] = {}
    for kind, name in events:
        if kind == "enter":
            counts[name] = counts.get(name, 0) + 1
            if name in wanted:
                entered_linears.append(name)
        else:
            settles.setdefault(name, frozenset(entered_linears))
    return {name: needs for name, needs in settles.items()
            if counts[name] == 1 and (name in small or holds(name, wanted))}
