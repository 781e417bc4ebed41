"""Weights on huge pages (runtime/nn/placement.py): the loader moves every quantized buffer into one
region advised for huge pages, keeping each tensor's values, shape, strides and sharing, so the model
computes the same logits; it moves nothing where huge pages are switched off or not offered."""

import pytest
import torch

from quantizer import memory
from quantizer.runtime import load_model
from quantizer.runtime.nn import placement
from quantizer.runtime.nn.int4 import Int4Linear, Int4Lookup


class Holder(torch.nn.Module):
    def __init__(self, **buffers):
        super().__init__()
        for name, tensor in buffers.items():
            self.register_buffer(name, tensor, persistent=False)


@pytest.fixture
def advice_taken(monkeypatch):
    """Huge pages offered and the advice taken, whatever this machine's kernel says."""
    monkeypatch.delenv(placement.ENV, raising=False)
    monkeypatch.setattr(placement, "huge_pages_offered", lambda: True)
    monkeypatch.setattr(placement, "advise_huge_pages", lambda address, length: address % memory.HUGE_PAGE == 0)


def test_buffers_keep_their_values_shapes_strides_and_sharing(advice_taken):
    gen = torch.Generator().manual_seed(0)
    table = torch.randint(0, 256, (64, 48), generator=gen, dtype=torch.uint8)
    scales = torch.randn(3, 64, 2, generator=gen).to(torch.bfloat16)
    a = Holder(pack=table, sz=scales, odd=torch.randn(5, generator=gen))
    b = Holder(pack=table, columns=table[:, 8:40:2], empty=torch.empty(0))  # shares a's table, and a strided view
    expected = {name: t.clone() for name, t in [("pack", table), ("sz", scales), ("columns", table[:, 8:40:2])]}
    moved = placement.onto_huge_pages([a, b])
    assert moved >= table.numel() + scales.numel() * 2 + 5 * 4
    assert torch.equal(a.pack, expected["pack"]) and torch.equal(a.sz, expected["sz"])
    assert torch.equal(b.columns, expected["columns"]) and b.columns.stride() == (48, 2)
    assert a.pack is b.pack and b.columns.data_ptr() == a.pack.data_ptr() + 8
    storages = {t.untyped_storage().data_ptr() for t in (a.pack, a.sz, a.odd, b.pack, b.columns)}
    assert len(storages) == 1 and a.pack.data_ptr() % memory.HUGE_PAGE == 0
    assert b.empty.numel() == 0


def test_a_loaded_model_computes_the_same_logits_from_one_region(tiny_q, monkeypatch):
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    monkeypatch.setenv(placement.ENV, "0")
    kept = load_model(tiny_q)
    monkeypatch.setattr(placement, "huge_pages_offered", lambda: True)
    monkeypatch.setattr(placement, "advise_huge_pages", lambda address, length: True)
    monkeypatch.delenv(placement.ENV)
    moved = load_model(tiny_q)
    quantized = [m for m in moved.modules() if isinstance(m, (Int4Linear, Int4Lookup))]
    assert len({m.int4pack.untyped_storage().data_ptr() for m in quantized}) == 1
    assert moved.get_output_embeddings().int4pack is moved.get_input_embeddings().int4pack
    with torch.inference_mode():
        assert torch.equal(moved(ids).logits, kept(ids).logits)


def test_nothing_moves_where_huge_pages_are_off_or_not_offered(monkeypatch, tmp_path):
    table = torch.zeros(4, 4)
    holder = Holder(table=table)
    monkeypatch.setenv(placement.ENV, "0")
    assert placement.onto_huge_pages([holder]) == 0 and holder.table is table
    monkeypatch.delenv(placement.ENV)
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(memory, "THP_SETTING", str(setting))
    assert not memory.huge_pages_offered()
    assert placement.onto_huge_pages([holder]) == 0 and holder.table is table
    setting.write_text("always [madvise] never\n")
    assert memory.huge_pages_offered()
    monkeypatch.setattr(memory, "THP_SETTING", str(tmp_path / "absent"))
    assert not memory.huge_pages_offered()


def test_a_refused_advice_moves_nothing(monkeypatch):
    table = torch.zeros(4, 4)
    holder = Holder(table=table)
    monkeypatch.delenv(placement.ENV, raising=False)
    monkeypatch.setattr(placement, "huge_pages_offered", lambda: True)
    monkeypatch.setattr(placement, "advise_huge_pages", lambda address, length: False)
    assert placement.onto_huge_pages([holder]) == 0 and holder.table is table
