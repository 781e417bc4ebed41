"""Round-to-nearest on bf16 min/max grids in one pass: the native kernel writes torch's bits, and
both are quantize_groupwise's grids and codes with the error statistics of quantize_rtn's chunked
loop."""

import pytest
import torch
from conftest import vector_level
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.methods import minmax
from quantizer.methods.error_stats import ErrorStats
from quantizer.methods.grid import quantize_groupwise
from quantizer.methods.minmax import minmax_rtn, torch_minmax
from quantizer.methods.rtn import quantize_rtn
from quantizer.schema.scheme import ModuleScheme


def weight(rows, k, seed, spread=3.0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, k, generator=gen) * torch.logspace(-spread, 0, rows)[:, None]
    w[torch.rand(rows, k, generator=gen) < 0.05] = 0.0
    if rows > 1:
        w[1] = 0.25  # a constant row: every group's scale is 0
    return w.to(torch.bfloat16)


def written(kernel, w, group, symmetric):
    n, k = w.shape
    out = (torch.full((n, k), 99, dtype=torch.uint8), torch.full((n, k // group), float("nan"), dtype=torch.bfloat16),
           torch.full((n, k // group), float("nan"), dtype=torch.bfloat16), torch.full((n, 3), float("nan"),
                                                                                      dtype=torch.float64))
    kernel(w, group, symmetric, *out)
    return out


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), groups=st.integers(1, 5), group=st.sampled_from([32, 64, 128]),
       symmetric=st.booleans(), level=st.sampled_from([0, 1]), seed=st.integers(0, 2**16))
def test_the_native_pass_writes_torchs_bits_on_every_vector_path(rows, groups, group, symmetric, level, seed):
    native = minmax.KERNEL.native()
    if native is None:
        pytest.skip("no native library here")
    w = weight(rows, groups * group, seed)
    with vector_level(level):
        mine = written(native, w, group, symmetric)
    for got, reference in zip(mine, written(torch_minmax, w, group, symmetric)):
        assert torch.equal(got, reference)


def test_rows_split_between_threads_are_each_rows_own():
    native = minmax.KERNEL.native()
    if native is None:
        pytest.skip("no native library here")
    w = weight(3001, 64, seed=3)
    for mine, reference in zip(written(native, w, 32, False), written(torch_minmax, w, 32, False)):
        assert torch.equal(mine, reference)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 30), groups=st.integers(1, 4), group=st.sampled_from([32, 128]),
       symmetric=st.booleans(), seed=st.integers(0, 2**16))
def test_one_pass_is_the_grids_and_codes_of_quantize_groupwise_and_the_chunked_loops_statistics(
        rows, groups, group, symmetric, seed):
    w = weight(rows, groups * group, seed)
    q, stats = minmax_rtn(w, group, symmetric)
    expected = quantize_groupwise(w, group, symmetric)
    for mine, reference in zip(q.tensors, expected.tensors):
        assert torch.equal(mine, reference)
    chunked = ErrorStats()
    chunked.add(w, expected.dequantize())
    assert stats.max_abs_err == chunked.max_abs_err
    assert stats.signal == pytest.approx(chunked.signal, rel=1e-5)
    assert stats.noise == pytest.approx(chunked.noise, rel=1e-5)


def test_quantize_rtn_takes_the_one_pass_only_for_bf16_weights_on_bf16_grids(monkeypatch):
    calls = []
    monkeypatch.setattr("quantizer.methods.rtn.minmax_rtn", lambda *a: calls.append(a) or minmax_rtn(*a))
    w = weight(8, 128, seed=1)
    scheme = ModuleScheme(bits=4, group_size=64, symmetric=False)
    one_pass, _ = quantize_rtn(w, scheme)
    chunked, _ = quantize_rtn(w.float(), scheme)  # an fp32 weight: the chunked loop
    clipped, _ = quantize_rtn(w, scheme, clip_search=True)
    assert len(calls) == 1
    assert all(torch.equal(a, b) for a, b in zip(one_pass.tensors, chunked.tensors))
    assert not all(torch.equal(a, b) for a, b in zip(one_pass.tensors, clipped.tensors))
