import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.methods import gptq_method, grid
from quantizer.methods.error_stats import ErrorStats
from quantizer.methods.gptq import HessianAccumulator, error_objective
from quantizer.methods.gptq_method import GptqMethod
from quantizer.methods.grid import quantize_groupwise
from quantizer.schema.scheme import ModuleScheme


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 50), groups=st.integers(1, 4), row_chunk=st.integers(1, 20), piece=st.integers(1, 200),
       symmetric=st.booleans(), seed=st.integers(0, 2**16))
def test_the_report_in_pieces_is_the_report_of_the_whole_weight(rows, groups, row_chunk, piece, symmetric, seed):
    k = 32 * groups
    gen = torch.Generator().manual_seed(seed)
    W = (torch.randn(rows, k, generator=gen) * 0.05).bfloat16()
    acc = HessianAccumulator(k)
    acc.add(torch.randn(3 * k, k, generator=gen))
    scheme = ModuleScheme(bits=4, group_size=32, symmetric=symmetric)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gptq_method, "ROW_CHUNK", row_chunk)
        mp.setattr(grid, "SEARCH_CHUNK", piece)  # pieces of a few rows each
        q, entry = GptqMethod().quantize(W, acc, scheme)
    whole = ErrorStats()
    whole.add(W, q.dequantize())
    rtn = quantize_groupwise(W, 32, symmetric=symmetric).dequantize()
    assert entry["snr_db"] == pytest.approx(whole.as_dict()["snr_db"], abs=2e-4)  # both rounded to 4 places
    assert entry["max_abs_err"] == whole.max_abs_err
    assert entry["rtn_loss"] == pytest.approx(error_objective(W.float() - rtn, acc.H), rel=1e-5)
    assert entry["rtn_loss_rows"] == rows


def test_a_costly_reports_round_to_nearest_objective_is_estimated_from_evenly_spaced_rows():
    rows, k = 400, 256
    gen = torch.Generator().manual_seed(5)
    W = (torch.randn(rows, k, generator=gen) * 0.05).bfloat16()
    acc = HessianAccumulator(k)
    acc.add(torch.randn(3 * k, k, generator=gen) @ (torch.randn(k, k, generator=gen) * 0.2 + torch.eye(k)))
    scheme = ModuleScheme(bits=4, group_size=32)
    rtn = quantize_groupwise(W, 32).dequantize()
    exact = error_objective(W.float() - rtn, acc.H)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gptq_method, "REPORT_WORK", rows * k * k // 10)  # every 10th row
        _, entry = GptqMethod().quantize(W, acc, scheme)
    sampled = error_objective(W[::10].float() - rtn[::10], acc.H)
    assert entry["rtn_loss_rows"] == 40
    assert entry["rtn_loss"] == pytest.approx(sampled * 10, rel=1e-5)
    assert entry["rtn_loss"] == pytest.approx(exact, rel=0.1)
    assert entry["gptq_loss"] < entry["rtn_loss"]
