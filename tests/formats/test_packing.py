import pytest
import torch
from conftest import AVX512_LAYOUT, needs_avx512_layout
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.formats.packing import (
    codes_from_int4pack,
    dequantize_codes,
    dequantize_int4pack,
    kernel_layout_matches,
    pack_nibbles,
    scales_and_zeros,
    supports_direct_dequant,
    to_int4pack,
    unpack_nibbles,
)


def test_pack_nibbles_matches_golden_bytes():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0], [0, 15, 8, 8, 7, 9]], dtype=torch.uint8)
    assert pack_nibbles(codes).tolist() == [[0x21, 0x43, 0x0F], [0xF0, 0x88, 0x97]]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 9), half_k=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(n, half_k, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, 2 * half_k), generator=g, dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)


def test_pack_rejects_odd_k():
    with pytest.raises(ValueError):
        pack_nibbles(torch.zeros(2, 3, dtype=torch.uint8))


@needs_avx512_layout
@settings(max_examples=25, deadline=None)
@given(n=st.sampled_from([16, 32, 48, 64, 128, 192, 576, 1536]), k=st.sampled_from([32, 64, 192, 256]),
       seed=st.integers(0, 2**31 - 1))
def test_kernel_layout_decodes_back_to_the_codes(n, k, seed):
    """Pins the measured AVX-512 layout [N/64][K][32 bytes] against what torch actually emits."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    assert torch.equal(codes_from_int4pack(to_int4pack(pack_nibbles(codes))), codes)


@needs_avx512_layout
def test_kernel_layout_byte_d_holds_channels_d_and_d_plus_32():
    n, k = 64, 32
    codes = (torch.arange(n) % 16).to(torch.uint8)[:, None].expand(n, k).contiguous()
    packed = to_int4pack(pack_nibbles(codes)).reshape(1, k, 32)
    assert (packed[0, 5] & 0x0F).tolist() == [d % 16 for d in range(32)]
    assert (packed[0, 5] >> 4).tolist() == [(d + 32) % 16 for d in range(32)]


def test_chunked_conversion_equals_whole(monkeypatch):
    import quantizer.formats.packing as packing

    codes = torch.randint(0, 16, (208, 64), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    whole = to_int4pack(pack_nibbles(codes))
    monkeypatch.setattr(packing, "_CONVERT_CHUNK_ROWS", 64)
    assert torch.equal(to_int4pack(pack_nibbles(codes)), whole)


@pytest.mark.parametrize("n,ok", [(16, True), (48, True), (64, True), (80, False), (192, True), (200, False)])
def test_supports_direct_dequant_only_for_whole_blocks(n, ok):
    assert supports_direct_dequant(n) is ok


@needs_avx512_layout
def test_direct_dequant_is_bit_exact_against_row_major():
    g = torch.Generator().manual_seed(3)
    n, k, group = 192, 256, 64
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // group, generator=g) * 0.01).to(torch.bfloat16)
    zero = (torch.randn(n, k // group, generator=g) * 0.01).to(torch.bfloat16)
    direct = dequantize_int4pack(to_int4pack(pack_nibbles(codes)), scales_and_zeros(scale, zero), group)
    assert torch.equal(direct, dequantize_codes(codes, scale, zero))


def test_kernel_layout_probe_passes_exactly_where_torch_packs_the_avx512_layout():
    assert all(kernel_layout_matches(n) is AVX512_LAYOUT for n in (64, 128, 192))
    assert not AVX512_LAYOUT or all(kernel_layout_matches(n) for n in (16, 32, 48))
    assert not kernel_layout_matches(80)


def test_to_int4pack_rejects_n_not_multiple_of_16():
    with pytest.raises(ValueError, match="multiple of 16"):
        to_int4pack(torch.zeros(24, 16, dtype=torch.uint8))
