"""The row-major int8-activation matmul (int4_w4a8_rows.c as torch.ops.int4q_native.w4a8_rows,
quantizer.runtime.kernels.w4a8_rows): int8 decode where the tinygemm layout is not int4q's."""

import logging

import pytest
import torch
from conftest import assert_refused_off_by, at_thread_counts
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.formats.packing import pack_nibbles
from quantizer.native.cache import machine_identity
from quantizer.runtime.activations import ENV
from quantizer.runtime.kernels import w4a8_rows
from quantizer.runtime.kernels.w4a8 import (
    quantize_activations,
    reference,
    within_rounding,
)
from quantizer.runtime.nn.int4 import Int4Linear, int8_operator


@pytest.fixture(scope="module")
def operator():
    if not w4a8_rows.has_w4a8_rows():
        pytest.skip("this CPU has no AVX2 + FMA, or the library cannot load: int8 decode takes the exact path")
    return torch.ops.int4q_native.w4a8_rows


@pytest.fixture
def fresh_choice(monkeypatch):
    """has_w4a8_rows decides again; its process-wide answer is restored afterwards."""
    monkeypatch.setattr(w4a8_rows, "_choice", [])


def problem(rows: int, n: int, groups: int, group_size: int, seed: int, scale_exp: int = -6, symmetric=False):
    """x bf16 [rows, K] of magnitudes 2^-3..2^2 and a row-major weight (zero 0 on a symmetric grid):
    (x, (packed, scale, zero), codes). Seeded."""
    gen = torch.Generator().manual_seed(seed)
    k = groups * group_size
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, groups, generator=gen) * 2.0**scale_exp).to(torch.bfloat16)
    zero = (torch.randn(n, groups, generator=gen) * 2.0**scale_exp).to(torch.bfloat16)
    if symmetric:
        zero = torch.zeros_like(zero)
    x = torch.randn(rows, k, generator=gen) * 2.0 ** torch.randint(-3, 3, (rows, k), generator=gen)
    return x.to(torch.bfloat16), (pack_nibbles(codes), scale, zero), codes


def test_the_operator_is_used_exactly_where_the_cpu_has_its_instructions():
    assert w4a8_rows.has_w4a8_rows() is (w4a8_rows.CPU_FEATURES <= set(machine_identity().split()))


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 9), n=st.integers(1, 70), groups=st.integers(1, 4),
       group_size=st.sampled_from([32, 64, 128, 192, 256]), seed=st.integers(0, 2**31 - 1),
       scale_exp=st.integers(-30, 20), symmetric=st.booleans())
def test_w4a8_rows_is_the_int32_sum_of_its_rounded_activations_up_to_rounding(operator, rows, n, groups, group_size,
                                                                             seed, scale_exp, symmetric):
    groups += groups % 2 if group_size == 32 else 0  # groups of 32 come in pairs (K % 64 == 0)
    x, (packed, scale, zero), codes = problem(rows, n, groups, group_size, seed, scale_exp, symmetric)
    got = operator(x, packed, scale, zero, group_size)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    assert within_rounding(got, x, codes, scale, zero)


def test_many_groups_in_one_row_are_summed_across_its_slabs(operator):
    x, (packed, scale, zero), codes = problem(2, 9, 150, 32, seed=3)  # 150 groups: slabs of 64, 64 and 22
    assert within_rounding(operator(x, packed, scale, zero, 32), x, codes, scale, zero)


def test_the_reference_is_the_exact_int32_sum(operator):
    x, (packed, scale, zero), codes = problem(1, 8, 2, 64, seed=4, symmetric=True)
    xq, xscale = quantize_activations(x, 64)
    sums = ((codes.int() - 8).view(8, 2, 64) * xq.int().view(1, 2, 64)).sum(-1)  # [N, G] int32
    exact = (sums.double() * scale.double() * xscale.double()).sum(-1)
    assert torch.allclose(reference(x, codes, scale, zero)[0], exact, rtol=1e-12, atol=0)
    assert within_rounding(operator(x, packed, scale, zero, 64), x, codes, scale, zero)


def test_w4a8_rows_does_not_depend_on_the_thread_count(operator):
    x, row_major, _ = problem(3, 300, 3, 64, seed=8)
    outs = at_thread_counts(lambda: operator(x, *row_major, 64))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_each_row_is_multiplied_as_if_alone(operator):
    x, row_major, _ = problem(5, 40, 2, 128, seed=9)
    together = operator(x, *row_major, 128)
    assert all(torch.equal(together[i:i + 1], operator(x[i:i + 1], *row_major, 128)) for i in range(5))


def test_wrong_inputs_are_refused_with_a_message(operator):
    x, (packed, scale, zero), _ = problem(1, 64, 2, 64, seed=11)
    for args, message in [((x.float(), packed, scale, zero, 64), "x must be bf16"),
                          ((x[:, :64], packed, scale, zero, 64), "x must be"),
                          ((x, packed, scale[:, :1], zero, 64), "scale and zero must be"),
                          ((x, packed, scale, zero, 16), "a group of 32"),
                          ((x[:, :96], packed[:, :48], scale, zero, 32), "a group of 32")]:
        with pytest.raises(RuntimeError, match=message):
            operator(*args)


def test_the_groups_it_reads():
    assert w4a8_rows.reads_group(128, 32) and w4a8_rows.reads_group(576, 64) and w4a8_rows.reads_group(768, 256)
    assert not w4a8_rows.reads_group(96, 32) and not w4a8_rows.reads_group(576, 48)
    assert w4a8_rows.reads_group(576, 192)  # 192 = 3 * 64: three steps a group


def test_a_layer_with_a_row_major_copy_takes_it_for_the_chosen_rows_up_to_its_limit(operator):
    x, (packed, scale, zero), _ = problem(1, 128, 4, 64, seed=12)
    layer = Int4Linear.from_row_major(packed, scale, zero, 64, direct_dequant=False, int8_decode=True,
                                      int8_prefill=True)
    exact = Int4Linear.from_row_major(packed, scale, zero, 64, direct_dequant=False)
    for rows, taken in ((1, "w4a8_rows"), (9, "w4a8_rows"), (w4a8_rows.ROWS_LIMIT + 1, None)):
        xs = torch.cat([x] * rows)
        assert int8_operator(rows, layer.threshold, True, True, layer.int4pack, 64, layer.packed) == taken
        want = operator(xs, packed, scale, zero, 64) if taken else exact(xs)
        assert torch.equal(layer(xs), want)
    assert int8_operator(1, layer.threshold, False, True, layer.int4pack, 64, layer.packed) is None
    assert int8_operator(9, layer.threshold, True, False, layer.int4pack, 64, layer.packed) is None


def test_compiled_code_calls_the_operator(operator):
    x, (packed, scale, zero), _ = problem(1, 64, 2, 64, seed=13)
    layer = Int4Linear.from_row_major(packed, scale, zero, 64, direct_dequant=False, int8_decode=True,
                                      use_custom_op=False)
    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(str(graph_module.graph))
        return graph_module.forward

    step = torch.compile(lambda t: layer(t) * 2, backend=record, fullgraph=True)
    assert torch.equal(step(x), operator(x, packed, scale, zero, 64) * 2)
    assert len(graphs) == 1 and "int4q_native.w4a8_rows" in graphs[0]


def test_a_cpu_without_the_instructions_warns_once_where_int8_was_asked_for(fresh_choice, monkeypatch, caplog):
    monkeypatch.setenv(ENV, "decode=int8")
    monkeypatch.setattr(w4a8_rows, "machine_identity", lambda: "sse2 avx")
    _, (packed, _, _), _ = problem(1, 8, 2, 64, seed=14)
    with caplog.at_level(logging.WARNING):
        assert not any(w4a8_rows.w4a8_rows_usable(packed, 64) for _ in range(3))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "lacks AVX2 and FMA" in warnings[0] and "\n" not in warnings[0]


def test_where_int8_is_only_the_default_a_cpu_without_it_falls_back_silently(fresh_choice, monkeypatch, caplog):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(w4a8_rows, "machine_identity", lambda: "sse2 avx")
    _, (packed, _, _), _ = problem(1, 8, 2, 64, seed=14)
    with caplog.at_level(logging.WARNING):
        assert not w4a8_rows.w4a8_rows_usable(packed, 64)
    assert [r for r in caplog.records if r.levelno == logging.WARNING] == []


def test_an_operator_off_by_more_than_rounding_is_not_used(operator, monkeypatch):
    assert_refused_off_by(monkeypatch, "w4a8_rows", w4a8_rows.self_test, 1.05)
