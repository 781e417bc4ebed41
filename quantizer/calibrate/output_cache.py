"""A layer's finished parts answered from memory: once the linears called before a module returns
are quantized (none, for the first norm; the attention's, for the attention and the norm after
it), its output no longer changes. The first pass over the windows after that keeps it, and every
later pass (the next steps' captures, the replay of the layer) reads it instead of computing it
again. Which modules qualify, and after which linears, comes from a trace of the layer
(:mod:`.trace`). A module whose output is its last linear's (an attention's output projection,
an MLP's down projection) is answered, once final, by that linear on its input as the linear's
own step captured it: the step's pass keeps the input, and nothing inside the module is kept or
computed again. What does not fit the budget is computed each time, as without the cache;
the values are the same either way. While it is open, the attention of a module not answered
that way is computed once per window (:mod:`.attention_memo`), within the same budget."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..memory import available_memory_bytes
from .attention_memo import AttentionMemo, nbytes

if TYPE_CHECKING:
    from .trace import Returned

CACHE_TO_INPUT = 5
"""The cache holds at most this many times the bytes of the layer's input activations as fp32,
ten hidden vectors of bf16 a token: a Llama layer's two norms' and attention's outputs and its
down projection's input up to an intermediate size of seven times the hidden size (Qwen2.5-1.5B's
8960 / 1536 needs 8.8); a wider MLP has part of it computed again."""


def holds(module: str, names) -> bool:
    """Whether the module named ``module`` is, or contains, one of the modules ``names``."""
    return any(n == module or n.startswith(module + ".") for n in names)


def output_cache_budget(hidden: torch.Tensor) -> int:
    """Bytes the cache of one layer may hold, for input activations ``hidden`` [S, T, H]:
    :data:`CACHE_TO_INPUT` times theirs (as fp32), and no more than half the memory available now."""
    return min(CACHE_TO_INPUT * hidden.numel() * 4, available_memory_bytes() // 2)


class OutputCache:
    """Outputs of ``layer``'s finished modules for each of ``windows`` windows of ``tokens``
    tokens, at most ``budget_bytes`` in all (on the CPU). ``linears``: the names of the layer's
    linears that will be quantized; ``settles``: the modules that may be kept -> the linears that
    must be quantized first (:attr:`.trace.LayerTrace.settles`); ``returns``: those of them whose
    output is a linear's (:attr:`.trace.LayerTrace.returns`). The driver sets :attr:`window` to
    the window each forward runs, and gives a step's inputs to :meth:`keeper`'s function. A
    context manager: on leaving, the modules get their own forward back and the outputs are
    dropped."""

    def __init__(self, layer: torch.nn.Module, linears: set[str], windows: int, tokens: int, budget_bytes: int,
                 settles: dict[str, frozenset[str]], returns: dict[str, "Returned"] | None = None):
        self.layer, self.windows, self.tokens, self.budget = layer, windows, tokens, budget_bytes
        self._linears, self._pending, self._settles = set(linears), set(linears), settles
        self._returns = dict(returns or {})
        self._outputs: dict[str, list] = {}  # module -> its output per window (None: not kept)
        self._inputs: dict[str, list] = {}  # returned linear -> its input per window (None: not kept)
        self.used_bytes = 0
        skipped = {id(m) for name in self._returns for m in layer.get_submodule(name).modules()}
        self.memo = AttentionMemo(self.reserve, skipped)
        self._answer_settled(set())

    @property
    def window(self) -> int:
        return self.memo.window

    @window.setter
    def window(self, s: int) -> None:
        self.memo.window = s

    def __enter__(self) -> "OutputCache":
        self.memo.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def answers_through(self, names: list[str]) -> bool:
        """Whether a module will be answered by one of the linears ``names`` on its kept inputs."""
        return any(r.linear in names for r in self._returns.values())

    def keeper(self, names: list[str]):
        """The function (window, input) that keeps the step ``names``' input for the modules
        answered through one of its linears, within the budget; None where there are none."""
        kept = [self._inputs.setdefault(r.linear, [None] * self.windows)
                for r in self._returns.values() if r.linear in names]
        if not kept:
            return None

        def keep(window: int, x: torch.Tensor) -> None:
            for inputs in kept:
                if inputs[window] is None and self.reserve(nbytes(x)):
                    inputs[window] = x.to("cpu", copy=True)
        return keep

    def finish(self, names: list[str], keep_outputs: bool = True) -> None:
        """The linears ``names`` are quantized: keep the outputs of every module this settles, as
        far as the budget allows; unless not ``keep_outputs``, those of the modules that hold one
        of ``names`` too (the replay does without them). Once every linear is, nothing more is
        kept: what remains is the replay, the last pass."""
        self._pending -= set(names)
        self._drop_inside_complete()
        self._answer_settled(set() if keep_outputs else set(names))

    def _answer_settled(self, skip: set[str]) -> None:
        """Answer from memory every settled module not yet answered, not inside one that is or
        that will be answered through a linear still pending, and holding none of ``skip``."""
        finished = self._linears - self._pending
        through_later = [m for m, r in self._returns.items() if r.linear in self._pending]
        for name, needs in sorted(self._settles.items(), key=lambda item: item[0].count(".")):  # outer first
            inside_answered = any(name.startswith(other + ".") for other in [*self._outputs, *through_later])
            if (name not in self._outputs and not inside_answered and needs <= finished
                    and not holds(name, self._pending) and not holds(name, skip)):
                module = self.layer.get_submodule(name)
                self._outputs[name] = [None] * self.windows
                module.forward = self._answering(name, module.forward)

    def close(self) -> None:
        """Give the modules their own forward back, close the memo and drop what was kept."""
        for name in list(self._outputs):
            self._drop(name)
        self._inputs.clear()
        self.memo.__exit__(None, None, None)
        self.used_bytes = 0

    def reserve(self, size: int) -> bool:
        """Whether ``size`` more bytes fit the budget; if they do, they are counted from now on."""
        if self.used_bytes + size > self.budget:
            return False
        self.used_bytes += size
        return True

    def _drop_inside_complete(self) -> None:
        """Modules inside one whose outputs are kept for every window are no longer called, and
        neither is the attention inside them."""
        complete = [n for n, outs in self._outputs.items() if all(o is not None for o in outs)]
        for name in list(self._outputs):
            if any(name.startswith(c + ".") for c in complete):
                self._drop(name)
        for c in complete:
            for module in self.layer.get_submodule(c).modules():
                self.used_bytes -= self.memo.forget(module)

    def _drop(self, name: str) -> None:
        del self.layer.get_submodule(name).forward
        self.used_bytes -= sum(nbytes(o) for o in self._outputs.pop(name) if o is not None)

    def _answering(self, name: str, compute):
        def forward(*args, **kwargs):
            outs, s = self._outputs[name], self.window
            first = _one_window(args, kwargs, self.tokens)
            if outs[s] is not None and first is not None:
                if self._pending:
                    return _copy(outs[s], first.device)
                y, outs[s] = outs[s], None  # the replay reads each window's once: handed over
                self.used_bytes -= nbytes(y)
                return _copy(y, first.device, copy=False)
            kept = self._kept_input(name, s) if first is not None else None
            y = compute(*args, **kwargs) if kept is None else self._through_linear(name, kept.to(first.device))
            if self._pending and first is not None and _storable(y) and self.reserve(nbytes(y)):
                outs[s] = _copy(y, "cpu")
            return y
        return forward

    def _kept_input(self, module: str, window: int) -> torch.Tensor | None:
        """The kept input of the linear ``module`` returns, for ``window``, let go of; or None."""
        returned = self._returns.get(module)
        inputs = self._inputs.get(returned.linear) if returned is not None else None
        x = inputs[window] if inputs is not None else None
        if x is not None:
            inputs[window] = None
            self.used_bytes -= nbytes(x)
        return x

    def _through_linear(self, module: str, x: torch.Tensor):
        returned = self._returns[module]
        return returned.wrap(self.layer.get_submodule(returned.linear)(x))


def _one_window(args, kwargs, tokens: int) -> torch.Tensor | None:
    """The call's first tensor input where it is one window, [1, tokens, ...]; else None."""
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return first if first is not None and first.dim() >= 2 and tuple(first.shape[:2]) == (1, tokens) else None


def _storable(y) -> bool:
    """A tensor, or a tuple of tensors and Nones (an attention module's output and weights)."""
    if isinstance(y, torch.Tensor):
        return True
    return isinstance(y, tuple) and all(t is None or isinstance(t, torch.Tensor) for t in y)


def _copy(y, device, copy: bool = True):
    """An output on ``device``: a copy unless not ``copy`` (a caller may change its result in place)."""
    if isinstance(y, tuple):
        return tuple(None if t is None else _copy(t, device, copy) for t in y)
    return y.to(device, copy=copy)
