import logging

import pytest
import torch
from conftest import at_thread_counts, kernel_layout_weight
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.formats import packing
from quantizer.native.build import NativeUnavailable
from quantizer.native.cache import machine_identity
from quantizer.runtime.kernels import dequant as native


@pytest.fixture(scope="module")
def kernels():
    """Every vector path of the kernel: the runtime's for this CPU and the ones below it."""
    return {variant: native.load(variant) for variant in native.LEVELS}


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """An empty cache and no cached kernel; the process-wide one is restored afterwards."""
    monkeypatch.setenv("INT4Q_CACHE_DIR", str(tmp_path / "cache"))
    native.kernel.cache_clear()
    yield
    native.kernel.cache_clear()


def weight(blocks: int, groups: int, group_size: int, seed: int, scale_exp: int = 0):
    """Kernel-layout tensors of a random [64 * blocks, groups * group_size] weight, and its reference."""
    *_, int4pack, sz = kernel_layout_weight(blocks, groups, group_size, seed, scale_exp)
    return int4pack, sz, packing.dequantize_int4pack(int4pack, sz, group_size)


def test_each_limit_takes_the_vector_path_this_cpu_allows(kernels):
    flags = machine_identity()
    avx512 = "avx512vbmi" in flags
    assert kernels["portable"].simd == 0
    assert kernels["avx512-exact-tables"].simd == int(avx512)
    assert kernels["native"].simd == (2 if avx512 and "avx512_bf16" in flags else int(avx512))


@settings(max_examples=60, deadline=None)
@given(blocks=st.integers(1, 3), groups=st.integers(1, 4), group_size=st.sampled_from([16, 32, 64, 128, 256]),
       seed=st.integers(0, 2**31 - 1), scale_exp=st.integers(-120, 100), build=st.sampled_from(sorted(native.LEVELS)))
def test_kernel_is_bit_identical_to_the_torch_reference(kernels, blocks, groups, group_size, seed, scale_exp, build):
    int4pack, sz, reference = weight(blocks, groups, group_size, seed, scale_exp)
    got = kernels[build].dequantize(int4pack, sz, group_size)
    assert torch.equal(got.view(torch.int16), reference.view(torch.int16))


@pytest.mark.parametrize("build", sorted(native.LEVELS))
def test_special_values_round_like_torch(kernels, build):
    int4pack, sz, _ = weight(1, 2, 64, seed=5)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -3e-39, 3.0e38])
    sz = sz.clone()
    sz.view(-1)[: specials.numel()] = specials.to(torch.bfloat16)
    sz.view(-1)[-specials.numel():] = specials.flip(0).to(torch.bfloat16)
    reference = packing.dequantize_int4pack(int4pack, sz, 64)
    got = kernels[build].dequantize(int4pack, sz, 64)
    nan = reference.isnan()
    assert nan.any() and torch.equal(got.isnan(), nan)  # NaN stays NaN (its payload bits may differ)
    assert torch.equal(got.view(torch.int16)[~nan], reference.view(torch.int16)[~nan])
    assert reference.isinf().any() and (reference == 0).any()


def test_kernel_uses_the_threads_torch_is_told(kernels):
    int4pack, sz, reference = weight(4, 4, 64, seed=1)
    outs = at_thread_counts(lambda: kernels["native"].dequantize(int4pack, sz, 64))
    assert all(torch.equal(o, reference) for o in outs)


def test_wrong_shapes_are_refused_before_the_call(kernels):
    int4pack, sz, _ = weight(1, 2, 64, seed=0)
    with pytest.raises(ValueError, match="expected uint8"):
        kernels["native"].dequantize(int4pack, sz, 32)
    assert native.supports(int4pack, 64) and not native.supports(int4pack[:48], 64)


def test_runtime_path_uses_the_kernel_where_it_applies_and_torch_elsewhere(monkeypatch):
    calls = []
    real = native.kernel()
    assert real is not None, "this machine has a C compiler: the kernel must build"
    monkeypatch.setattr(real, "dequantize",
                        lambda p, s, g, out=None: calls.append(p) or packing.dequantize_int4pack(p, s, g))
    int4pack, sz, reference = weight(1, 2, 64, seed=2)
    assert torch.equal(native.dequantize_int4pack(int4pack, sz, 64), reference) and len(calls) == 1
    small = packing.to_int4pack(packing.pack_nibbles(torch.zeros(48, 128, dtype=torch.uint8)))
    native.dequantize_int4pack(small, packing.scales_and_zeros(*torch.ones(2, 48, 2)), 64)
    assert len(calls) == 1  # 48 channels: the other layout, decoded by torch


def test_a_library_that_cannot_load_warns_once_and_prefill_stays_exact(fresh_kernel, monkeypatch, caplog):
    monkeypatch.setattr(native, "ops", lambda: (_ for _ in ()).throw(NativeUnavailable("cannot load /x/_C.so")))
    int4pack, sz, reference = weight(2, 2, 64, seed=3)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert torch.equal(native.dequantize_int4pack(int4pack, sz, 64), reference)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "/x/_C.so" in warnings[0] and "\n" not in warnings[0]


def test_a_kernel_that_disagrees_with_torch_is_not_used(monkeypatch, kernels):
    monkeypatch.setattr(kernels["portable"], "dequantize", lambda p, s, g: packing.dequantize_int4pack(p, s, g) + 1)
    with pytest.raises(NativeUnavailable, match="disagrees with the torch reference"):
        native.self_test(kernels["portable"])


def test_native_off_uses_torch_without_a_warning(fresh_kernel, monkeypatch, caplog):
    monkeypatch.setenv("INT4Q_NATIVE", "0")
    with caplog.at_level(logging.WARNING):
        assert native.kernel() is None
    assert caplog.records == []


def test_transient_weights_share_one_buffer_only_inside_the_context():
    big, big_sz, big_reference = weight(3, 2, 64, seed=4)
    small, small_sz, small_reference = weight(1, 2, 64, seed=5)
    outside = native.dequantize_int4pack(big, big_sz, 64, transient=True)
    assert torch.equal(outside, big_reference)
    with native.shared_weight_buffer():
        first = native.dequantize_int4pack(big, big_sz, 64, transient=True)
        assert torch.equal(first, big_reference)
        second = native.dequantize_int4pack(small, small_sz, 64, transient=True)
        assert torch.equal(second, small_reference)
        assert second.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        kept = native.dequantize_int4pack(big, big_sz, 64)  # not transient: its own memory
        assert kept.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    assert native._shared_buffer(16) is None
    assert torch.equal(outside, big_reference)
