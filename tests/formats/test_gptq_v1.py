import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.formats.gptq_v1 import (
    dequantize_gptq,
    gptq_tensors,
    pack_int32,
    unpack_int32,
    zero_points,
)
from quantizer.methods.gptq import HessianAccumulator, gptq_quantize
from quantizer.methods.grid import INTEGER_ZERO


def test_pack_int32_hand_worked_values():
    # element j at bits 4j: 0x76543210 for 0..7; 0xFFFFFFFF (int32 -1) for all fifteens
    assert pack_int32(torch.arange(8)).tolist() == [0x76543210]
    assert pack_int32(torch.full((8,), 15)).tolist() == [-1]
    assert pack_int32(torch.tensor([1, 0, 0, 0, 0, 0, 0, 8])).tolist() == [0x80000001 - 2**32]


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 5), words=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(rows, words, seed):
    v = torch.randint(0, 16, (rows, 8 * words), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(unpack_int32(pack_int32(v)), v)


def test_qweight_and_qzeros_layout_by_hand():
    codes = torch.zeros(16, 16, dtype=torch.uint8)
    codes[3, 9] = 5  # channel n=3, input k=9 -> qweight[1, 3] bits 4*(9-8)
    from quantizer.methods.grid import GroupQuantized

    scale = torch.ones(16, 1)
    zero = torch.zeros(16, 1)  # symmetric: z = 8, stored 7 in every nibble
    t = gptq_tensors("m", GroupQuantized(codes, scale, zero))
    assert t["m.qweight"].shape == (2, 16) and t["m.qweight"][1, 3].item() == 5 << 4
    assert t["m.qzeros"].shape == (1, 2) and t["m.qzeros"][0, 0].item() == 0x77777777
    assert t["m.scales"].dtype == torch.float16 and t["m.g_idx"].tolist() == [0] * 16


def test_gptq_export_dequantizes_like_a_gptq_loader_for_both_grids():
    k = 128
    W = torch.randn(32, k, generator=torch.Generator().manual_seed(0)) * 0.05
    acc = HessianAccumulator(k)
    acc.add(torch.randn(512, k))
    for sym in (False, True):
        gq, _ = gptq_quantize(W, acc.H, 32, symmetric=sym, storage=INTEGER_ZERO)
        z = zero_points(gq)
        assert z.min() >= 1 and z.max() <= 15 and (not sym or bool((z == 8).all()))
        t = gptq_tensors("m", gq)
        loader = dequantize_gptq(t["m.qweight"], t["m.qzeros"], t["m.scales"], t["m.g_idx"])
        assert torch.allclose(loader, gq.dequantize(), atol=1e-6)
        assert ((loader - W).abs().max() < 0.05)
