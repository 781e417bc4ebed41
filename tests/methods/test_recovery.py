"""Grid recovery: a weight that already sits on a GGUF type's grid (built here from random blocks
and decoded by the gguf package, as a dequantized GGUF or a quantization-aware-trained checkpoint
is) comes back from every method bit for bit; a weight on no grid keeps the search's grids."""

from unittest import mock

import numpy as np
import pytest
import torch

from conftest import on_gguf_grid as on_grid
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.formats.gguf.blocks import TYPES, encode
from quantizer.methods import recovery
from quantizer.methods.codes import code_range
from quantizer.methods.gptq import gptq_quantize
from quantizer.methods.grid import quantize_groupwise, weighted_grid_search
from quantizer.methods.recovery import recovered_grids, with_recovered

gguf = pytest.importorskip("gguf")

GROUP = {"Q6_K": 16}
NEAR_GRID = {"Q4_0": 1.0, "Q4_1": 1.5, "Q5_1": 10.0}  # a near grid's error over the original grid's, at most
SYMMETRIC = {"Q4_0", "Q5_0", "Q6_K", "IQ4_NL", "IQ4_XS"}


def decoded(q, kind: str) -> torch.Tensor:
    data = encode(q, TYPES[kind]).numpy()
    return torch.from_numpy(gguf.quants.dequantize(data, getattr(gguf.GGMLQuantizationType, kind))).float()


@pytest.mark.parametrize("kind", list(TYPES.keys() - {"Q8_0"}))
@pytest.mark.parametrize("seed", [0, 1])
def test_a_weight_on_a_gguf_grid_is_recovered_bit_for_bit_by_round_to_nearest_and_the_weighted_search(kind, seed):
    w = on_grid(kind, 80, 512, seed)
    storage, group, symmetric = TYPES[kind].storage, GROUP.get(kind, 32), kind in SYMMETRIC
    q = quantize_groupwise(w, group, symmetric=symmetric, storage=storage)
    assert torch.equal(decoded(q, kind), w)
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(512, generator=gen).reshape(-1, group)
    scale, zero, codes = weighted_grid_search(w.reshape(80, -1, group), weights, symmetric, storage)
    from quantizer.methods.grid import GroupQuantized

    assert torch.equal(decoded(GroupQuantized(codes.reshape(80, 512), scale, zero, storage.bits, storage.codebook),
                               kind), w)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K"])
def test_gptq_keeps_a_weight_on_a_gguf_grid_bit_for_bit(kind):
    w = on_grid(kind, 64, 256, 3)
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(3))
    q, _ = gptq_quantize(w, x.t() @ x, 32, symmetric=kind in SYMMETRIC, storage=TYPES[kind].storage)
    assert torch.equal(decoded(q, kind), w)


def test_a_weight_on_no_grid_keeps_the_searchs_grids():
    w = torch.randn(96, 512, generator=torch.Generator().manual_seed(0)) * 0.02
    g = w.reshape(96, -1, 32)
    for kind in ("Q4_0", "Q4_1", "Q4_K"):
        found = recovered_grids(g, kind in SYMMETRIC, 4, TYPES[kind].storage.superblock)
        assert found is None or not bool(found[2].any())
        storage = TYPES[kind].storage
        scale, zero = (torch.rand(96, 16).to(storage.exact_dtype) for _ in range(2))
        kept = with_recovered(g, scale, zero, storage, kind in SYMMETRIC)
        assert torch.equal(kept[0], scale) and torch.equal(kept[1], zero)


def test_one_group_off_its_grid_leaves_its_super_block_to_the_search_and_the_rest_exact():
    w = on_grid("Q4_K", 8, 512, 5)
    w[3, 7] += 1e-3  # row 3's first super-block is on no grid now
    q = quantize_groupwise(w, 32, symmetric=False, storage=TYPES["Q4_K"].storage)
    back = decoded(q, "Q4_K")
    same = (back == w).reshape(8, 2, 256).all(-1)
    assert not bool(same[3, 0]) and bool(same.sum() == 15)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_1", "Q4_K", "Q6_K"])
def test_a_grid_rounded_to_bf16_comes_back_near_its_grid_and_never_worse_than_the_search(kind):
    grid = on_grid(kind, 64, 512, 7)
    w = grid.bfloat16().float()  # a dequantized GGUF saved as a bf16 checkpoint
    storage, group, symmetric = TYPES[kind].storage, GROUP.get(kind, 32), kind in SYMMETRIC
    q = quantize_groupwise(w, group, symmetric=symmetric, storage=storage)
    with mock.patch("quantizer.methods.grid.with_recovered", lambda g, s, z, *a, **k: (s, z)):
        searched = quantize_groupwise(w, group, symmetric=symmetric, storage=storage)
    err, search_err = ((decoded(x, kind) - w).pow(2).sum() for x in (q, searched))
    assert err <= search_err
    if not TYPES[kind].kquant:  # a K-quant's near grids are found only where llama.cpp's units fit them
        assert err <= NEAR_GRID[kind] * (grid - w).pow(2).sum() and err < search_err / 10


@settings(max_examples=30, deadline=None)
@given(groups=st.integers(1, 40), size=st.sampled_from([16, 32]), bits=st.sampled_from([4, 5, 6]),
       symmetric=st.booleans(), slack=st.sampled_from([0.0, 2.0**-20, 2.0**-7]), seed=st.integers(0, 2**16))
def test_the_native_first_fit_is_the_torch_checks_first_candidate(groups, size, bits, symmetric, slack, seed):
    """Candidates a step or a low off each group's own grid, the grid itself at a random place among
    them (or nowhere): the native kernel and torch pick the same first candidate, or none."""
    native = recovery.FIRST_FIT.native()
    if native is None:
        pytest.skip("no native library here")
    gen = torch.Generator().manual_seed(seed)
    mid, qmax = code_range(bits)
    step = (torch.rand(groups, generator=gen) * 0.01 + 1e-3).to(torch.float16).to(torch.float64)
    low = torch.zeros_like(step) if symmetric else -(torch.rand(groups, generator=gen) * 0.05).to(
        torch.float16).to(torch.float64)
    codes = torch.randint(0, qmax + 1, (groups, size), generator=gen).to(torch.float64) - (mid if symmetric else 0)
    x = (codes * step[:, None]).to(torch.float32) + low[:, None].to(torch.float32)
    x[torch.rand(groups, generator=gen) < 0.3] += torch.randn(size, generator=gen) * 1e-4
    count = 6
    nudges = 1.0 + (torch.randint(-2, 3, (count, groups), generator=gen) * 0.003).to(torch.float64)
    nudges[torch.randint(0, count, (groups,), generator=gen), torch.arange(groups)] = 1.0
    steps, lows = (step * nudges).contiguous(), low.expand(count, groups).contiguous()
    picked = [torch.full((groups,), 99, dtype=torch.int64) for _ in range(2)]
    native(x, steps, lows, qmax, symmetric, slack, picked[0])
    recovery.torch_first_fit(x, steps, lows, qmax, symmetric, slack, picked[1])
    assert torch.equal(*picked)
