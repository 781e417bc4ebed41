"""The row-major one-row decode matmul (int4_gemv_rows.c as torch.ops.int4q_native.gemv_rows,
quantizer.runtime.kernels.gemv_rows): the decode path where the tinygemm layout is not int4q's."""

import logging

import pytest
import torch
from conftest import assert_refused_off_by, at_thread_counts
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.formats.packing import pack_nibbles, scales_and_zeros, to_int4pack
from quantizer.native.build import NativeUnavailable
from quantizer.native.cache import machine_identity
from quantizer.runtime.kernels import gemv_rows
from quantizer.runtime.kernels.gemv import has_gemv, within_rounding
from quantizer.runtime.nn.int4 import Int4Linear

tinygemm = torch.ops.aten._weight_int4pack_mm_for_cpu
PATHS = {"avx2": 2, "portable": 0}  # int4q_native.limit_level: vectors allowed, plain C


@pytest.fixture(scope="module")
def operator():
    if not gemv_rows.has_gemv_rows():
        pytest.skip("this CPU has no AVX2 + FMA, or the library cannot load: decode uses tinygemm")
    return torch.ops.int4q_native.gemv_rows


@pytest.fixture
def fresh_choice(monkeypatch):
    """has_gemv_rows decides again; its process-wide answer is restored afterwards."""
    monkeypatch.setattr(gemv_rows, "_choice", [])


def on_path(path: str, compute):
    limit = torch.ops.int4q_native.limit_level
    previous = limit(PATHS[path])
    try:
        return compute()
    finally:
        limit(previous)


def problem(n: int, groups: int, group_size: int, seed: int, scale_exp: int = -6):
    """x bf16 [1, K] of magnitudes 2^-3..2^2 and a row-major weight: (x, (packed, scale, zero), codes)."""
    gen = torch.Generator().manual_seed(seed)
    k = groups * group_size
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, groups, generator=gen) * 2.0**scale_exp).to(torch.bfloat16)
    zero = (torch.randn(n, groups, generator=gen) * 2.0**scale_exp).to(torch.bfloat16)
    x = torch.randn(1, k, generator=gen) * 2.0 ** torch.randint(-3, 3, (1, k), generator=gen)
    return x.to(torch.bfloat16), (pack_nibbles(codes), scale, zero), codes


def test_the_operator_is_used_exactly_where_the_cpu_has_its_instructions():
    assert gemv_rows.has_gemv_rows() is (gemv_rows.CPU_FEATURES <= set(machine_identity().split()))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 70), groups=st.integers(1, 4), group_size=st.sampled_from([16, 32, 48, 64, 128, 256]),
       seed=st.integers(0, 2**31 - 1), scale_exp=st.integers(-30, 20), path=st.sampled_from(sorted(PATHS)))
def test_gemv_rows_is_the_exact_product_up_to_rounding_on_every_path(operator, n, groups, group_size, seed,
                                                                     scale_exp, path):
    x, (packed, scale, zero), codes = problem(n, groups, group_size, seed, scale_exp)
    got = on_path(path, lambda: operator(x, packed, scale, zero, group_size))
    assert got.shape == (1, n) and got.dtype == torch.bfloat16
    assert within_rounding(got, x, codes, scale, zero)


def test_its_vector_path_is_taken_on_this_cpu(operator):
    assert on_path("avx2", torch.ops.int4q_native.gemv_rows_level) == 1
    assert on_path("portable", torch.ops.int4q_native.gemv_rows_level) == 0


def test_gemv_rows_agrees_with_tinygemm_on_nearly_every_output(operator):
    x, (packed, scale, zero), codes = problem(1024, 9, 64, seed=7)
    ours = operator(x, packed, scale, zero, 64)
    theirs = tinygemm(x, to_int4pack(packed), 64, scales_and_zeros(scale, zero))
    assert within_rounding(theirs, x, codes, scale, zero)
    assert (ours == theirs).float().mean() > 0.95


def test_gemv_rows_does_not_depend_on_the_thread_count(operator):
    x, row_major, _ = problem(300, 3, 64, seed=8)
    outs = at_thread_counts(lambda: operator(x, *row_major, 64))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_wrong_inputs_are_refused_with_a_message(operator):
    x, (packed, scale, zero), _ = problem(64, 2, 64, seed=11)
    for args, message in [((x.float(), packed, scale, zero, 64), "x must be bf16"),
                          ((x[:, :64], packed, scale, zero, 64), "x must be"),
                          ((x, packed, scale[:, :1], zero, 64), "scale and zero must be"),
                          ((x, packed, scale, zero, 24), "multiple of 16")]:
        with pytest.raises(RuntimeError, match=message):
            operator(*args)


def test_a_layer_with_a_row_major_copy_decodes_one_row_through_it_where_no_avx512_gemv_runs(operator):
    if has_gemv():
        pytest.skip("the AVX-512 GEMV decodes here")
    x, (packed, scale, zero), _ = problem(128, 4, 64, seed=9)
    layer = Int4Linear.from_row_major(packed, scale, zero, 64, direct_dequant=False)
    assert torch.equal(layer(x), operator(x, packed, scale, zero, 64))
    two_rows = torch.cat([x, x])
    assert torch.equal(gemv_rows.decode_matmul(two_rows, layer.int4pack, layer.sz, 64, (packed, scale, zero)),
                       tinygemm(two_rows, layer.int4pack, 64, layer.sz))


def test_compiled_code_calls_the_operator(operator):
    if has_gemv():
        pytest.skip("the AVX-512 GEMV decodes here")
    x, (packed, scale, zero), _ = problem(64, 2, 64, seed=12)
    int4pack, sz = to_int4pack(packed), scales_and_zeros(scale, zero)
    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(str(graph_module.graph))
        return graph_module.forward

    step = torch.compile(lambda t: gemv_rows.decode_matmul(t, int4pack, sz, 64, (packed, scale, zero)) * 2,
                         backend=record, fullgraph=True)
    assert torch.equal(step(x), operator(x, packed, scale, zero, 64) * 2)
    assert len(graphs) == 1 and "int4q_native.gemv_rows" in graphs[0] and "int4pack_mm" not in graphs[0]


def test_an_operator_that_cannot_load_warns_once_and_decode_uses_tinygemm(fresh_choice, monkeypatch, caplog):
    monkeypatch.setattr(gemv_rows, "load", lambda: (_ for _ in ()).throw(NativeUnavailable("no c++ here")))
    monkeypatch.setattr(gemv_rows, "has_gemv", lambda: False)
    x, row_major, _ = problem(64, 2, 64, seed=13)
    int4pack, sz = to_int4pack(row_major[0]), scales_and_zeros(*row_major[1:])
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            got = gemv_rows.decode_matmul(x, int4pack, sz, 64, row_major)
            assert torch.equal(got, tinygemm(x, int4pack, 64, sz))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no c++ here" in warnings[0] and "\n" not in warnings[0]


def test_an_operator_off_by_more_than_rounding_is_not_used(operator, monkeypatch):
    assert_refused_off_by(monkeypatch, "gemv_rows", gemv_rows.self_test, 1.05)
