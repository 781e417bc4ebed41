"""Round-to-nearest, the uncalibrated method: row chunks change nothing."""

import pytest
import torch

from quantizer.methods.rtn import quantize_rtn
from quantizer.schema.scheme import ModuleScheme


def test_row_chunks_give_the_whole_tensor_result(monkeypatch):
    import quantizer.methods.rtn as rtn

    w = torch.randn(100, 64).to(torch.bfloat16).float()  # an fp32 weight: the chunked loop
    whole, stats = quantize_rtn(w, ModuleScheme(4, 32, False))
    monkeypatch.setattr(rtn, "ROW_CHUNK", 16)
    monkeypatch.setattr(rtn, "STATS_ELEMENTS", 5 * 64)
    chunked, chunked_stats = quantize_rtn(w, ModuleScheme(4, 32, False))
    assert all(torch.equal(a, b) for a, b in zip((whole.codes, whole.scale, whole.zero),
                                                  (chunked.codes, chunked.scale, chunked.zero)))
    assert stats.snr_db == pytest.approx(chunked_stats.snr_db)
