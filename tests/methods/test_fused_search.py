"""The grid searches' fused candidate loops: each native kernel writes its torch loop's bits on
every vector path (sixteen groups side by side, and the group-by-group tail), on any shape, and
the searches that use them give the torch loops' grids."""

import pytest
import torch
from conftest import vector_level
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.formats.gguf.blocks import Q4_K, Q5_K, Q6_K
from quantizer.methods import candidates, fused_search, llama_searches, recovery, shrink_search
from quantizer.methods.codes import code_range
from quantizer.methods.grid import quantize_groupwise
from quantizer.methods.llama_searches import IMPORTANCE_STRETCH, SIGNED_STRETCHES, STRETCHES
from quantizer.methods.shrink_search import WEIGHTED_SHRINKS

KERNELS = (shrink_search.SHRINK, llama_searches.STRETCH, llama_searches.SIGNED, candidates.ERRORS,
           recovery.FIRST_FIT)


def groups_of(rows, groups, size, seed):
    """Seeded groups [rows, groups, size] of mixed spread, with some flat, zero and outlier groups."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, groups, size, generator=gen) * torch.rand(rows, groups, 1, generator=gen)
    x[torch.rand(rows, groups, generator=gen) < 0.05] = 0.125
    x[torch.rand(rows, groups, generator=gen) < 0.05] = 0.0
    x[..., 0] += 3.0 * (torch.rand(rows, groups, generator=gen) < 0.1)
    return x, gen


def native(kernel):
    found = kernel.native()
    if found is None:
        pytest.skip("no native library here")
    return found


def both(kernel, run, level):
    """What ``run(k)`` returns with the native kernel (on vector path ``level``) and with the torch loop."""
    kernel_here = native(kernel)
    with vector_level(level):
        mine = run(kernel_here)
    return mine, run(kernel.reference)


shapes = dict(rows=st.integers(1, 21), groups=st.integers(1, 5), size=st.sampled_from([8, 16, 24, 32, 64]),
              level=st.sampled_from([0, 1]), seed=st.integers(0, 2**16))


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([4, 5, 6]), symmetric=st.booleans(), **shapes)
def test_the_shrink_kernel_writes_the_torch_loops_bits(rows, groups, size, level, seed, bits, symmetric):
    x, gen = groups_of(rows, groups, size, seed)
    weights = torch.rand(groups, size, generator=gen) * (torch.rand(groups, size, generator=gen) > 0.2)
    fixed = weights.sum(-1), (weights * x).sum(-1)
    mine, reference = both(shrink_search.SHRINK, lambda k: fused_search.shrink_search(
        k, x, weights, x.amin(-1), x.amax(-1), fixed, symmetric, bits, WEIGHTED_SHRINKS), level)
    assert all(torch.equal(a, b) for a, b in zip(mine, reference))


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([4, 5]), importance=st.booleans(), **shapes)
def test_the_stretch_kernel_writes_the_torch_loops_bits(rows, groups, size, level, seed, bits, importance):
    x, gen = groups_of(rows, groups, size, seed)
    weights = torch.rand(x.shape, generator=gen) * (torch.rand(x.shape, generator=gen) > 0.2)
    low = x.amin(-1).clamp(max=0.0)
    span = x.amax(-1) - low
    span = torch.where(span == 0, 1.0, span)
    wx = weights * x
    first, delta, count = IMPORTANCE_STRETCH if importance else STRETCHES[bits]
    nmax = code_range(bits)[1]
    steps = [float(nmax)] + [first + delta * i + nmax for i in range(count + 1)]
    mine, reference = both(llama_searches.STRETCH, lambda k: fused_search.stretch_search(
        k, x, weights, low, span, (weights.sum(-1), wx.sum(-1), (wx * x).sum(-1)), steps, bits), level)
    assert all(torch.equal(a, b) for a, b in zip(mine, reference))


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([4, 6]), squares=st.booleans(), **shapes)
def test_the_signed_kernel_writes_the_torch_loops_bits(rows, groups, size, level, seed, bits, squares):
    x, gen = groups_of(rows, groups, size, seed)
    weights = x * x if squares else torch.rand(x.shape, generator=gen)
    top = x.gather(-1, x.abs().argmax(-1, keepdim=True)).squeeze(-1)
    top = torch.where(top == 0, 1.0, top)
    nmax = code_range(bits)[0]
    steps = [nmax] + [nmax + 0.1 * s for s in SIGNED_STRETCHES]
    mine, reference = both(llama_searches.SIGNED, lambda k: fused_search.signed_search(
        k, x, weights, top, steps, bits), level)
    assert torch.equal(mine, reference)


def test_groups_split_between_threads_keep_their_weights():
    """3003 groups of one weight's 3 columns: threads start mid-row and mid-block of sixteen."""
    x, gen = groups_of(1001, 3, 32, seed=4)
    weights = torch.rand(3, 32, generator=gen)
    fixed = weights.sum(-1), (weights * x).sum(-1)
    mine, reference = both(shrink_search.SHRINK, lambda k: fused_search.shrink_search(
        k, x, weights, x.amin(-1), x.amax(-1), fixed, False, 4, WEIGHTED_SHRINKS), 2)
    assert all(torch.equal(a, b) for a, b in zip(mine, reference))


@pytest.mark.parametrize("block", [Q4_K, Q5_K, Q6_K], ids=lambda b: b.name)
@pytest.mark.parametrize("importance", [False, True])
def test_the_k_quant_search_gives_the_torch_loops_grids_and_codes(block, importance):
    for kernel in KERNELS:
        native(kernel)
        assert kernel() is not kernel.reference, f"{kernel.what}: the native kernel failed its probe"
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(48, 512, generator=gen) * 0.02).to(torch.bfloat16)
    column_weights = torch.rand(512, generator=gen) + 0.1 if importance else None
    size = 16 if block is Q6_K else 32

    def quantized():
        return quantize_groupwise(w, size, symmetric=block is Q6_K, storage=block.storage,
                                  column_weights=column_weights).tensors

    mine = quantized()
    chosen = [list(k._chosen) for k in KERNELS]
    try:
        for k in KERNELS:
            k._chosen[:] = [k.reference]
        reference = quantized()
    finally:
        for k, before in zip(KERNELS, chosen):
            k._chosen[:] = before
    assert all(torch.equal(a, b) for a, b in zip(mine, reference))
