"""A runtime module rebuilt from its state (nn/state.py) computes what it computed, shares what it
shared, and no class outside the list is saved or rebuilt."""

import pytest
import torch
from test_int4 import ScaledEmbedding, quantized

from quantizer.runtime.nn.int4 import Int4Linear, quantize_embedding_module, tied_head
from quantizer.runtime.nn.int8 import Int8Linear
from quantizer.runtime.nn.state import NotSaveable, module_state, rebuilt_module


def round_trip(*modules):
    tensors = {}
    states = [module_state(m, tensors, f"m{i}") for i, m in enumerate(modules)]
    return [rebuilt_module(s, tensors) for s in states], tensors


def linears():
    g = torch.Generator().manual_seed(1)
    _, (packed, scale, zero) = quantized(192, 128, 32)
    bias = torch.randn(192, generator=g).to(torch.bfloat16)
    plain = torch.nn.Linear(128, 192, dtype=torch.bfloat16)
    codes = torch.randint(-127, 128, (192, 128), dtype=torch.int8, generator=g)
    return [Int4Linear.from_row_major(packed, scale, zero, 32, bias=bias, int8_decode=True),
            Int8Linear(codes, torch.rand(192, generator=g) * 1e-2), plain]


@pytest.mark.parametrize("module", linears(), ids=lambda m: type(m).__name__)
def test_a_rebuilt_linear_computes_the_same_bits(module):
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    (rebuilt,), _ = round_trip(module)
    assert type(rebuilt) is type(module)
    with torch.inference_mode():
        for rows in (1, 3):
            assert torch.equal(rebuilt(x[:rows]), module(x[:rows]))


def test_a_tied_table_and_head_are_saved_once_and_rebuilt_sharing():
    _, tensors = quantized(256, 128, 32)
    table = quantize_embedding_module(torch.nn.Embedding(256, 128), *tensors, 32, with_kernel_layout=True)
    head = tied_head(table)
    (table2, head2), saved = round_trip(table, head)
    assert head2.int4pack is table2.int4pack
    assert len(saved) == sum(t is not None for t in table._buffers.values())
    ids = torch.tensor([[0, 5, 255]])
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(table2(ids), table(ids)) and torch.equal(head2(x), head(x))


def test_a_class_outside_the_list_is_refused_both_ways():
    _, tensors = quantized(256, 128, 32)
    scaled = quantize_embedding_module(ScaledEmbedding(256, 128), *tensors, 32, with_kernel_layout=False)
    with pytest.raises(NotSaveable, match="Int4ScaledEmbedding"):
        module_state(scaled, {}, "m")
    state = module_state(torch.nn.Embedding(4, 8), {}, "m")
    with pytest.raises(ValueError, match="module class 'Sequential'"):
        rebuilt_module({**state, "kind": "Sequential"}, {})
    with pytest.raises(ValueError, match="lacks tensor m.weight"):
        rebuilt_module(state, {})
