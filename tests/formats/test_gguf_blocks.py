"""GGUF blocks: what int4q writes decodes, with the gguf package's own dequantization, to exactly
the grid int4q rounded onto."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.formats.gguf import blocks as B
from quantizer.methods.grid import quantize_groupwise, quantize_per_channel

gguf = pytest.importorskip("gguf")


def weights(rows, blocks, seed, scale_exp):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 32 * blocks, generator=gen) * 2.0 ** scale_exp).to(torch.bfloat16)


def assert_encodes_to_its_grid(gq, kind, rows: int, blocks: int) -> None:
    """gq's blocks of `kind` decode, in the gguf package and in int4q, to gq's own grid values."""
    data = B.encode(gq, kind)
    assert data.shape == (rows, blocks * kind.nbytes)
    theirs = gguf.quants.dequantize(data.numpy(), getattr(gguf.GGMLQuantizationType, kind.name))
    decoded = B.decode(data, kind)
    assert np.array_equal(theirs, decoded.values().numpy())
    assert torch.equal(decoded.codes, gq.codes)
    torch.testing.assert_close(torch.from_numpy(theirs), gq.dequantize(), rtol=2e-7, atol=0)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), blocks=st.integers(1, 5), seed=st.integers(0, 2**31 - 1),
       scale_exp=st.integers(-12, 4), kind=st.sampled_from([B.Q4_0, B.Q4_1, B.Q5_0, B.Q5_1]), weighted=st.booleans())
def test_32_weight_blocks_decode_to_int4qs_grid_values_in_ggml_and_here(rows, blocks, seed, scale_exp, kind, weighted):
    w = weights(rows, blocks, seed, scale_exp)
    column_weights = torch.rand(w.shape[1], generator=torch.Generator().manual_seed(seed)) if weighted else None
    gq = quantize_groupwise(w, 32, symmetric=kind.symmetric, storage=kind.storage, column_weights=column_weights)
    assert gq.bits == kind.bits and int(gq.codes.max()) < 2**kind.bits
    assert_encodes_to_its_grid(gq, kind, rows, blocks)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 9), blocks=st.integers(1, 5), seed=st.integers(0, 2**31 - 1), scale_exp=st.integers(-12, 4))
def test_q8_0_blocks_decode_to_the_8_bit_grid_exactly(rows, blocks, seed, scale_exp):
    w = weights(rows, blocks, seed, scale_exp)
    cq = quantize_per_channel(w, B.Q4_0_STORAGE)
    assert cq.scale.shape == (rows, blocks) and cq.scale.dtype == torch.float16
    data = B.encode(cq, B.Q8_0)
    theirs = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(theirs, cq.dequantize().numpy())
    assert np.array_equal(theirs, B.decode(data, B.Q8_0).values().numpy())


def test_a_grid_the_block_type_cannot_hold_is_refused():
    w = weights(4, 2, 0, 0)
    asym = quantize_groupwise(w, 32, symmetric=False, storage=B.Q4_1_STORAGE)
    with pytest.raises(ValueError, match="Q4_0 holds symmetric grids"):
        B.encode(asym, B.Q4_0)
    with pytest.raises(ValueError, match="not fp16 values"):
        B.encode(quantize_groupwise(weights(4, 2, 0, -18), 32, symmetric=True), B.Q4_0)  # bf16 scales below fp16
    with pytest.raises(ValueError, match="groups of 32"):
        B.encode(quantize_groupwise(w, 64, symmetric=True, storage=B.Q4_0_STORAGE), B.Q4_0)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), supers=st.integers(1, 3), seed=st.integers(0, 2**31 - 1),
       scale_exp=st.integers(-14, 4), weighted=st.booleans(), kind=st.sampled_from([B.Q4_K, B.Q5_K, B.Q6_K]))
def test_k_quant_blocks_decode_to_int4qs_grid_values_in_ggml_and_here(rows, supers, seed, scale_exp, weighted, kind):
    w = weights(rows, 8 * supers, seed, scale_exp)
    column_weights = torch.rand(w.shape[1], generator=torch.Generator().manual_seed(seed)) if weighted else None
    group = 16 if kind is B.Q6_K else 32
    gq = quantize_groupwise(w, group, symmetric=kind.symmetric, storage=kind.storage, column_weights=column_weights)
    assert_encodes_to_its_grid(gq, kind, rows, supers)


@pytest.mark.parametrize("kind", [B.Q4_K, B.Q5_K, B.Q6_K, B.Q5_0])
def test_gptq_on_a_block_storage_fixes_grids_that_encode_in_any_column_order(kind):
    from quantizer.methods.gptq import gptq_quantize

    gen = torch.Generator().manual_seed(3)
    w, x = weights(8, 16, 3, -4), torch.randn(256, 512, generator=gen)
    group = 16 if kind is B.Q6_K else 32
    for act_order in (True, False):
        gq, _ = gptq_quantize(w, x.T @ x / 256, group, symmetric=kind.symmetric, act_order=act_order,
                              storage=kind.storage)
        assert gq.bits == kind.bits
        assert torch.equal(B.decode(B.encode(gq, kind), kind).codes, gq.codes)


def test_a_row_that_super_blocks_do_not_fill_is_rounded_as_q4_1():
    w = weights(5, 3, 4, 0)
    a, b = (quantize_groupwise(w, 32, storage=s) for s in (B.Q4_K_STORAGE, B.Q4_1_STORAGE))
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale) and torch.equal(a.zero, b.zero)
    assert B.block_type(4, False, 96, kquants=True) is B.Q4_1 and B.block_type(4, False, 256, kquants=True) is B.Q4_K
    assert B.block_type(5, False, 96, kquants=True) is B.Q5_1 and B.block_type(5, False, 256, kquants=True) is B.Q5_K
    assert B.block_type(5, True, 256, kquants=True) is B.Q5_0 and B.block_type(6, True, 256) is B.Q6_K


def test_k_quants_refuse_grids_they_cannot_hold():
    with pytest.raises(ValueError, match="not levels of an fp16 unit"):
        B.encode(quantize_groupwise(weights(2, 8, 5, 0), 16, symmetric=True,
                                    storage=B.Storage(torch.float16, signed_scale=True, bits=6)), B.Q6_K)
    with pytest.raises(ValueError, match="6-bit codes, not 4-bit"):
        B.encode(quantize_groupwise(weights(2, 8, 5, 0), 16, symmetric=True), B.Q6_K)
    with pytest.raises(ValueError, match="5-bit codes, not 4-bit"):
        B.encode(quantize_groupwise(weights(2, 8, 5, 0), 32, symmetric=True, storage=B.Q4_0_STORAGE), B.Q5_0)
    w = weights(2, 8, 5, 0)
    with pytest.raises(ValueError, match="not levels of an fp16 unit"):
        B.encode(quantize_groupwise(w, 32, storage=B.Q4_1_STORAGE), B.Q4_K)
    with pytest.raises(ValueError, match="whole 256-weight super-blocks"):
        B.encode(quantize_groupwise(weights(2, 3, 5, 0), 32, storage=B.Q4_K_STORAGE), B.Q4_K)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), supers=st.integers(1, 3), seed=st.integers(0, 2**31 - 1),
       scale_exp=st.integers(-14, 4), weighted=st.booleans(), kind=st.sampled_from([B.IQ4_NL, B.IQ4_XS]))
def test_iq4_blocks_decode_to_int4qs_level_grids_in_ggml_and_here(rows, supers, seed, scale_exp, weighted, kind):
    w = weights(rows, 8 * supers, seed, scale_exp)
    column_weights = torch.rand(w.shape[1], generator=torch.Generator().manual_seed(seed)) if weighted else None
    gq = quantize_groupwise(w, 32, symmetric=True, storage=kind.storage, column_weights=column_weights)
    blocks = 8 * supers if kind is B.IQ4_NL else supers
    assert_encodes_to_its_grid(gq, kind, rows, blocks)
    assert B.decode(B.encode(gq, kind), kind).levels == gq.levels


def test_iq4_types_refuse_grids_they_cannot_hold():
    w = weights(2, 8, 5, 0)
    with pytest.raises(ValueError, match="IQ4 level grids"):
        B.encode(quantize_groupwise(w, 32, symmetric=True, storage=B.Q4_0_STORAGE), B.IQ4_NL)
    linear = B.Storage(torch.float32, signed_scale=True, codebook=B.IQ4_NL.storage.codebook)
    with pytest.raises(ValueError, match="not fp16 values"):
        B.encode(quantize_groupwise(w, 32, symmetric=True, storage=linear), B.IQ4_NL)
    with pytest.raises(ValueError, match="not levels of an fp16 unit"):
        B.encode(quantize_groupwise(w, 32, symmetric=True, storage=B.IQ4_NL.storage), B.IQ4_XS)
    with pytest.raises(ValueError, match="whole 256-weight blocks"):
        B.encode(quantize_groupwise(weights(2, 3, 5, 0), 32, symmetric=True, storage=B.IQ4_NL.storage), B.IQ4_XS)
    assert B.block_type(4, True, 512, True, "IQ4_XS") is B.IQ4_XS
    assert B.block_type(4, True, 96, True, "IQ4_XS") is B.IQ4_NL  # rows that are not whole super-blocks
    assert B.block_type(4, False, 512, True, "IQ4_XS") is B.Q4_K
    assert B.block_type(5, False, 512, True, "IQ4_NL") is B.Q5_K
