"""The size allocation: the least total loss that fits, checked against every combination on small
random problems, and within a unit per module of it on large ones."""

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.quantization.allocation import RESOLUTION, Choice, allocate


def problems():
    option = st.tuples(st.integers(1, 40), st.floats(0.0, 10.0))
    module = st.lists(option, min_size=1, max_size=4)
    return st.lists(module, min_size=1, max_size=4)


def as_choices(problem) -> dict[str, list[Choice]]:
    return {f"m{i}": [Choice(j, b, loss) for j, (b, loss) in enumerate(opts)] for i, opts in enumerate(problem)}


@settings(max_examples=200, deadline=None)
@given(problem=problems(), slack=st.integers(0, 60))
def test_the_allocation_fits_and_no_combination_that_fits_has_less_loss(problem, slack):
    choices = as_choices(problem)
    budget = sum(min(c.nbytes for c in cs) for cs in choices.values()) + slack
    chosen = allocate(choices, budget)
    assert chosen.keys() == choices.keys() and sum(c.nbytes for c in chosen.values()) <= budget
    loss = sum(c.loss for c in chosen.values())
    for combo in itertools.product(*choices.values()):
        if sum(c.nbytes for c in combo) <= budget:
            assert loss <= sum(c.loss for c in combo) + 1e-9


def test_a_large_budget_is_filled_to_within_a_unit_per_module():
    rng = random.Random(0)
    choices = {f"m{i}": [Choice(j, rng.randint(10**5, 10**7) * (j + 1), 1.0 / (j + 1)) for j in range(4)]
               for i in range(60)}
    budget = sum(max(c.nbytes for c in cs) for cs in choices.values()) // 2
    used = sum(c.nbytes for c in allocate(choices, budget).values())
    assert budget - 60 * budget // RESOLUTION <= used <= budget


def test_a_budget_below_the_smallest_options_is_refused():
    with pytest.raises(ValueError, match="over the budget"):
        allocate(as_choices([[(4, 1.0)], [(6, 1.0)]]), 9)
