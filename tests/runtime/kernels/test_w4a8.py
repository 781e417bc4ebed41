"""The int8-activation matmul (int4_w4a8.c as torch.ops.int4q_native.w4a8_mm, quantizer.runtime.kernels.w4a8)."""

import logging

import pytest
import torch
from conftest import assert_refused_off_by, at_thread_counts, kernel_layout_problem
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.native.build import NativeUnavailable
from quantizer.native.cache import machine_identity
from quantizer.native.library import ops
from quantizer.runtime.activations import ENV
from quantizer.runtime.kernels import w4a8


@pytest.fixture(scope="module")
def operator():
    if not w4a8.has_w4a8():
        pytest.skip("this CPU has no AVX-512 VBMI + VNNI: int8 activations fall back to the exact paths")
    return torch.ops.int4q_native.w4a8_mm


@pytest.fixture
def fresh_choice(monkeypatch):
    """has_w4a8 decides again; its process-wide answer is restored afterwards."""
    monkeypatch.setattr(w4a8, "_choice", [])


def test_the_operator_is_used_exactly_where_the_cpu_has_its_instructions():
    assert w4a8.has_w4a8() is (w4a8.CPU_FEATURES <= set(machine_identity().split()))


def test_activations_round_to_int8_per_group_within_half_a_step():
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x[1, :64] = 0
    codes, scale = w4a8.quantize_activations(x, 64)
    assert codes.dtype == torch.int8 and codes.abs().max() == 127 and scale.shape == (3, 4)
    assert torch.equal(codes[1, :64], torch.zeros(64, dtype=torch.int8)) and scale[1, 0] == 0
    error = x.float() - codes.float() * scale.repeat_interleave(64, 1)
    assert (error.abs() <= scale.repeat_interleave(64, 1) / 2 * (1 + 2**-20)).all()


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 13), blocks=st.integers(1, 3), groups=st.integers(1, 4),
       group_size=st.sampled_from([4, 12, 16, 32, 36, 64, 128, 256]), seed=st.integers(0, 2**31 - 1),
       scale_exp=st.integers(-30, 20), symmetric=st.booleans())
def test_w4a8_is_its_reference_up_to_rounding(operator, rows, blocks, groups, group_size, seed, scale_exp, symmetric):
    x, int4pack, sz, parts = kernel_layout_problem(rows, blocks, groups, group_size, seed, scale_exp, symmetric)
    got = operator(x, int4pack, sz, group_size)
    assert got.shape == (rows, int4pack.shape[0]) and got.dtype == torch.bfloat16
    assert w4a8.within_rounding(got, x, *parts)


@pytest.fixture(scope="module")
def library():
    try:
        return ops()
    except NativeUnavailable as e:
        pytest.skip(f"int4q's library cannot load here: {e}")


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 20), groups=st.integers(1, 3),
       group_size=st.sampled_from([4, 12, 16, 32, 64, 128, 192]), seed=st.integers(0, 2**31 - 1),
       scale_exp=st.integers(-100, 100), split=st.booleans())
def test_the_kernels_round_activations_as_their_reference_does_bit_for_bit(library, rows, groups, group_size, seed,
                                                                            scale_exp, split):
    """split: as w4a8_rows rounds them, in one pass that writes even and odd elements (groups of 32s)."""
    split = split and group_size % 32 == 0
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, groups * group_size, generator=gen) * 2.0**scale_exp).to(torch.bfloat16)
    x[0, :group_size] = 0
    codes, scale = library.quantize_activations(x, group_size, split=split)
    want_codes, want_scale = w4a8.quantize_activations(x, group_size)
    assert torch.equal(codes, want_codes) and torch.equal(scale, want_scale)


def test_a_row_gets_the_same_bits_alone_as_in_any_batch(operator):
    x, int4pack, sz, _ = kernel_layout_problem(11, 2, 3, 64, seed=4)
    batch = operator(x, int4pack, sz, 64)
    for r in range(11):
        assert torch.equal(operator(x[r:r + 1], int4pack, sz, 64), batch[r:r + 1])


def test_w4a8_does_not_depend_on_the_thread_count(operator):
    x, int4pack, sz, _ = kernel_layout_problem(70, 5, 3, 64, seed=8)
    outs = at_thread_counts(lambda: operator(x, int4pack, sz, 64))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_int8_activations_stay_close_to_the_exact_product(operator):
    x, int4pack, sz, (codes, scale, zero) = kernel_layout_problem(16, 4, 8, 64, seed=5)
    w = (codes.double() - 8) * scale.double().repeat_interleave(64, 1) + zero.double().repeat_interleave(64, 1)
    exact = x.double() @ w.t()
    got = operator(x, int4pack, sz, 64).double()
    assert ((got - exact).norm() / exact.norm()).item() < 0.01


def test_wrong_inputs_are_refused_with_a_message(operator):
    x, int4pack, sz, _ = kernel_layout_problem(2, 1, 2, 64, seed=11)
    for args, message in [((x.float(), int4pack, sz, 64), "x must be bf16"),
                          ((x[:, :64], int4pack, sz, 64), "x must be"), ((x, int4pack, sz, 32), "sz must be"),
                          ((x, int4pack, sz, 62), "group of 4s")]:
        with pytest.raises(RuntimeError, match=message):
            operator(*args)


def test_an_operator_off_by_more_than_rounding_is_not_used(operator, monkeypatch):
    assert_refused_off_by(monkeypatch, "w4a8_mm", w4a8.self_test, 1.05)


def test_a_cpu_without_the_instructions_warns_once_and_int8_is_not_used(fresh_choice, monkeypatch, caplog):
    monkeypatch.setenv(ENV, "prefill=int8")  # the user's choice, not the default
    monkeypatch.setattr(w4a8, "machine_identity", lambda: "avx512f avx512bw")
    _, int4pack, _, _ = kernel_layout_problem(1, 1, 2, 64, seed=12)
    with caplog.at_level(logging.WARNING):
        assert not any(w4a8.w4a8_usable(int4pack, 64) for _ in range(3))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "lacks AVX-512 VBMI or VNNI" in warnings[0] and "\n" not in warnings[0]


def test_where_int8_is_only_the_default_a_cpu_without_it_falls_back_silently(fresh_choice, monkeypatch, caplog):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(w4a8, "machine_identity", lambda: "avx512f avx512bw")
    _, int4pack, _, _ = kernel_layout_problem(1, 1, 2, 64, seed=12)
    with caplog.at_level(logging.WARNING):
        assert not w4a8.w4a8_usable(int4pack, 64)
    assert [r for r in caplog.records if r.levelno == logging.WARNING] == []


def test_a_library_that_cannot_load_warns_only_where_int8_was_asked_for(fresh_choice, monkeypatch, caplog):
    def unavailable():
        raise NativeUnavailable("no c++ here")

    monkeypatch.setattr(w4a8, "ops", unavailable)
    monkeypatch.setattr(w4a8, "machine_identity", lambda: " ".join(w4a8.CPU_FEATURES))  # a CPU that has them
    _, int4pack, _, _ = kernel_layout_problem(1, 1, 2, 64, seed=12)
    warned = []
    for setting in (None, "prefill=int8"):
        monkeypatch.setattr(w4a8, "_choice", [])
        if setting:
            monkeypatch.setenv(ENV, setting)
        else:
            monkeypatch.delenv(ENV, raising=False)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert not w4a8.w4a8_usable(int4pack, 64)
        warned.append([r.getMessage() for r in caplog.records if r.levelno == logging.WARNING])
    assert warned[0] == [] and len(warned[1]) == 1 and "no c++ here" in warned[1][0]


def test_a_weight_the_kernel_cannot_read_is_not_taken(operator):
    _, int4pack, _, _ = kernel_layout_problem(1, 1, 2, 64, seed=13)
    assert w4a8.w4a8_usable(int4pack, 64) and not w4a8.w4a8_usable(int4pack, 6)
    assert not w4a8.w4a8_usable(int4pack[:32], 64)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(2, 9), blocks=st.integers(1, 3), groups=st.integers(1, 4),
       group_size=st.sampled_from([4, 12, 32, 64, 128]), seed=st.integers(0, 2**31 - 1), symmetric=st.booleans())
def test_a_rows_output_is_the_same_alone_as_among_others_bit_for_bit(operator, rows, blocks, groups, group_size, seed,
                                                                   symmetric):
    """Up to four rows (decode, a few sequences a step) take the one-pass kernel, more the two-pass tiles;
    a row must round the same in either, alone or among others."""
    x, int4pack, sz, _ = kernel_layout_problem(rows, blocks, groups, group_size, seed, 0, symmetric)
    together = operator(x, int4pack, sz, group_size)
    for r in range(rows):
        assert torch.equal(operator(x[r : r + 1], int4pack, sz, group_size), together[r : r + 1])
