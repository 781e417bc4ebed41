"""Choosing one option per module under a size budget: the least total measured loss whose bytes
fit (a multiple-choice knapsack). Pure functions.

Solved by dynamic programming over the budget cut into at most :data:`RESOLUTION` units: for
each module in turn, the least loss of the modules so far within every number of units. Sizes
are rounded to the nearest unit, so the true total is checked and the budget cut a unit at a time
until it fits; with small budgets a unit is one byte and the result is exact.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

RESOLUTION = 20000  # budget units: the allocation is optimal to within one unit per module


@dataclass(frozen=True)
class Choice:
    """One module's option: its size in bytes and its measured loss."""

    option: Hashable
    nbytes: int
    loss: float


def allocate(choices: dict[str, list[Choice]], budget: int) -> dict[str, Choice]:
    """Module -> its chosen option: the combination of least total loss whose bytes fit in
    ``budget``. ValueError where even the smallest options exceed it."""
    smallest = sum(min(c.nbytes for c in cs) for cs in choices.values())
    if smallest > budget:
        raise ValueError(f"the smallest options take {smallest} bytes, over the budget of {budget}")
    unit = max(1, budget // RESOLUTION)
    cap = budget // unit
    while True:
        chosen = _solve(choices, unit, cap)
        total = sum(c.nbytes for c in chosen.values())
        if total <= budget:
            return chosen
        cap -= -(-(total - budget) // unit)


def _solve(choices: dict[str, list[Choice]], unit: int, cap: int) -> dict[str, Choice]:
    """The least-loss combination whose sizes, rounded to ``unit`` bytes, sum to at most ``cap``
    units (each module's smallest option where even those do not)."""
    sizes = {m: [round(c.nbytes / unit) for c in cs] for m, cs in choices.items()}
    if sum(min(s) for s in sizes.values()) > cap:
        return {m: min(cs, key=lambda c: c.nbytes) for m, cs in choices.items()}
    best = np.zeros(cap + 1)  # least loss of the modules so far within b units
    picks = []
    for m, options in choices.items():
        new = np.full(cap + 1, np.inf)
        pick = np.zeros(cap + 1, dtype=np.int16)
        for j, (size, c) in enumerate(zip(sizes[m], options)):
            if size <= cap:
                trial = np.concatenate([np.full(size, np.inf), best[:cap + 1 - size] + c.loss])
                better = trial < new
                new[better], pick[better] = trial[better], j
        best = new
        picks.append(pick)
    b, chosen = cap, {}
    for m, pick in zip(reversed(list(choices)), reversed(picks)):
        j = int(pick[b])
        chosen[m] = choices[m][j]
        b -= sizes[m][j]
    return {m: chosen[m] for m in choices}
