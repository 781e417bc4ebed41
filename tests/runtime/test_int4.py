import logging

import pytest
import torch
from conftest import AVX512_LAYOUT, needs_avx512_layout

import quantizer.runtime.nn.int4 as modules
from quantizer.formats.packing import pack_nibbles
from quantizer.methods.grid import quantize_groupwise
from quantizer.runtime.nn.gemm import prefill_linear
from quantizer.runtime.nn.int4 import Int4Linear, quantize_embedding_module, tied_head
from quantizer.runtime.nn.swap import dequantize_modules


def quantized(n, k, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    gq = quantize_groupwise(w, group)
    return gq, (pack_nibbles(gq.codes), gq.scale, gq.zero)


@pytest.mark.parametrize("group", [32, 64, 128, 256])
@pytest.mark.parametrize("n", [64, 80, 192, 576, 1536])
@pytest.mark.parametrize("rows", [1, 2, 7, 64])
def test_int4_linear_matches_dequantized_reference(rows, n, group):
    k = 512
    gq, tensors = quantized(n, k, group, seed=n + group)
    layer = Int4Linear.from_row_major(*tensors, group_size=group)
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) ).to(torch.bfloat16)
    ref = x.float() @ gq.dequantize(torch.bfloat16).float().t()
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    err = (out.float() - ref).abs().max().item()
    assert err <= 0.02 * ref.abs().max().item() + 1e-3, err
    if rows >= 2:  # the dequantize path runs the very weight of the reference through the prefill GEMM
        assert torch.equal(out, prefill_linear(x, gq.dequantize(torch.bfloat16)))


@needs_avx512_layout
def test_direct_dequant_only_where_the_block_tiles_and_bit_exact_there():
    for n, direct in ((192, True), (80, False), (48, True)):
        gq, tensors = quantized(n, 256, 64)
        layer = Int4Linear.from_row_major(*tensors, group_size=64)
        assert layer.direct is direct and (layer.packed is None) is direct
        assert torch.equal(layer.dequantized_weight(), gq.dequantize(torch.bfloat16))


@needs_avx512_layout
def test_direct_dequant_off_keeps_a_row_major_copy_with_identical_results():
    gq, tensors = quantized(128, 256, 64)
    x = torch.randn(5, 256).to(torch.bfloat16)
    direct = Int4Linear.from_row_major(*tensors, group_size=64)
    copy = Int4Linear.from_row_major(*tensors, group_size=64, direct_dequant=False)
    assert direct.packed is None and copy.packed is not None
    assert torch.equal(direct(x), copy(x))


def test_prefill_dequant_off_sends_every_batch_to_tinygemm_without_a_copy(monkeypatch):
    gq, tensors = quantized(128, 256, 64)
    layer = Int4Linear.from_row_major(*tensors, group_size=64, prefill_dequant=False)
    calls = []
    monkeypatch.setattr(modules, "dequantize_int4pack", lambda *a, **k: calls.append(a))
    layer(torch.randn(9, 256).to(torch.bfloat16))
    assert calls == [] and layer.packed is None


def test_threshold_picks_the_path(monkeypatch):
    gq, tensors = quantized(128, 256, 64)
    layer = Int4Linear.from_row_major(*tensors, group_size=64, threshold=4)
    real, calls = modules._prefill_weight, []
    monkeypatch.setattr(modules, "_prefill_weight", lambda *a, **k: calls.append(1) or real(*a, **k))
    layer(torch.randn(3, 256).to(torch.bfloat16))
    assert calls == []
    layer(torch.randn(4, 256).to(torch.bfloat16))
    assert calls == [1]


def test_layout_mismatch_falls_back_to_row_major_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(modules, "kernel_layout_matches", lambda n: False)
    monkeypatch.setattr(modules, "_warned_layout", False)
    gq, tensors = quantized(128, 256, 64)
    with caplog.at_level(logging.WARNING):
        layer = Int4Linear.from_row_major(*tensors, group_size=64)
    assert not layer.direct and layer.packed is not None
    assert "layout" in caplog.text
    x = torch.randn(6, 256).to(torch.bfloat16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, gq.dequantize(torch.bfloat16)))


class ScaledEmbedding(torch.nn.Embedding):
    """Like Gemma's: the lookup times a scale buffer."""

    def __init__(self, n, d):
        super().__init__(n, d)
        self.register_buffer("embed_scale", torch.tensor(3.0), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("cls", [torch.nn.Embedding, ScaledEmbedding])
def test_int4_embedding_looks_up_dequantized_rows_and_keeps_the_class_behaviour(tied, cls):
    gq, tensors = quantized(256, 128, 32)
    emb = quantize_embedding_module(cls(256, 128), *tensors, 32, with_kernel_layout=tied)
    assert isinstance(emb, cls) and "weight" not in dict(emb.named_parameters())
    assert (emb.packed is None) is (tied and AVX512_LAYOUT)  # tied: one copy, in the kernel layout int4q decodes
    ids = torch.tensor([[0, 5, 63, 64, 200, 255]])
    expected = gq.dequantize(torch.bfloat16)[ids[0]] * (3.0 if cls is ScaledEmbedding else 1.0)
    assert torch.equal(emb(ids)[0], expected)


def test_tied_head_shares_the_tables_tensors_and_dequantizes_to_the_same_weight():
    gq, tensors = quantized(256, 128, 32)
    emb = quantize_embedding_module(torch.nn.Embedding(256, 128), *tensors, 32, with_kernel_layout=True)
    head = tied_head(emb)
    assert head.int4pack is emb.int4pack and head.sz is emb.sz
    assert torch.equal(head.dequantized_weight(), gq.dequantize(torch.bfloat16))


def test_dequantize_modules_keeps_the_function_and_the_tie():
    gq, tensors = quantized(256, 128, 32)
    model = torch.nn.Module()
    model.emb = quantize_embedding_module(torch.nn.Embedding(256, 128), *tensors, 32, with_kernel_layout=True)
    model.head = tied_head(model.emb)
    model.get_input_embeddings = lambda: model.emb
    x = torch.randn(3, 128).to(torch.bfloat16)
    before = model.head(x)
    dequantize_modules(model)
    assert type(model.head) is torch.nn.Linear and type(model.emb) is torch.nn.Embedding
    assert model.head.weight is model.emb.weight
    assert torch.equal(model.head(x), before)


@pytest.mark.parametrize("int8_decode, int8_prefill", [(True, False), (False, True), (True, True)])
def test_int8_activations_go_through_the_int8_operator_for_the_chosen_rows(int8_decode, int8_prefill):
    from quantizer.runtime.kernels.w4a8 import has_w4a8

    if not has_w4a8():
        pytest.skip("this CPU has no AVX-512 VNNI: int8 activations fall back to the exact paths")
    _, tensors = quantized(128, 256, 64)
    exact = Int4Linear.from_row_major(*tensors, group_size=64)
    layer = Int4Linear.from_row_major(*tensors, group_size=64, int8_decode=int8_decode, int8_prefill=int8_prefill)
    for rows, int8 in ((1, int8_decode), (9, int8_prefill)):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        want = torch.ops.int4q_native.w4a8_mm(x, layer.int4pack, layer.sz, 64) if int8 else exact(x)
        assert torch.equal(layer(x), want)
        assert (layer.prefill_weight(rows) is None) is (int8 or rows < layer.threshold)
