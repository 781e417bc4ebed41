"""GPTQ's in-block column loop: int4q's native kernel gives the torch loop's codes, errors and
updated weights to the bit, on any block, and is refused where it does not."""

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.methods import gptq_columns
from quantizer.methods.gptq_columns import ColumnGrids, torch_columns


def block(b, n, seed, flat_column):
    g = torch.Generator().manual_seed(seed)
    grids = ColumnGrids(n, torch.arange(b))
    grids.set(range(b), (torch.rand(b, n, generator=g) * 0.1).to(torch.bfloat16),
              (torch.randn(b, n, generator=g) * 0.05).to(torch.bfloat16))
    if flat_column is not None:
        grids.set(range(flat_column % b, flat_column % b + 1), torch.zeros(n), torch.randn(n, generator=g))
    U1 = (torch.randn(b, b, generator=g) * 0.2).triu() + torch.eye(b) * (0.5 + torch.rand(b, generator=g))
    return torch.randn(b, n, generator=g) * 0.1, U1, grids


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 140), n=st.integers(1, 300), cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
       flat_column=st.one_of(st.none(), st.integers(0, 200)), seed=st.integers(0, 2**16),
       bits=st.sampled_from([4, 5, 6]))
def test_the_native_kernel_gives_the_torch_loops_bits(b, n, cut, flat_column, seed, bits):
    native = gptq_columns.KERNEL.native()
    if native is None:
        pytest.skip("no native library here")
    first, last = sorted(int(c * b) for c in cut)
    W, U1, grids = block(b, n, seed, flat_column)
    results = []
    for kernel in (native, torch_columns):
        W1, codes, err = W.clone(), torch.full((b, n), -1.0), torch.full((b, n), -1.0)
        kernel(W1, U1, grids.block(0, b), codes, err, first, last, bits)
        results.append((W1, codes, err))
    for a, t in zip(*results):
        assert torch.equal(a, t)
    codes = results[0][1][first:last]
    assert torch.equal(codes, codes.round()) and bool(((codes >= 0) & (codes <= 2**bits - 1)).all())


@pytest.mark.parametrize("broken_bits", [4, 6])
def test_a_kernel_that_computes_wrongly_is_not_used(caplog, broken_bits):
    def wrong(W1, U1, grids, codes, err, first, last, bits=4):
        torch_columns(W1, U1, grids, codes, err, first, last, bits)
        if bits == broken_bits:
            codes[first] = 15 - codes[first]

    with caplog.at_level(logging.WARNING):
        assert gptq_columns.KERNEL.checked(wrong) is None
    assert "GPTQ column loop gives other results" in caplog.text
