"""Scoring a grid per group: the native kernel gives torch's bits, and both give the nearest
codes' weighted squared error and the refit's sums."""

import logging

import pytest
import torch
from conftest import vector_level
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.methods import candidates
from quantizer.methods.candidates import ERROR, grid_scores, lane_sum, torch_scores
from quantizer.methods.codes import (
    code_range,
    grid_values,
    group_sq_error,
    round_to_grid,
)


def problem(rows, groups, group, seed):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(rows, groups, group, generator=gen) * torch.rand(rows, groups, 1, generator=gen)
    weights = torch.rand(groups, group, generator=gen) * (torch.rand(groups, group, generator=gen) > 0.2)
    scale = (torch.rand(rows, groups, generator=gen) - 0.2) * 0.3  # some negative (signed symmetric grids)
    scale[torch.rand(rows, groups, generator=gen) < 0.1] = 0.0
    zero = torch.randn(rows, groups, generator=gen) * 0.1
    return g, weights, scale, zero


def native_and_torch_scores(g, weights, scale, zero, qmax):
    """The scores the native kernel and torch's form write for one problem (skips without the library)."""
    native = candidates.KERNEL.native()
    if native is None:
        pytest.skip("no native library here")
    results = []
    for kernel in (native, torch_scores):
        out = torch.full((*scale.shape, 4), float("nan"))
        kernel(g, weights, scale, zero, qmax, out)
        results.append(out)
    return results


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), groups=st.integers(1, 5), group=st.sampled_from([8, 16, 32, 64, 128]),
       bits=st.sampled_from([4, 5, 6]), seed=st.integers(0, 2**16))
def test_the_native_scores_are_torchs_bits(rows, groups, group, bits, seed):
    native, reference = native_and_torch_scores(*problem(rows, groups, group, seed), code_range(bits)[1])
    assert torch.equal(native, reference)


def test_groups_split_between_threads_mid_row_keep_their_weights():
    native, reference = native_and_torch_scores(*problem(1001, 3, 8, seed=5), 15)  # 3003 groups: threads start mid-row
    assert torch.equal(native, reference)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 20), groups=st.integers(1, 4), group=st.sampled_from([8, 12, 32, 48]),
       bits=st.sampled_from([4, 6]), weighted=st.booleans(), seed=st.integers(0, 2**16))
def test_scores_are_the_nearest_codes_error_and_the_refits_sums(rows, groups, group, bits, weighted, seed):
    g, weights, scale, zero = problem(rows, groups, group, seed)
    weights = weights if weighted else None
    scores = grid_scores(g, scale, zero, weights, bits)
    codes = round_to_grid(g, scale, zero, bits)
    w = torch.ones(groups, group) if weights is None else weights
    u = codes.to(torch.float32) - code_range(bits)[0]
    expected = torch.stack([group_sq_error(g, codes, scale, zero, weights, bits), (w * u).sum(-1),
                            (w * u * u).sum(-1), (w * u * g).sum(-1)], dim=-1)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    deq = grid_values(codes, scale, zero, bits)
    assert torch.all(scores[..., ERROR] >= 0) and torch.allclose(
        scores[..., ERROR], ((deq - g) ** 2 * w).sum(-1), rtol=1e-5, atol=1e-6)


def test_a_group_of_scale_zero_scores_its_zero_as_every_value():
    g = torch.tensor([[[0.5] * 8]])
    scores = grid_scores(g, torch.zeros(1, 1), torch.tensor([[0.25]]))
    assert scores[0, 0].tolist() == [8 * 0.25 ** 2, 0.0, 0.0, 0.0]


def test_lanes_sum_in_element_order_then_pairwise():
    values = [1e8, 1.0, -1e8, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]  # element 8 joins lane 0
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    lanes = [f32(1e8) + f32(1.0), f32(1.0), f32(-1e8), f32(1.0)] + [f32(0.0)] * 4
    expected = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
    assert lane_sum(torch.tensor(values).reshape(12, 1)).item() == expected.item() == 0.0
    assert sum(values) != 0.0


def test_a_scoring_kernel_that_computes_wrongly_is_not_used(caplog):
    def wrong(g, weights, scale, zero, qmax, out):
        torch_scores(g, weights, scale, zero, qmax, out)
        out[0, 0, ERROR] *= 1 + 2 ** -20

    with caplog.at_level(logging.WARNING):
        assert candidates.KERNEL.checked(wrong) is None
    assert "grid scoring gives other results" in caplog.text


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), groups=st.integers(1, 5), group=st.sampled_from([8, 16, 32, 64]),
       count=st.integers(1, 9), bits=st.sampled_from([4, 5, 6]), level=st.sampled_from([0, 1]),
       seed=st.integers(0, 2**16))
def test_the_native_errors_of_several_grids_are_each_grids_scored_error(rows, groups, group, count, bits, level,
                                                                         seed):
    """Sixteen groups side by side and the tail after them, on every vector path: each candidate's
    error is the ERROR column grid_scores gives that grid, to the bit."""
    native = candidates.ERRORS.native()
    if native is None:
        pytest.skip("no native library here")
    g, weights, _, _ = problem(rows, groups, group, seed)
    grids = [problem(rows, groups, group, seed + 1 + c)[2:] for c in range(count)]
    scales, zeros = (torch.stack([grid[i] for grid in grids]) for i in (0, 1))
    out = torch.full((count, rows, groups), float("nan"))
    with vector_level(level):
        native(g, weights, scales, zeros, code_range(bits)[1], out)
    for c, (scale, zero) in enumerate(grids):
        scores = torch.empty(rows, groups, 4)
        torch_scores(g, weights, scale, zero, code_range(bits)[1], scores)
        assert torch.equal(out[c], scores[..., ERROR])
