"""Attention computed once per window and layer: the passes over a layer's windows that follow
the attention's inputs being final (the pass that captures the output projection's input, then
the one that captures the MLP's) call the attention with the very same queries, keys and values.
While a memo is open, transformers' attention functions (those of its ``AttentionInterface``,
SDPA among them) keep each window's inputs and output, and answer a call whose inputs are equal,
element for element, with the kept output. A call that differs in anything is computed."""

from __future__ import annotations

from typing import Callable

import torch

Reserve = Callable[[int], bool]  # bytes -> whether they fit the budget (and are now counted)


class AttentionMemo:
    """The memo of one layer's attention, per window; ``reserve`` decides what fits; the
    attention of the modules whose ids are in ``skipped`` is never kept. The driver sets
    :attr:`window` to the window each forward runs. A context manager: the attention functions
    are wrapped while it is open."""

    def __init__(self, reserve: Reserve, skipped: set[int] = frozenset()):
        self.window, self.reserve, self.skipped = 0, reserve, skipped
        self._kept: dict[tuple[int, int], tuple] = {}  # (module id, window) -> (inputs, output)
        self._restore: list[tuple[dict, str, Callable]] = []

    def __enter__(self) -> "AttentionMemo":
        for mapping in _mappings():
            for name, fn in list(mapping.items()):
                self._restore.append((mapping, name, fn))
                mapping[name] = self._answering(fn)
        return self

    def __exit__(self, *exc) -> None:
        for mapping, name, fn in reversed(self._restore):
            mapping[name] = fn
        self._restore.clear()
        self._kept.clear()

    def forget(self, module) -> int:
        """Drop what is kept for ``module``'s attention; returns the bytes given back."""
        slots = [slot for slot in self._kept if slot[0] == id(module)]
        return sum(nbytes(self._kept.pop(slot)) for slot in slots)

    def _answering(self, compute):
        def attention(module, query, key, value, attention_mask, *args, **kwargs):
            inputs = (query, key, value, attention_mask, args, kwargs)
            slot = (id(module), self.window)
            kept = self._kept.get(slot)
            if kept is not None and _same(kept[0], inputs):
                return _copy(kept[1])
            out = compute(module, query, key, value, attention_mask, *args, **kwargs)
            if (query.shape[0] == 1 and kept is None and id(module) not in self.skipped
                    and self.reserve(nbytes(inputs) + nbytes(out))):
                self._kept[slot] = (_copy(inputs), _copy(out))
            return out
        return attention


def _mappings() -> list[dict]:
    """The attention functions transformers dispatches to: its class-wide mapping and the shared
    instance's own entries."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    return [AttentionInterface._global_mapping, ALL_ATTENTION_FUNCTIONS._local_mapping]


def _same(a, b) -> bool:
    """Equal structure and values: tensors by dtype, shape and every element; the rest by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and a.device == b.device and torch.equal(a, b))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a value that cannot say whether it is equal is taken as different
        return False


def nbytes(value) -> int:
    """Bytes of every tensor in ``value`` (tensors, and tuples, lists and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    return 0


def _copy(value):
    """A copy of every tensor in ``value`` (a caller may change one in place)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value
