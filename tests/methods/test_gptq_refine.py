"""Refinement after GPTQ: every step lowers the full objective, so no row's rises; its input is
left as it was; codes stay in range and scales stay values of their storage, of the same sign
where the storage is unsigned; on correlated inputs the objective falls well below GPTQ's."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.methods import gptq_refine
from quantizer.methods.gptq import HessianAccumulator, error_objective, gptq_quantize
from quantizer.methods.gptq_method import GptqMethod, GptqSettings
from quantizer.methods.gptq_refine import refine_symmetric
from quantizer.methods.grid import BF16, Storage
from quantizer.schema.scheme import ModuleScheme

Q4_0 = Storage(torch.float16, "integer", 32, signed_scale=True)
Q5_0 = Storage(torch.float16, "integer", 32, signed_scale=True, bits=5)


def problem(rows, k, seed):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(rows, k, generator=g) * 0.05
    x = torch.randn(4 * k, k, generator=g) @ torch.randn(k, k, generator=g) * 0.1
    return W, 2 * x.T @ x / x.shape[0]


def row_objectives(W, q, H):
    E = W - q.dequantize()
    return ((E @ H) * E).sum(1)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 30), groups=st.integers(1, 6), row_chunk=st.integers(1, 40), seed=st.integers(0, 2**16),
       storage=st.sampled_from([Q4_0, Q5_0, BF16]))
def test_refinement_never_raises_a_rows_objective_and_keeps_codes_and_scales_storable(rows, groups, row_chunk, seed,
                                                                                       storage):
    W, H = problem(rows, 32 * groups, seed)
    solved, _ = gptq_quantize(W, H, 32, symmetric=True, storage=storage, weighted_grids=True)
    solved_scale, solved_codes = solved.scale.clone(), solved.codes.clone()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gptq_refine, "ROW_CHUNK", row_chunk)  # rows refined a few at a time
        refined, objective = refine_symmetric(W, H, solved, storage)
    assert objective == pytest.approx(float(row_objectives(W, refined, H).sum()), rel=1e-4)
    assert torch.equal(solved.scale, solved_scale) and torch.equal(solved.codes, solved_codes)  # not refined in place
    assert bool((row_objectives(W, refined, H) <= row_objectives(W, solved, H) * (1 + 1e-5) + 1e-9).all())
    assert refined.codes.dtype == solved.codes.dtype and int(refined.codes.max()) < 2**storage.bits
    assert torch.equal(refined.zero, solved.zero)
    scale = refined.scale.float()
    assert torch.equal(scale, scale.to(storage.scale_dtype).float())
    if not storage.signed_scale:
        assert bool((scale * solved.scale.float() >= 0).all())


def test_on_correlated_inputs_refinement_lowers_gptqs_objective_by_a_tenth():
    W, H = problem(200, 512, seed=0)
    solved, _ = gptq_quantize(W, H, 32, symmetric=True, storage=Q4_0, weighted_grids=True)
    refined, _ = refine_symmetric(W, H, solved, Q4_0)
    assert error_objective(W - refined.dequantize(), H) < 0.9 * error_objective(W - solved.dequantize(), H)


def test_an_asymmetric_grid_is_refused():
    W, H = problem(4, 64, seed=1)
    solved, _ = gptq_quantize(W, H, 32, symmetric=False, storage=BF16)
    with pytest.raises(ValueError, match="symmetric"):
        refine_symmetric(W, H, solved, BF16)


@pytest.mark.parametrize("symmetric", [True, False])
def test_the_method_refines_symmetric_modules_only_and_reports_the_objective_it_reached(symmetric):
    W, H = problem(48, 128, seed=2)
    acc = HessianAccumulator(128)
    acc.add(torch.linalg.cholesky(H / 2).T.contiguous() * 128**0.5)  # rows whose H is H
    scheme = ModuleScheme(bits=4, group_size=32, symmetric=symmetric)
    plain, plain_entry = GptqMethod().quantize(W, acc, scheme, Q4_0 if symmetric else BF16)
    refined, entry = GptqMethod(GptqSettings(refine=True)).quantize(W, acc, scheme, Q4_0 if symmetric else BF16)
    assert entry["gptq_loss"] == pytest.approx(error_objective(W - refined.dequantize(), acc.H), rel=1e-4)
    if symmetric:
        assert entry["gptq_loss"] < plain_entry["gptq_loss"]
    else:
        assert torch.equal(refined.codes, plain.codes) and entry["gptq_loss"] == plain_entry["gptq_loss"]
