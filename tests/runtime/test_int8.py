"""The 8-bit linear and lookup against a dequantized reference, and a tied head sharing the table."""

import pytest
import torch

from quantizer.methods.grid import quantize_per_channel
from quantizer.runtime.nn.int8 import Int8Linear, int8_embedding_module, int8_tied_head
from quantizer.runtime.nn.swap import dequantize_modules


def quantized(n, k, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return quantize_per_channel(w)


@pytest.mark.parametrize("rows", [1, 2, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_the_dequantized_reference(rows, bias):
    q = quantized(96, 160)
    b = torch.randn(96).to(torch.bfloat16) if bias else None
    layer = Int8Linear(q.codes, q.scale, bias=b)
    x = torch.randn(rows, 160).to(torch.bfloat16)
    want = x.float() @ q.dequantize().t() + (b.float() if bias else 0)
    got = layer(x).float()
    assert got.shape == (rows, 96)
    assert (got - want).abs().max() <= 0.01 * want.abs().max() + 1e-3


def test_lookup_and_tied_head_share_one_table_and_dequantize_together():
    q = quantized(64, 32, seed=1)
    model = torch.nn.Module()
    model.emb = torch.nn.Embedding(64, 32)
    int8_embedding_module(model.emb, q.codes, q.scale)
    model.head = int8_tied_head(model.emb)
    assert model.head.codes.data_ptr() == model.emb.codes.data_ptr()
    ids = torch.tensor([[3, 0, 63]])
    assert torch.equal(model.emb(ids)[0], q.dequantize(torch.bfloat16)[[3, 0, 63]])
    x = torch.randn(1, 32).to(torch.bfloat16)
    before = model.head(x)
    dequantize_modules(model)
    assert type(model.emb) is torch.nn.Embedding and type(model.head) is torch.nn.Linear
    assert model.head.weight is model.emb.weight
    assert (model.head(x).float() - before.float()).abs().max() <= 0.01 * before.float().abs().max() + 1e-3


def test_codes_read_at_any_offset_multiply_many_rows_through_the_decode_kernel():
    q = quantized(96, 160, seed=2)
    buffer = torch.zeros(q.codes.numel() + 8, dtype=torch.int8)
    codes = buffer[8:].view(96, 160)  # 8 bytes past an aligned start, as a checkpoint's tensor may be
    codes.copy_(q.codes)
    table = torch.nn.Embedding(96, 160)
    int8_embedding_module(table, codes, q.scale)
    head = int8_tied_head(table, threshold=64)  # 8 rows through _weight_int8pack_mm
    assert head.codes is table.codes  # aligned once, still shared
    x = torch.randn(8, 160, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    want = x.float() @ q.dequantize().t()
    assert (head(x).float() - want).abs().max() <= 0.01 * want.abs().max() + 1e-3
