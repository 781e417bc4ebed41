"""The quantized layer's replay from its last step's inputs. The pass that accumulates the last
step's statistic (a Llama layer's ``down_proj``) computes that step's input for every window; kept,
it spares the replay computing it again, and with it the step before's linears (``gate_proj`` and
``up_proj``), whose outputs would otherwise have to be kept, at several times the input's bytes.

In the replay those linears answer placeholders and the last step's linears get the kept input.
That gives the layer's own outputs only where the step before's linears reach them through that
input alone: :func:`replay_inputs` checks this on the traced window, whose output with the
substitution must equal the trace's in every element."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch

from .attention_memo import nbytes
from .capture import hidden_of
from .trace import LayerTrace

Reserve = Callable[[int], bool]  # bytes -> whether they fit the budget (and are now counted)
PLACEHOLDER_SEED = 0


class ReplayInputs:
    """The inputs of the ``last`` step's linears (names in ``layer``) per window, kept within
    ``reserve``'s budget by :meth:`keep`, and the placeholders the ``before`` step's linears answer
    while :meth:`substituting` is open."""

    def __init__(self, layer: torch.nn.Module, last: list[str], before: list[str], placeholders: dict,
                 windows: int, reserve: Reserve):
        self.layer, self.last, self.before, self.reserve = layer, last, before, reserve
        self.placeholders = placeholders
        self._kept: list[torch.Tensor | None] = [None] * windows

    def keep(self, window: int, x: torch.Tensor) -> None:
        """Keep window ``window``'s input of the last step, where it fits."""
        if self._kept[window] is None and self.reserve(nbytes(x)):
            self._kept[window] = x.to("cpu", copy=True)

    @contextmanager
    def substituting(self, window: int):
        """While open, the layer's forward for ``window`` takes its kept input (where there is one)."""
        x = self._kept[window]
        if x is None:
            yield
            return
        with _substituted(self.layer, self.last, self.before, x, self.placeholders):
            yield


def replay_inputs(layer: torch.nn.Module, trace: LayerTrace, x: torch.Tensor, kwargs: dict, windows: int,
                  reserve: Reserve) -> ReplayInputs | None:
    """A :class:`ReplayInputs` for the last two of the ``trace``'s steps, where ``layer``'s output
    for the traced window ``x`` is the trace's with the step before's linears answering
    placeholders and the last step getting its traced input; None where it is not, or where
    there is no step before the last."""
    if len(trace.steps) < 2:
        return None
    last, before = trace.steps[-1], trace.steps[-2]
    outputs = [trace.outputs.get(name) for name in before]
    if last[0] not in trace.inputs or not all(isinstance(out, torch.Tensor) for out in outputs):
        return None
    g = torch.Generator().manual_seed(PLACEHOLDER_SEED)
    placeholders = {name: torch.randn(out.shape, generator=g).to(out.dtype).to(out.device)
                    for name, out in zip(before, outputs)}
    with torch.inference_mode(), _substituted(layer, last, before, trace.inputs[last[0]], placeholders):
        substituted = hidden_of(layer(x, **kwargs))
    plain = trace.output
    same = plain.dtype == substituted.dtype and plain.shape == substituted.shape and torch.equal(plain, substituted)
    return ReplayInputs(layer, last, before, placeholders, windows, reserve) if same else None


@contextmanager
def _substituted(layer, last: list[str], before: list[str], x: torch.Tensor, placeholders: dict):
    """While open, ``last``'s linears take ``x`` (on their input's device, where its shape is
    theirs) and ``before``'s answer their placeholders."""
    def give_kept(module, args):
        if args and isinstance(args[0], torch.Tensor) and args[0].shape == x.shape:
            return (x.to(args[0].device), *args[1:])
        return None

    hooks = [layer.get_submodule(name).register_forward_pre_hook(give_kept) for name in last]
    answered = [layer.get_submodule(name) for name in before]
    saved = [vars(m).get("forward") for m in answered]
    for name, module in zip(before, answered):
        module.forward = lambda *a, _p=placeholders[name], **k: _p
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for module, forward in zip(answered, saved):
            if forward is None:
                del module.forward
            else:
                module.forward = forward
