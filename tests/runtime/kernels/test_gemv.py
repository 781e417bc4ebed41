"""The native decode matmul of a few rows (int4_gemv.c as torch.ops.int4q_native.gemv, quantizer.runtime.kernels.gemv)."""

import logging

import pytest
import torch
from conftest import assert_refused_off_by, at_thread_counts, kernel_layout_problem
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.native.build import NativeUnavailable
from quantizer.native.cache import machine_identity
from quantizer.runtime.kernels import gemv

tinygemm = torch.ops.aten._weight_int4pack_mm_for_cpu


@pytest.fixture(scope="module")
def operator():
    if not gemv.has_gemv():
        pytest.skip("this CPU has no AVX-512 VBMI + BF16: decode uses tinygemm")
    return torch.ops.int4q_native.gemv


@pytest.fixture(scope="module")
def mean_square():
    if not gemv.has_mean_square():
        pytest.skip("int4q's library cannot load here")
    return torch.ops.int4q_native.mean_square


@pytest.fixture
def fresh_choice(monkeypatch):
    """has_gemv decides again; its process-wide answer is restored afterwards."""
    monkeypatch.setattr(gemv, "_choice", [])


def problem(blocks: int, groups: int, group_size: int, seed: int, scale_exp: int = -6, rows: int = 1):
    """Rows x [rows, K], the kernel-layout weight, and its codes/scale/zero, seeded."""
    return kernel_layout_problem(rows, blocks, groups, group_size, seed, scale_exp)


def test_the_operator_is_used_exactly_where_the_cpu_has_its_instructions():
    assert gemv.has_gemv() is (gemv.CPU_FEATURES <= set(machine_identity().split()))


@settings(max_examples=60, deadline=None)
@given(blocks=st.integers(1, 3), groups=st.integers(1, 4), group_size=st.sampled_from([16, 32, 64, 128, 256]),
       seed=st.integers(0, 2**31 - 1), scale_exp=st.integers(-30, 20), rows=st.integers(1, 9))
def test_gemv_is_the_exact_product_up_to_rounding(operator, blocks, groups, group_size, seed, scale_exp, rows):
    x, int4pack, sz, parts = problem(blocks, groups, group_size, seed, scale_exp, rows)
    got = operator(x, int4pack, sz, group_size)
    assert got.shape == (rows, int4pack.shape[0]) and got.dtype == torch.bfloat16
    assert gemv.within_rounding(got, x, *parts)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(2, 11), seed=st.integers(0, 2**31 - 1))
def test_each_rows_output_is_the_one_it_has_alone(operator, rows, seed):
    x, int4pack, sz, _ = problem(2, 3, 64, seed, rows=rows)
    alone = torch.cat([operator(x[r : r + 1], int4pack, sz, 64) for r in range(rows)])
    assert torch.equal(operator(x, int4pack, sz, 64), alone)


def test_gemv_agrees_with_tinygemm_on_nearly_every_output(operator):
    x, int4pack, sz, parts = problem(16, 9, 64, seed=7)
    ours, theirs = operator(x, int4pack, sz, 64), tinygemm(x, int4pack, 64, sz)
    assert gemv.within_rounding(theirs, x, *parts)  # the bound holds for PyTorch's kernel too
    assert (ours == theirs).float().mean() > 0.99


def test_gemv_does_not_depend_on_the_thread_count(operator):
    x, int4pack, sz, _ = problem(5, 3, 64, seed=8)
    outs = at_thread_counts(lambda: operator(x, int4pack, sz, 64))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_decode_path_takes_the_operator_for_any_number_of_rows(operator):
    for rows in (1, 2, 5):
        x, int4pack, sz, _ = problem(1, 2, 64, seed=9, rows=rows)
        assert torch.equal(gemv.int4pack_mm(x, int4pack, sz, 64), operator(x, int4pack, sz, 64))


def test_compiled_code_calls_the_operator(operator):
    x, int4pack, sz, _ = problem(2, 2, 64, seed=12)
    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(str(graph_module.graph))
        return graph_module.forward

    compiled = torch.compile(lambda t: gemv.int4pack_mm(t, int4pack, sz, 64) * 2, backend=record, fullgraph=True)
    assert torch.equal(compiled(x), operator(x, int4pack, sz, 64) * 2)
    assert len(graphs) == 1 and "int4q_native.gemv" in graphs[0] and "int4pack_mm" not in graphs[0]


def test_wrong_inputs_are_refused_with_a_message(operator):
    x, int4pack, sz, _ = problem(1, 2, 64, seed=11)
    for args, message in [((x.float(), int4pack, sz, 64), "x must be bf16"), ((x[:, :64], int4pack, sz, 64), "x must be"),
                          ((x[:0], int4pack, sz, 64), "x must be"),
                          ((x, int4pack, sz, 32), "sz must be"), ((x, int4pack, sz, 63), "even group")]:
        with pytest.raises(RuntimeError, match=message):
            operator(*args)


def test_native_off_decodes_through_tinygemm_silently(fresh_choice, monkeypatch, caplog):
    monkeypatch.setenv("INT4Q_NATIVE", "0")
    x, int4pack, sz, _ = problem(1, 2, 64, seed=10)
    with caplog.at_level(logging.WARNING):
        assert torch.equal(gemv.int4pack_mm(x, int4pack, sz, 64), tinygemm(x, int4pack, 64, sz))
    assert caplog.records == []


def test_an_operator_that_cannot_load_warns_once_and_decode_uses_tinygemm(fresh_choice, monkeypatch, caplog):
    monkeypatch.setattr(gemv, "load", lambda: (_ for _ in ()).throw(NativeUnavailable("no c++ here")))
    x, int4pack, sz, _ = problem(1, 2, 64, seed=13)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert torch.equal(gemv.int4pack_mm(x, int4pack, sz, 64), tinygemm(x, int4pack, 64, sz))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no c++ here" in warnings[0] and "\n" not in warnings[0]


def test_an_operator_off_by_more_than_rounding_is_not_used(operator, monkeypatch):
    assert_refused_off_by(monkeypatch, "gemv", gemv.self_test, 1.05)


@settings(max_examples=80, deadline=None)
@given(width=st.integers(1, 20000), rows=st.integers(1, 4), seed=st.integers(0, 2**31 - 1),
       scale_exp=st.integers(-60, 60))
def test_mean_square_is_eagers_variance_bit_for_bit(mean_square, width, rows, seed, scale_exp):
    x = torch.randn(rows, 1, width, generator=torch.Generator().manual_seed(seed)) * 2.0**scale_exp
    assert torch.equal(torch.ops.int4q_native.mean_square(x), x.pow(2).mean(-1, keepdim=True))


def test_mean_square_sums_on_its_own_here_and_by_aten_where_it_cannot(mean_square):
    own = torch.ops.int4q_native.use_own_mean_square
    assert own(True) is True  # the load-time check kept the operator's own summation on this machine
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(0))
    for odd in (x.t().contiguous().t(), x.to(torch.bfloat16), x.double()):  # not contiguous fp32: ATen's path
        assert torch.equal(torch.ops.int4q_native.mean_square(odd), odd.pow(2).mean(-1, keepdim=True))
    try:
        own(False)
        assert torch.equal(torch.ops.int4q_native.mean_square(x), x.pow(2).mean(-1, keepdim=True))
    finally:
        own(True)
